"""Fixtures of the monitoring tests: the real tools, installed on first use."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from monitoring_tools import tool as _tool


@pytest.fixture(scope="session")
def tool() -> Callable[[str], str]:
    return _tool
