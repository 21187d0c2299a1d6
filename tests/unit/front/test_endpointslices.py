"""The gateway's pods from EndpointSlices: the pure conversion
(``pods.listings_from_slices``), and the list-and-watch thread
(``slicewatch.SliceWatch``) against a small HTTP server that speaks the API's
list and watch JSON, delivering to a real ``PodRouter``.

The server is the API server's wire format, nothing of ours: the
``kubernetes`` client in the thread talks HTTP to it as to kube-apiserver.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from understudy.front import pods, slicewatch
from understudy.front.gateway import GatewayConfig, GatewayMetrics, PodRouter
from understudy.front.pods import Listing, Phase, Probed, Skipped, listings_from_slices

PORTS = [
    {"name": "http", "port": 8000, "protocol": "TCP"},
    {"name": "front-status", "port": 8090, "protocol": "TCP"},
]


def endpoint(pod: str | None, *addresses: str, terminating: bool = False) -> dict[str, Any]:
    ep: dict[str, Any] = {
        "addresses": list(addresses),
        "conditions": {"ready": True, "serving": not terminating, "terminating": terminating},
    }
    if pod is not None:
        ep["targetRef"] = {"kind": "Pod", "namespace": "ns", "name": pod, "uid": f"u-{pod}"}
    return ep


def eps(name: str, *endpoints: dict[str, Any], ports: Any = PORTS, rv: str = "1") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": rv,
            "labels": {"kubernetes.io/service-name": "demo-pods"},
        },
        "addressType": "IPv4",
        "endpoints": list(endpoints),
        "ports": ports,
    }


# ------------------------------------------------------ the pure conversion


def test_one_listing_per_endpoint_at_the_named_ports() -> None:
    slices = [
        eps("s-b", endpoint("demo-1", "10.0.0.8", terminating=True)),
        eps("s-a", endpoint("demo-0", "10.0.0.7")),
    ]
    listings, skipped = listings_from_slices(slices)
    assert listings == [
        Listing("demo-0", "10.0.0.7", 8000, 8090),
        Listing("demo-1", "10.0.0.8", 8000, 8090, terminating=True),
    ]
    assert skipped == []


def test_ports_are_found_by_name_not_by_order() -> None:
    ports = [
        {"name": "front-status", "port": 9090},
        {"name": "metrics", "port": 1},
        {"name": "http", "port": 7000},
    ]
    listings, _ = listings_from_slices([eps("s", endpoint("p", "10.0.0.1"), ports=ports)])
    assert listings == [Listing("p", "10.0.0.1", 7000, 9090)]


def test_what_cannot_be_routed_to_is_skipped_with_the_reason() -> None:
    slices = [
        eps("a", endpoint("no-address")),
        eps("b", endpoint("p1", "10.0.0.1"), ports=[{"name": "http", "port": 8000}]),
        eps("c", endpoint("p2", "10.0.0.2"), ports=None),
        eps("d", endpoint("p3", "10.0.0.3"), endpoint("p3", "10.0.0.9")),
    ]
    listings, skipped = listings_from_slices(slices)
    assert listings == [Listing("p3", "10.0.0.3", 8000, 8090)]
    assert skipped == [
        Skipped("no-address", "no address"),
        Skipped("p1", "its slice has no port named 'front-status'"),
        Skipped("p2", "its slice has no port named 'http'"),
        Skipped("p3", "listed twice"),
    ]


def test_an_endpoint_without_a_pod_is_named_by_its_address() -> None:
    listings, _ = listings_from_slices([eps("s", endpoint(None, "10.0.0.5", "10.0.0.6"))])
    assert [li.name for li in listings] == ["10.0.0.5:8000", "10.0.0.6:8000"]
    assert [li.host for li in listings] == ["10.0.0.5", "10.0.0.6"]


def test_no_slices_no_pods() -> None:
    assert listings_from_slices([]) == ([], [])
    assert listings_from_slices([eps("s")]) == ([], [])


_names = st.sampled_from([f"demo-{i}" for i in range(6)])
_hosts = st.sampled_from([f"10.0.0.{i}" for i in range(1, 8)])
_endpoints = st.builds(
    lambda pod, hosts, term: endpoint(pod, *hosts, terminating=term),
    st.one_of(st.none(), _names),
    st.lists(_hosts, max_size=2),
    st.booleans(),
)
_ports = st.sampled_from([PORTS, PORTS[:1], PORTS[1:], None, list(reversed(PORTS))])
_slices = st.lists(
    st.builds(
        lambda i, e, p: eps(f"s{i}", *e, ports=p), st.integers(0, 3), st.lists(_endpoints), _ports
    ),
    max_size=4,
    unique_by=lambda sl: str(sl["metadata"]["name"]),  # names are unique in a namespace
)


@given(_slices)
def test_every_endpoint_address_is_listed_or_skipped_and_names_are_unique(
    slices: list[dict[str, Any]],
) -> None:
    listings, skipped = listings_from_slices(slices)
    names = [li.name for li in listings]
    assert len(set(names)) == len(names)  # the router keys its pods by name
    for li in listings:
        assert (li.port, li.status_port) == (8000, 8090)
    # Each endpoint gives its addresses as listings, or one reason, or (only
    # for an address whose name was taken) a "listed twice" per address.
    total = sum(max(1, len(ep["addresses"])) for sl in slices for ep in sl["endpoints"])
    assert len(listings) + len(skipped) <= total
    assert len(listings) <= sum(len(ep["addresses"]) for sl in slices for ep in sl["endpoints"])
    # Terminating is the endpoint's own condition.
    terminating = {
        (ep["targetRef"]["name"], ep["addresses"][0])
        for sl in slices
        for ep in sl["endpoints"]
        if ep["conditions"]["terminating"] and ep.get("targetRef") and ep["addresses"]
    }
    for li in listings:
        if li.terminating:
            assert (li.name, li.host) in terminating or "#" in li.name or ":" in li.name
    # The order of the slices changes nothing.
    assert listings_from_slices(list(reversed(slices))) == (listings, skipped)


def test_the_target_is_namespace_slash_service() -> None:
    assert slicewatch.parse_target("ns/demo-pods") == ("ns", "demo-pods")
    for bad in ("demo-pods", "ns/", "/demo", "NS/demo", "ns/demo/x", "ns/-demo"):
        with pytest.raises(ValueError, match="NAMESPACE/SERVICE"):
            slicewatch.parse_target(bad)


# ------------------------------------------------- the list-and-watch shell


@dataclass
class FakeApiServer:
    """kube-apiserver's EndpointSlice list and watch, over HTTP.

    A list answers ``items`` at ``version``; a watch streams what the test
    puts in ``events`` (a dict is one event line, None ends the stream).
    With ``failing`` every request is answered 503, as by an API server
    that is down behind its load balancer.
    """

    items: list[dict[str, Any]] = field(default_factory=list)
    version: str = "10"
    failing: bool = False
    events: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    requests: list[dict[str, str]] = field(default_factory=list)
    port: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        assert request.match_info["ns"] == "ns"
        assert query.get("labelSelector") == "kubernetes.io/service-name=demo-pods"
        if self.failing:
            return web.json_response(
                {"kind": "Status", "status": "Failure", "code": 503, "message": "unavailable"},
                status=503,
            )
        if query.get("watch") != "true":
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": self.version},
                    "items": self.items,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while (event := await self.events.get()) is not None:
            await resp.write(json.dumps(event).encode() + b"\n")
        return resp

    def watches(self) -> list[dict[str, str]]:
        return [q for q in self.requests if q.get("watch") == "true"]


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", server.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield server
    server.events.put_nowait(None)
    await runner.cleanup()


async def until(cond: Callable[[], bool], within: float = 10.0) -> None:
    """Poll what the thread changes (it sets no event on this loop)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if cond():
            return
        assert loop.time() < deadline, "not within the time"
        await asyncio.sleep(0.02)


