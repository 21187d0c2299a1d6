"""GMS process tests: the ``gms`` fixture (servers and client agents in tmp_path)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from doubles.gpu import GpuDouble
from gmsprocs import Gms


@pytest.fixture
def gms(tmp_path: Path) -> Iterator[Gms]:
    g = Gms(tmp_path)
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture(scope="session")
def cuda_double_libs() -> Path:
    """The CUDA driver double's libraries (host memory, not a GPU), built once."""
    from doubles.gpu import build

    return build()


@pytest.fixture
def cuda_double(
    cuda_double_libs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> GpuDouble:
    """A machine of the double in front of every process this test starts."""
    return GpuDouble(cuda_double_libs, tmp_path, monkeypatch)
