"""Coordinatorless weight loading with roles: two engines × two devices.

Independent RW_OR_RO per device can cross-acquire and deadlock (bounded here
by the hello timeout); deterministic roles (primary RW_OR_RO, shadow RO)
never do; and a primary that dies between two device commits is recovered
without restarting the shadow.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from gmsprocs import HERE, Engine, Gms
from procs import PYTHON, Proc, wait_for

from understudy.gms.client import query_state
from understudy.gms.config import socket_path

pytestmark = pytest.mark.process

MiB = 1 << 20


def worker(
    engine: Engine, trial: int, device: int, sock: Path, mode: str, timeout: float, **kw: object
) -> None:
    engine.send(
        op="worker",
        trial=trial,
        device=device,
        devices=2,
        socket=str(sock),
        mode=mode,
        timeout=timeout,
        size=MiB,
        **kw,
    )


def test_independent_rw_or_ro_cross_acquires_and_deadlocks(gms: Gms) -> None:
    for d in (0, 1):
        gms.server(d)
    a, b = gms.engine("A"), gms.engine("B")
    timeout = 2.0
    # A's worker 0 and B's worker 1 win their devices first...
    worker(a, 0, 0, gms.path(0), "RW_OR_RO", timeout)
    worker(b, 0, 1, gms.path(1), "RW_OR_RO", timeout)
    assert a.wait_event(trial=0, device=0, event="granted")["mode"] == "RW"
    assert b.wait_event(trial=0, device=1, event="granted")["mode"] == "RW"
    # ...then A1 and B0 arrive: each waits for RO on a device the other engine
    # holds RW, and neither can commit until its own barrier completes.
    worker(a, 0, 1, gms.path(1), "RW_OR_RO", timeout)
    worker(b, 0, 0, gms.path(0), "RW_OR_RO", timeout)
    wait_for(lambda: all(gms.state(d)["waiting"] == 1 for d in (0, 1)), 10, what="cross wait")
    assert all(gms.state(d)["state"] == "RW" for d in (0, 1))
    # The deadlock ends only because every wait is bounded.
    assert a.wait_event(trial=0, device=1, event="error")["error"] == "GmsTimeoutError"
    assert b.wait_event(trial=0, device=0, event="error")["error"] == "GmsTimeoutError"
    assert not any(e.get("event") in ("done", "committed") for e in a.events + b.events)


def test_deterministic_roles_never_deadlock_over_100_start_orders(tmp_path: Path) -> None:
    trials, seed = 100, 20260217
    rng = random.Random(seed)
    root = tmp_path / "gms"
    host = Proc(
        [PYTHON, str(HERE / "multiserver.py"), str(root), str(trials), "2"],
        log=tmp_path / "servers.log",
    )
    gms = Gms(tmp_path / "engines")
    try:
        assert host.json_line(60)["ready"]
        primary, shadow = gms.engine("primary"), gms.engine("shadow")
        orders = []
        for t in range(trials):
            starts = [
                (primary, "RW_OR_RO", 0),
                (primary, "RW_OR_RO", 1),
                (shadow, "RO", 0),
                (shadow, "RO", 1),
            ]
            rng.shuffle(starts)
            orders.append(tuple(("P" if e is primary else "S") + str(d) for e, _, d in starts))
            for engine, mode, d in starts:
                worker(engine, t, d, socket_path(root / f"t{t}", d), mode, 10.0)
                time.sleep(rng.choice([0, 0, 0.001, 0.003]))
            for engine in (primary, shadow):
                for d in (0, 1):
                    done = engine.wait_event(20, trial=t, device=d, event="done")
                    assert done["loaded"] == (engine is primary), (t, orders[t], done)
            for engine in (primary, shadow):
                engine.send(op="close_trial", trial=t)
                engine.wait_event(10, trial=t, event="closed")
        assert not any(e.get("event") == "error" for e in primary.events + shadow.events)
        assert len(set(orders)) > 12  # the start orders really varied
    finally:
        gms.stop()
        host.stop()


def test_partial_commit_primary_dies_shadow_waits_restarted_primary_finishes(gms: Gms) -> None:
    for d in (0, 1):
        gms.server(d)
    primary = gms.engine("primary")
    shadow = gms.engine("shadow")
    # The shadow starts first and waits for commits on both devices.
    for d in (0, 1):
        worker(shadow, 0, d, gms.path(d), "RO", 30.0)
    worker(primary, 0, 0, gms.path(0), "RW_OR_RO", 10.0)
    worker(primary, 0, 1, gms.path(1), "RW_OR_RO", 10.0, pause_before_commit=True)
    primary.wait_event(trial=0, device=0, event="committed")
    primary.wait_event(trial=0, device=1, event="paused")
    shadow.wait_event(trial=0, device=0, event="granted")  # B0 imports device 0
    primary.kill9()  # dies with device 0 committed, device 1 not

    wait_for(lambda: gms.state(1)["state"] == "EMPTY", 10, what="device 1 aborted")
    st0, st1 = gms.state(0), gms.state(1)
    assert st0["state"] in ("COMMITTED", "RO") and st0["allocations"] == 1
    assert st1["allocations"] == 0 and st1["waiting"] == 1  # B1 keeps waiting
    assert shadow.alive() and not any(e.get("event") in ("error", "done") for e in shadow.events)

    again = gms.engine("primary-restarted")
    for d in (0, 1):
        worker(again, 0, d, gms.path(d), "RW_OR_RO", 10.0)
    assert again.wait_event(trial=0, device=0, event="granted")["mode"] == "RO"
    assert again.wait_event(trial=0, device=1, event="granted")["mode"] == "RW"
    assert (
        again.wait_event(trial=0, device=0, event="done")["loaded"] is False
    )  # imported, no reload
    assert again.wait_event(trial=0, device=1, event="done")["loaded"] is True
    for d in (0, 1):  # the shadow finishes without ever restarting
        assert shadow.wait_event(trial=0, device=d, event="done")["loaded"] is False
    assert not any(e.get("event") == "error" for e in shadow.events)
    assert query_state(gms.path(1), 5).sessions
