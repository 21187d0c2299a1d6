"""The gateway's router over pods, its admission and its metrics, in fake
loop time (looptime). The pods' word (probes, broken attempts) is fed to
the router as its checks would; the forwarder over real pods is
tests/process/test_gateway.py."""

from __future__ import annotations

import asyncio

import pytest

from understudy.front import fsm, pods, upstream
from understudy.front.gateway import GatewayConfig, GatewayMetrics, PodRouter, admit
from understudy.front.pods import Listing, Phase, Probed

pytestmark = [pytest.mark.looptime, pytest.mark.timeout(10)]

A = Listing("a", "127.0.0.1", 18900, 18903)
B = Listing("b", "127.0.0.1", 18910, 18913)


def router() -> PodRouter:
    return PodRouter(GatewayConfig(pods=(A, B)), GatewayMetrics())


def ready(r: PodRouter, *names: str) -> None:
    now = asyncio.get_running_loop().time()
    for name in names:
        r.feed(Probed(name, True, now))


async def test_a_request_is_held_until_a_pod_is_ready_and_no_longer() -> None:
    r = router()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    held = asyncio.create_task(r.hold(t0 + 30))
    await asyncio.sleep(2.0)
    assert r.held == 1 and r.route is None  # listed, never heard from
    ready(r, "a")
    assert await held == fsm.Route("a", 1)
    assert r.held == 0
    assert r.metrics.hold.total == pytest.approx(2.0)
    await r.close()


async def test_a_hold_with_no_ready_pod_ends_at_its_deadline() -> None:
    r = router()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await r.hold(t0 + 3.5) is None
    assert loop.time() - t0 == pytest.approx(3.5)
    assert r.held == 0
    await r.close()


async def test_a_refused_pod_is_dead_at_once_and_the_next_route_is_another() -> None:
    r = router()
    ready(r, "a", "b")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await r.retry_after(fsm.Route("a", 1), fsm.Outcome.UNREACHABLE, t0 + 30)
    assert loop.time() == t0  # no wait: another pod is ready
    assert r.fleet.pods["a"].phase is Phase.DEAD
    assert {r.route for _ in range(3)} == {fsm.Route("b", 1)}
    assert r.metrics.moved.by == {}  # the request never ran: nothing moved
    await r.close()


async def test_a_broken_attempt_counts_a_move_by_how_its_pod_died() -> None:
    r = router()
    ready(r, "a", "b")
    t0 = asyncio.get_running_loop().time()
    r.feed(pods.Broke("a", "silent"))  # its stream's heartbeat stopped
    await r.retry_after(fsm.Route("a", 1), fsm.Outcome.BROKEN, t0 + 30)
    await r.retry_after(fsm.Route("b", 1), fsm.Outcome.BROKEN, t0 + 30)
    assert {k: c.value for k, c in r.metrics.moved.by.items()} == {"silent": 1, "reset": 1}
    assert r.route is None
    await r.close()


async def test_a_dead_pod_gives_up_its_connections_and_its_old_routes_connect_nowhere() -> None:
    r = router()
    ready(r, "a")
    up = r.upstream(fsm.Route("a", 1))
    r.feed(pods.Broke("a", "reset"))
    assert up.closed
    with pytest.raises(upstream.Unreachable):
        await r.upstream(fsm.Route("a", 1)).send(b"GET", b"/", [], b"")
    # Back, answering a probe sent after its death, under a new generation:
    # a new upstream.
    await asyncio.sleep(0.1)
    ready(r, "a")
    assert r.route == fsm.Route("a", 2)
    assert not r.upstream(fsm.Route("a", 2)).closed
    await r.close()


async def test_fewest_in_flight_goes_first() -> None:
    r = router()
    ready(r, "a", "b")
    assert {r.route, r.route} == {fsm.Route("a", 1), fsm.Route("b", 1)}  # idle: in turn
    await r.close()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "a JSON object"),
        (b'{"prompt": "x", "understudy": {}}', "'understudy' is not a request field"),
        (b'{"prompt": "x", "stream": "yes"}', "'stream' must be a boolean"),
        (b"[" * 100_000, "not valid JSON"),
    ],
)
async def test_a_malformed_completion_is_refused_before_any_pod(body: bytes, why: str) -> None:
    reason = admit(b"POST", "/v1/completions", body)
    assert reason is not None and why in reason


async def test_what_a_pod_judges_itself_goes_through() -> None:
    assert admit(b"POST", "/v1/chat/completions", b'{"messages": [], "stream": true}') is None
    assert admit(b"GET", "/v1/models", b"") is None


async def test_the_metrics_are_the_gateways_own() -> None:
    r = router()
    ready(r, "a")
    r.metrics.moved.labels(reason="reset").inc()
    from prometheus_client import generate_latest

    text = generate_latest(r.metrics.registry).decode()
    assert "understudy_front_" not in text
    assert 'understudy_gateway_migrations_total{reason="reset"} 1.0' in text
    # the other reasons at 0 before their first move: an alert's increase() sees it
    for reason in ("refused", "silent", "removed"):
        assert f'understudy_gateway_migrations_total{{reason="{reason}"}} 0.0' in text
    assert "understudy_gateway_pods_routable 1.0" in text
    assert "understudy_gateway_requests_held 0.0" in text
    await r.close()


async def test_a_pod_front_continues_a_gateways_stream_keeps_its_ids_and_beats_it() -> None:
    """The pod's side of the gateway's relay (``wire.serving.RELAY_HEADER``):
    the gateway's ids and relayed tokens are where the engine starts, the
    token comments stay in the stream, and a heartbeat fills its silences."""
    import json

    from doubles.front import Client, Engine, Router, streams

    from understudy.front import downstream
    from understudy.front.continuation import EventDecoder
    from understudy.front.forwarder import Forwarder
    from understudy.front.metrics import FrontMetrics
    from understudy.wire.serving import BEAT_EVENT, RELAY_HEADER, RELAY_TOKENS, token_comment

    engine = Engine("engine-primary/aa", streams(4, 0.6))
    routes = Router({engine.name: engine})
    routes.set(engine.name)
    fwd = Forwarder(routes, fsm.Policy(), FrontMetrics())
    moved = {
        "request_id": "cmpl-gw",
        "created": 7,
        "resume": {"token_ids": [0, 1], "started": True},
    }
    body = json.dumps({"prompt": "hi", "stream": True, "understudy": moved}).encode()
    client = Client()
    headers = [(b"Content-Type", b"application/json"), (RELAY_HEADER, RELAY_TOKENS)]
    fwd.handle(downstream.Exchange(client, b"POST", b"/v1/completions", headers, body, "1.1", True))  # type: ignore[arg-type]
    await client.done.wait()
    assert engine.received[0]["understudy"] == moved  # where the gateway left off
    assert token_comment([2]) + b"\ndata: " in client.body  # the ids, kept
    assert client.body.count(BEAT_EVENT) == 2  # 0.6 s between tokens, a beat each 0.25 s
    got = EventDecoder().feed(client.body)  # as the gateway reads it: beats dropped
    assert [ev.token_ids for ev in got] == [(2,), (3,), ()]
    await asyncio.sleep(0.3)  # the heartbeat sees its stream ended
    await engine.close()