def client_for(api: FakeApiServer) -> Any:
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{api.port}"
    return client.ApiClient(cfg)


@pytest.fixture
async def watched(api: FakeApiServer) -> AsyncIterator[tuple[PodRouter, slicewatch.SliceWatch]]:
    router = PodRouter(GatewayConfig(), GatewayMetrics())
    watch = slicewatch.SliceWatch(
        "ns",
        "demo-pods",
        router.list_pods,
        asyncio.get_running_loop(),
        api_client=client_for(api),
        backoff_s=(0.05, 0.2),
    )
    yield router, watch
    watch.stop()
    api.failing = True  # a resumed watch ends at once
    api.events.put_nowait(None)
    await asyncio.to_thread(watch.stop, 5.0)
    assert not watch.alive
    await router.close()


def names(router: PodRouter) -> list[str]:
    return sorted(router.fleet.pods)


def event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


async def test_the_list_then_each_watch_event_reach_the_router(
    api: FakeApiServer, watched: tuple[PodRouter, slicewatch.SliceWatch]
) -> None:
    router, watch = watched
    api.items = [eps("s1", endpoint("demo-0", "10.0.0.7"))]
    watch.start()
    await until(lambda: names(router) == ["demo-0"])
    await until(lambda: len(api.watches()) == 1)
    assert api.watches()[0]["resourceVersion"] == "10"
    assert api.watches()[0]["allowWatchBookmarks"] == "true"

    two = eps("s1", endpoint("demo-0", "10.0.0.7"), endpoint("demo-1", "10.0.0.8"), rv="11")
    api.events.put_nowait(event("MODIFIED", two))
    await until(lambda: names(router) == ["demo-0", "demo-1"])

    leaving = eps(
        "s1",
        endpoint("demo-0", "10.0.0.7"),
        endpoint("demo-1", "10.0.0.8", terminating=True),
        rv="12",
    )
    now = asyncio.get_running_loop().time()
    router.feed(Probed("demo-1", True, now))
    api.events.put_nowait(event("MODIFIED", leaving))
    await until(lambda: router.fleet.pods["demo-1"].phase is Phase.LEAVING)

    api.events.put_nowait(
        event("DELETED", {**leaving, "metadata": {**leaving["metadata"], "resourceVersion": "13"}})
    )
    await until(lambda: names(router) == [])


