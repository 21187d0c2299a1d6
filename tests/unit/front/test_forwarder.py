"""The forwarder's hold, migration, hang and drain, in fake loop time (looptime).

The forwarder runs as it does in the pod; what is doubled is only what it
reaches through its seams (``tests/doubles/front.py``): the client's
connection, the engines behind the upstream seam, and the router (the pod's
real ``Router`` where the subject is its hang judgement). Time is the
subject, so a hold of 30 s takes no real time, and the times asserted are
those the loop kept.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from doubles.front import (
    Client,
    Engine,
    Engines,
    Router,
    after,
    hangs,
    refuses,
    streams,
)

from understudy.front import fsm
from understudy.front.config import FrontConfig
from understudy.front.forwarder import Forwarder
from understudy.front.metrics import FrontMetrics
from understudy.front.router import Router as PodRouter
from understudy.wire.serving import COHORT_HEADER

pytestmark = [pytest.mark.looptime, pytest.mark.timeout(10)]

A, B = "engine-primary/aa", "engine-shadow-1/bb"


class Pod:
    """A forwarder, its router double and two engine doubles."""

    def __init__(self, hold_s: float = 30.0, migration_limit: int = 3, **behave: Any) -> None:
        self.a = Engine(A, behave.get("a", after(1.0)), pid=101)
        self.b = Engine(B, behave.get("b", after(1.0)), pid=102)
        self.router = Router({A: self.a, B: self.b})
        self.metrics = FrontMetrics()
        self.fwd = Forwarder(self.router, fsm.Policy(hold_s, migration_limit), self.metrics)
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()

    def at(self, t: float, fn: Any, *args: Any) -> None:
        self.loop.call_at(self.t0 + t, fn, *args)

    def now(self) -> float:
        return self.loop.time() - self.t0

    def send(self, doc: dict[str, Any] | None = None) -> Client:
        client = Client()
        self.fwd.handle(client.request(doc or {"prompt": "hi"}))
        return client

    async def answered(self, client: Client) -> float:
        """Wait for the client's whole answer; when it came."""
        await client.done.wait()
        await asyncio.sleep(0)  # the request's task ends after its answer
        return self.now()

    async def close(self) -> None:
        await self.a.close()
        await self.b.close()


def engine_of(client: Client) -> str:
    return str(json.loads(client.body)["engine"])


