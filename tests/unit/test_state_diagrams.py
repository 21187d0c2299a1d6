"""The cores share one machine shape, and docs/state-machines.md is drawn from it."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

import pytest

from understudy.engine_shim import fsm as engine
from understudy.front import fsm as front
from understudy.gms import fsm as gms
from understudy.lockserver import fsm as lock
from understudy.operator import lifecycle
from understudy.respawner import restart
from understudy.wire import machine

ROOT = Path(__file__).resolve().parents[2]
CORES = [lock, gms.weights, gms.kv, engine, front, lifecycle, restart]


def _generator() -> ModuleType:
    path = ROOT / "docs" / "make_state_diagrams.py"
    spec = importlib.util.spec_from_file_location("make_state_diagrams", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_diagrams_match_the_tables() -> None:
    gen = _generator()
    committed = (ROOT / "docs" / "state-machines.md").read_text()
    assert committed == gen.render(), (
        f"docs/state-machines.md is stale; regenerate it with `{gen.COMMAND}`"
    )


@pytest.mark.parametrize("core", CORES, ids=lambda m: m.__name__)
def test_every_core_has_the_shared_shape(core: ModuleType) -> None:
    assert list(inspect.signature(core.step).parameters)[1:] == ["event", "now"]
    assert issubclass(core.InvalidTransition, machine.InvalidTransition)
    assert core.TRANSITIONS
    for entry in core.TRANSITIONS.values():
        assert isinstance(entry, machine.Entry) and entry.targets