async def test_a_watch_that_ends_resumes_from_the_last_version_it_saw(
    api: FakeApiServer, watched: tuple[PodRouter, slicewatch.SliceWatch]
) -> None:
    router, watch = watched
    watch.start()
    await until(lambda: len(api.watches()) == 1)
    api.events.put_nowait(event("ADDED", eps("s1", endpoint("demo-0", "10.0.0.7"), rv="15")))
    bookmark = {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"resourceVersion": "17"},
    }
    api.events.put_nowait(event("BOOKMARK", bookmark))
    api.events.put_nowait(None)  # the API server's timeout
    await until(lambda: len(api.watches()) == 2)
    assert api.watches()[1]["resourceVersion"] == "17"
    assert watch.counts["lists"] == 1  # resumed, not listed again
    assert names(router) == ["demo-0"]


async def test_410_gone_lists_again(
    api: FakeApiServer, watched: tuple[PodRouter, slicewatch.SliceWatch]
) -> None:
    router, watch = watched
    api.items = [eps("s1", endpoint("demo-0", "10.0.0.7"))]
    watch.start()
    await until(lambda: len(api.watches()) == 1)
    api.items = [eps("s1", endpoint("demo-5", "10.0.0.9"))]
    api.version = "40"
    gone = {
        "kind": "Status",
        "status": "Failure",
        "reason": "Expired",
        "message": "too old",
        "code": 410,
    }
    api.events.put_nowait(event("ERROR", gone))
    await until(lambda: names(router) == ["demo-5"])
    await until(lambda: len(api.watches()) == 2)
    assert api.watches()[1]["resourceVersion"] == "40"
    assert (watch.counts["gone"], watch.counts["lists"], watch.counts["errors"]) == (1, 2, 0)


async def test_while_the_api_server_is_away_the_gateway_routes_on_its_last_pods(
    api: FakeApiServer, watched: tuple[PodRouter, slicewatch.SliceWatch]
) -> None:
    router, watch = watched
    api.items = [eps("s1", endpoint("demo-0", "10.0.0.7"), endpoint("demo-1", "10.0.0.8"))]
    watch.start()
    await until(lambda: names(router) == ["demo-0", "demo-1"])
    now = asyncio.get_running_loop().time()
    router.feed(Probed("demo-0", True, now))
    router.feed(Probed("demo-1", True, now))
    # The watch breaks, and every list and watch after it fails.
    api.failing = True
    api.events.put_nowait(None)
    await until(lambda: watch.counts["errors"] >= 3)
    assert names(router) == ["demo-0", "demo-1"]
    assert {p.phase for p in router.fleet.pods.values()} == {Phase.READY}
    assert router.route is not None
    # Back: the list is the truth again (demo-0 has gone meanwhile).
    api.items = [eps("s1", endpoint("demo-1", "10.0.0.8"))]
    api.failing = False
    await until(lambda: names(router) == ["demo-1"])
    assert router.fleet.pods["demo-1"].phase is Phase.READY  # the same pod, unchanged


async def test_an_unreachable_api_server_is_backed_off_and_hands_over_nothing(
    api: FakeApiServer,
) -> None:
    delivered: list[list[pods.Listing]] = []
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = "http://127.0.0.1:9"  # discard: refused
    watch = slicewatch.SliceWatch(
        "ns", "demo-pods", delivered.append, asyncio.get_running_loop(),
        api_client=client.ApiClient(cfg), backoff_s=(0.05, 0.1),
    )  # fmt: skip
    watch.start()
    await until(lambda: watch.counts["errors"] >= 3)
    await asyncio.to_thread(watch.stop, 5.0)
    assert not watch.alive
    assert delivered == [] and watch.counts["lists"] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--endpointslices", "ns/demo-pods", "--pod", "http://10.0.0.1:8000"],
        ["--endpointslices", "ns/demo-pods", "--pods-file", "pods.json"],
        ["--endpointslices", "demo-pods"],
        [],
    ],
    ids=["with --pod", "with --pods-file", "no namespace", "no source"],
)
def test_the_gateway_takes_exactly_one_source_of_pods(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from understudy.cli import build_parser

    args = build_parser("gateway").parse_args(["gateway", *argv])
    assert args.func(args) == 2  # before anything runs
    err = capsys.readouterr().err
    assert "--endpointslices" in err
