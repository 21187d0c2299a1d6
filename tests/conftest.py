from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/procs.py is shared by every tier; tests import it as a plain module.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_addoption(parser: pytest.Parser) -> None:
    # The cluster tier's options (tests/cluster/conftest.py); here, because
    # pytest reads options only from the conftest files it loads first.
    group = parser.getgroup("understudy cluster tier")
    group.addoption("--understudy-image", help="project image the nodes can pull")
    group.addoption("--understudy-device-class", default="gpu.understudy.dev")
    group.addoption("--understudy-dra-driver", default="gpu.understudy.dev")
