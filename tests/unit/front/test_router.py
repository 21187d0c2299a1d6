"""The pod's router: its waits for a route, in fake loop time (looptime).

The router runs as in the pod, over doubles of the engines it reaches
(heartbeats, sockets, kill: ``tests/doubles/front.py``); the lock's word is
fed to it as the lock watch would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from doubles.front import Engine, Engines

from understudy.front import fsm
from understudy.front.config import FrontConfig
from understudy.front.metrics import FrontMetrics
from understudy.front.router import Router

pytestmark = [pytest.mark.looptime, pytest.mark.timeout(10)]

A, B = "engine-primary/aa", "engine-shadow-1/bb"


def router(hold_s: float = 30.0) -> tuple[Router, Engine, Engine]:
    loop = asyncio.get_running_loop()
    a, b = Engine(A, pid=101), Engine(B, pid=102)
    cfg = FrontConfig(run_dir=Path("/nonexistent"), lock_socket="-", hold_s=hold_s)
    r = Router(cfg, FrontMetrics(), Engines({A: a, B: b}, loop.time), clock=loop.time)
    return r, a, b


async def test_a_hold_counts_the_request_as_held_until_the_route_comes() -> None:
    r, _, _ = router()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    holds = [asyncio.create_task(r.hold(t0 + 30)) for _ in range(2)]
    await asyncio.sleep(1.0)
    assert r.held == 2 and r.metrics.held_total.value == 2
    assert not r.ready()[0]  # never had an engine
    r.feed(fsm.HolderSeen(A, 1))
    assert await asyncio.gather(*holds) == [fsm.Route(A, 1)] * 2
    assert r.held == 0
    assert r.metrics.hold.total == pytest.approx(2.0)  # two waits of 1 s
    await r.close()


async def test_a_hold_ends_at_its_deadline_and_a_cancelled_one_is_let_go() -> None:
    r, _, _ = router()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await r.hold(t0 + 2.5) is None
    assert loop.time() - t0 == pytest.approx(2.5)
    task = asyncio.create_task(r.hold(loop.time() + 30))
    await asyncio.sleep(0.5)
    assert r.held == 1
    task.cancel()  # its client went away
    await asyncio.gather(task, return_exceptions=True)
    assert r.held == 0
    await r.close()


async def test_waiting_for_an_engine_that_is_not_listening_ends_when_it_does() -> None:
    r, a, _ = router()
    loop = asyncio.get_running_loop()
    r.feed(fsm.HolderSeen(A, 1))
    a.listening = False
    route = fsm.Route(A, 1)
    t0 = loop.time()
    # Patience is 50 ms; the socket watcher wakes the wait the moment the
    # socket appears.
    await r.retry_after(route, fsm.Outcome.UNREACHABLE, t0 + 30)
    assert loop.time() - t0 == pytest.approx(0.05)
    loop.call_later(0.0123, setattr, a, "listening", True)
    t1 = loop.time()
    await r.retry_after(route, fsm.Outcome.UNREACHABLE, t1 + 30)
    assert loop.time() - t1 == pytest.approx(0.013, abs=0.0011)
    await r.close()


async def test_a_refused_or_broken_attempt_waits_for_the_next_route() -> None:
    r, _, _ = router()
    loop = asyncio.get_running_loop()
    r.feed(fsm.HolderSeen(A, 1))
    route = fsm.Route(A, 1)
    for outcome, patience in ((fsm.Outcome.NOT_ACTIVE, 0.25), (fsm.Outcome.BROKEN, 0.005)):
        t0 = loop.time()
        await r.retry_after(route, outcome, t0 + 30)
        assert loop.time() - t0 == pytest.approx(patience)
    # The lock names the next engine: the wait ends then.
    loop.call_later(0.1, r.feed, fsm.HolderSeen(B, 2))
    t0 = loop.time()
    await r.retry_after(route, fsm.Outcome.NOT_ACTIVE, t0 + 30)
    assert loop.time() - t0 == pytest.approx(0.1)
    assert r.route == fsm.Route(B, 2) and r.metrics.failovers.value == 1
    # Already moved on: no wait at all.
    await r.retry_after(route, fsm.Outcome.BROKEN, loop.time() + 30)
    await r.close()


async def test_connections_to_an_engine_that_is_gone_are_closed() -> None:
    r, a, b = router()
    a.idle = 3
    assert r.upstream(fsm.Route(A, 1)) is a.upstream
    assert r.upstream(fsm.Route(B, 2)) is b.upstream
    assert a.idle == 0  # closed when B's were first asked for
    await r.close()
