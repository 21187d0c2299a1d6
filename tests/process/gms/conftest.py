"""GMS process tests: the ``gms`` fixture (servers and client agents in tmp_path)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gmsprocs import Gms


@pytest.fixture
def gms(tmp_path: Path) -> Iterator[Gms]:
    g = Gms(tmp_path)
    try:
        yield g
    finally:
        g.stop()