def events(client: Client) -> list[dict[str, Any]]:
    out = []
    for block in client.body.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: {"):
                out.append(json.loads(line[6:]))
    return out


# ------------------------------------------------------------------ hold --


async def test_a_request_waits_for_a_route_then_goes_at_once() -> None:
    pod = Pod(a=after(0.1))
    client = pod.send()
    pod.at(2.0, pod.router.set, A)
    assert await pod.answered(client) == pytest.approx(2.1)
    assert (client.status, engine_of(client)) == (200, A)
    assert pod.fwd.inflight == 0 and pod.metrics.hold_expired.value == 0
    await pod.close()


async def test_a_hold_that_runs_out_is_a_503_with_retry_after_at_the_hold() -> None:
    pod = Pod(hold_s=5.0)
    client = pod.send()
    assert await pod.answered(client) == pytest.approx(5.0)
    assert client.status == 503
    assert b"Retry-After: 1" in client.data
    assert b"within the hold of 5.0s" in client.body
    assert pod.metrics.hold_expired.value == 1
    assert pod.metrics.requests.labels(code="5xx").value == 1
    await pod.close()


async def test_a_refusing_engine_is_asked_again_until_the_route_moves() -> None:
    pod = Pod(a=refuses, b=after(0.1))
    pod.router.set(A)
    client = pod.send()
    pod.at(0.3, pod.router.set, B, 2)
    assert await pod.answered(client) == pytest.approx(0.4)
    assert engine_of(client) == B
    assert {o for _, o in pod.router.retries} == {fsm.Outcome.NOT_ACTIVE}
    assert pod.metrics.migrations.by == {}  # it never ran: no migration
    await pod.close()


async def test_an_engine_not_listening_yet_is_waited_for() -> None:
    pod = Pod(a=after(0.1))
    pod.a.listening = False
    pod.router.set(A)
    client = pod.send()
    pod.at(0.52, setattr, pod.a, "listening", True)
    # Asked again every 0.05 s (the router's patience): the first ask after
    # 0.52 s gets in.
    assert await pod.answered(client) == pytest.approx(0.65)
    assert engine_of(client) == A
    assert pod.router.retries[0] == (A, fsm.Outcome.UNREACHABLE)
    await pod.close()


async def test_a_route_that_never_takes_the_request_ends_at_the_hold() -> None:
    """The route names an engine that never listens: the request is asked
    again until its hold is over, then told (it used to go on asking, at
    once and for ever, once the hold was over)."""
    pod = Pod(hold_s=5.0)
    pod.a.listening = False
    pod.router.set(A)
    client = pod.send()
    assert await pod.answered(client) == pytest.approx(5.0)
    assert client.status == 503 and b"within the hold of 5.0s" in client.body
    assert len(pod.router.retries) == pytest.approx(5.0 / pod.router.patience, abs=2)
    await pod.close()


# --------------------------------------------------------------- migrate --


async def test_the_requests_a_death_broke_are_resent_saying_how_many() -> None:
    """Its death word seen, the engine's requests broke together: each goes
    to the next engine with their count (COHORT_HEADER), so that it starts
    them in one step once all are in; a death seen only by its connections'
    close says nothing."""
    pod = Pod(a=streams(20, 0.1), b=streams(20, 0.1))
    pod.router.set(A)
    clients = [pod.send({"prompt": "hi", "stream": True}) for _ in range(3)]
    pod.at(0.55, pod.a.die, True)
    pod.at(0.6, pod.router.set, B, 2)
    for client in clients:
        await pod.answered(client)
        assert client.status == 200
    cohort = (COHORT_HEADER.encode(), b"3")
    assert [cohort in h for h in pod.b.headers] == [True] * 3
    assert not any(cohort[0] == k for h in pod.a.headers for k, _ in h)
    await pod.close()

    pod = Pod(b=after(0.1))
    pod.router.set(A)
    client = pod.send({"prompt": "hi", "max_tokens": 4})
    pod.at(0.5, pod.a.die)
    pod.at(0.6, pod.router.set, B, 2)
    await pod.answered(client)
    assert not any(k == COHORT_HEADER.encode() for k, _ in pod.b.headers[0])
    await pod.close()


async def test_a_request_whose_engine_dies_is_replayed_on_the_next() -> None:
    pod = Pod()
    pod.router.set(A)
    client = pod.send({"prompt": "hi", "max_tokens": 4})
    pod.at(0.5, pod.a.die)
    pod.at(0.6, pod.router.set, B, 2)
    assert await pod.answered(client) == pytest.approx(1.6)
    assert (client.status, engine_of(client)) == (200, B)
    assert pod.metrics.migrations.labels(kind="new").value == 1
    # The same request, under the same id, went to both.
    first, second = pod.a.received[0], pod.b.received[0]
    assert first == second and first["understudy"]["request_id"].startswith("cmpl-")
    await pod.close()


async def test_a_stream_cut_by_a_death_goes_on_from_the_next_engine_token_exact() -> None:
    pod = Pod(a=streams(6, 0.1), b=streams(6, 0.1))
    pod.router.set(A)
    client = pod.send({"prompt": "hi", "stream": True})
    pod.at(0.35, pod.a.die)  # after three tokens
    pod.at(0.4, pod.router.set, B, 2)
    assert await pod.answered(client) == pytest.approx(0.7)
    got = events(client)
    assert [e["text"] for e in got] == [f"t{i}" for i in range(6)]
    assert [e["engine"] for e in got] == [A] * 3 + [B] * 3
    assert client.body.endswith(b"data: [DONE]\n\n")
    assert pod.b.received[0]["understudy"]["resume"] == {"token_ids": [0, 1, 2], "started": True}
    assert pod.metrics.migrations.labels(kind="ongoing").value == 1
    await pod.close()


async def test_past_the_migration_limit_the_client_is_told() -> None:
    pod = Pod(migration_limit=1)
    pod.router.set(A)
    client = pod.send()
    pod.at(0.5, pod.a.die)
    pod.at(0.6, pod.router.set, B, 2)
    pod.at(1.0, pod.b.die)
    assert await pod.answered(client) == pytest.approx(1.0)
    assert client.status == 503
    assert b"died 2 times; migration limit is 1" in client.body
    assert pod.metrics.migrations_failed.labels(reason="limit").value == 1
    await pod.close()


async def test_each_migration_gets_its_own_hold() -> None:
    """The request moved at 20 s into a 30 s hold: it may wait 30 s more."""
    pod = Pod(hold_s=30.0, a=after(20.0), b=after(0.1))
    pod.router.set(A)
    client = pod.send()
    pod.at(19.0, pod.a.die)
    pod.at(19.0, pod.router.set, None)
    pod.at(45.0, pod.router.set, B, 2)
    assert await pod.answered(client) == pytest.approx(45.1)
    assert engine_of(client) == B
    await pod.close()


async def test_the_fast_path_hands_an_attempt_that_broke_to_the_slow_one() -> None:
    pod = Pod(a=after(0.2), b=after(0.1))
    pod.a.idle = 1  # a kept-alive connection to take
    pod.router.set(A)
    client = pod.send()
    assert pod.fwd.at_engine == 1  # sent from the handler itself
    pod.at(0.1, pod.a.die)
    pod.at(0.15, pod.router.set, B, 2)
    assert await pod.answered(client) == pytest.approx(0.25)
    assert engine_of(client) == B
    assert pod.metrics.migrations.labels(kind="new").value == 1
    assert pod.fwd.at_engine == 0
    await pod.close()


# ------------------------------------------------------------------ hang --


async def test_a_hung_engine_is_killed_and_its_request_moves_on() -> None:
    """The real router over engine doubles: A stops beating (and answering) at
    0.5 s; a punctual check more than ``hang_after_s`` later condemns it, its
    kill cuts the request, the lock passes to B, and the request is served
    there, all within a check of the limit."""
    loop = asyncio.get_running_loop()
    a, b = Engine(A, hangs, pid=101), Engine(B, after(0.1), pid=102)
    engines = Engines({A: a, B: b}, loop.time)
    cfg = FrontConfig(run_dir=Path("/nonexistent"), lock_socket="-", hang_after_s=1.0)
    metrics = FrontMetrics()
    router = PodRouter(cfg, metrics, engines, clock=loop.time)
    fwd = Forwarder(router, fsm.Policy(30.0, 3), metrics)
    # The lock: A's death hands it to B (a shadow that takes 50 ms to wake).
    engines.on_kill = lambda dead: loop.call_later(
        0.05, router.feed, fsm.HolderSeen(B, 2) if dead is a else fsm.HolderSeen(None, 2)
    )
    router.feed(fsm.HolderSeen(A, 1))
    beats = asyncio.create_task(router.check_beats())
    t0 = loop.time()
    loop.call_at(t0 + 0.5, setattr, a, "hung_at", t0 + 0.5)
    client = Client()
    fwd.handle(client.request({"prompt": "hi"}))
    await client.done.wait()
    took = loop.time() - t0
    assert engines.killed == [A]
    assert metrics.hung.value == 1
    assert engine_of(client) == B
    assert metrics.migrations.labels(kind="new").value == 1
    # Silent past 1.0 s at a check (every 0.1 s), then 50 ms to the next
    # route, and B's 0.1 s answer.
    assert 1.5 + 0.15 < took <= 1.5 + 0.1 + 0.15 + 1e-6
    assert router.state.condemned == A
    beats.cancel()
    await asyncio.gather(beats, return_exceptions=True)
    await router.close()
    await a.close()
    await b.close()


async def test_a_silent_engine_that_still_works_gets_the_longer_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A's heartbeat stops at 0.5 s but its process keeps using CPU (its loop
    starved of the GIL or of its cgroup's share): it is not killed at the
    heartbeat limit, only past ``working_hang_after_s``, and the reprieve is
    logged once."""
    loop = asyncio.get_running_loop()
    a = Engine(A, pid=101)
    a.works_while_silent = True
    engines = Engines({A: a}, loop.time)
    cfg = FrontConfig(
        run_dir=Path("/nonexistent"), lock_socket="-", hang_after_s=1.0, working_hang_after_s=3.0
    )
    metrics = FrontMetrics()
    router = PodRouter(cfg, metrics, engines, clock=loop.time)
    router.feed(fsm.HolderSeen(A, 1))
    beats = asyncio.create_task(router.check_beats())
    t0 = loop.time()
    loop.call_at(t0 + 0.5, setattr, a, "hung_at", t0 + 0.5)
    await asyncio.sleep(3.4)
    assert engines.killed == [] and metrics.hung.value == 0
    assert caplog.text.count("event=silent_engine_working") == 1
    await asyncio.sleep(0.3)  # silent 3.0 s at 3.5 s, judged at the next check
    assert engines.killed == [A] and metrics.hung.value == 1
    beats.cancel()
    await asyncio.gather(beats, return_exceptions=True)
    await router.close()


async def test_a_check_that_came_late_condemns_nobody(caplog: pytest.LogCaptureFixture) -> None:
    """The whole machine stalled for 2 s (the front as well as the engine):
    the first check after it is late, and judges nothing; the engine beats
    again and is never killed."""
    loop = asyncio.get_running_loop()
    skew = [0.0]
    a = Engine(A, pid=101)
    engines = Engines({A: a}, lambda: loop.time() + skew[0])
    cfg = FrontConfig(run_dir=Path("/nonexistent"), lock_socket="-", hang_after_s=1.0)
    metrics = FrontMetrics()
    router = PodRouter(cfg, metrics, engines, clock=lambda: loop.time() + skew[0])
    router.feed(fsm.HolderSeen(A, 1))
    beats = asyncio.create_task(router.check_beats())
    t0 = loop.time()

    def stall() -> None:
        a.hung_at = t0 + 0.5 + skew[0]  # its last beat before the stall
        skew[0] += 2.0

    loop.call_at(t0 + 0.55, stall)
    loop.call_at(t0 + 0.65, setattr, a, "hung_at", None)  # it beats again
    await asyncio.sleep(3.0)
    assert engines.killed == [] and metrics.hung.value == 0
    assert "event=beat_check_skipped" in caplog.text
    assert router.route == fsm.Route(A, 1)
    beats.cancel()
    await asyncio.gather(beats, return_exceptions=True)
    await router.close()


# ----------------------------------------------------------------- drain --


async def test_a_drain_waits_for_the_requests_in_flight_and_no_longer() -> None:
    pod = Pod(a=after(2.0))
    pod.router.set(A)
    clients = [pod.send() for _ in range(3)]
    await asyncio.sleep(0.1)
    assert (pod.fwd.inflight, pod.fwd.at_engine) == (3, 3)
    await pod.fwd.settle(5.0)
    assert pod.now() == pytest.approx(2.0)
    assert all(c.status == 200 for c in clients) and pod.fwd.inflight == 0
    await pod.close()


async def test_a_drain_is_bounded() -> None:
    pod = Pod(a=hangs)
    pod.router.set(A)
    client = pod.send()
    await pod.fwd.settle(1.5)
    assert pod.now() == pytest.approx(1.5)
    assert pod.fwd.inflight == 1 and not client.done.is_set()
    pod.a.die()
    pod.router.set(B, 2)
    await pod.answered(client)
    assert engine_of(client) == B
    await pod.close()
