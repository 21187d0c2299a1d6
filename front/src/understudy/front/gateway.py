"""The fleet gateway: the front's forwarder over pods instead of engines.

A gateway holds the clients' connections in front of a GpuInstance's pods
and routes each request to a pod's own front. When a pod dies with
streams in flight (a node lost, a GPU off the bus), each one moves to
another pod with the continuation contract, token-exact, as the pod's
front moves them between its engines. It is the same
``forwarder.Forwarder`` (hold, attempt, relay, continue); what differs is
its router, :class:`PodRouter`, which offers the forwarder's ``Routes``
over pods (``pods``: the pure core that says which pod and whether a pod is
dead), and reaches them over TCP with ``wire.serving.RELAY_HEADER``, so each
pod's front keeps the token ids in its stream and heartbeats it.

:class:`Gateway` serves the port, refuses what no pod should see
(``admit``), and reports on its status port as a front does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, assert_never

from understudy.front import downstream, fsm, pods, slicewatch, upstream
from understudy.front import status as status_port
from understudy.front.apikeys import ApiKeys
from understudy.front.forwarder import Forwarder
from understudy.front.forwarding import COMPLETIONS
from understudy.front.metrics import Counter, FrontMetrics, Gauge, Labelled
from understudy.wire import handover, respawn
from understudy.wire.obs import log_event
from understudy.wire.serving import BEAT_INTERVAL_S, FIELD, RELAY_HEADER, RELAY_TOKENS

log = logging.getLogger("understudy.gateway")

# After an attempt that found its pod refused, reset or given up on, the pod
# is dead already and the next route is another: a short pause at most, for
# the one case where the pod is still judged routable (a refusal under an
# older generation).
_RETRY_S = 0.05
# Removed pods whose death reason is kept for their breaking requests.
_GONE_KEPT = 256
# A probe's own wait for the pod's answer, at most.
_PROBE_TIMEOUT_S = 1.0
_LIST_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    pods: tuple[pods.Listing, ...] = ()  # --pod, fixed
    pods_file: Path | None = None  # --pods-file, re-read when it changes
    # --endpointslices: (namespace, Service) whose EndpointSlices list the pods
    endpointslices: tuple[str, str] | None = None
    port: int = 8000
    host: str = "0.0.0.0"
    metrics_port: int = 8091  # /live, /ready, /metrics, /pressure, /state
    # A request (or a stream being moved) waits this long for a ready pod.
    hold_s: float = 30.0
    migration_limit: int = 8  # the pod's front's: one poison rule (docs/poison.md)
    # A pod whose probes, or one of whose open streams, are silent this long
    # is dead (its front heartbeats every stream every BEAT_INTERVAL_S).
    silence_s: float = 1.0
    check_s: float = 0.1  # probes and silence checks, this often
    connect_s: float = 1.0  # a connect to a pod that takes longer: refused
    max_body: int = 16 * 1024 * 1024
    idle_s: float = 75.0
    drain_s: float = 25.0
    # A terminating pod's requests finish there for this long, then move:
    # inside its front's own drain (25 s) and the kubelet's grace (30 s).
    grace_s: float = 20.0
    # Bearer keys a request must show one of (apikeys); None: no key asked
    api_keys: ApiKeys | None = None
    watchdog: fsm.Watchdog = field(init=False)

    def __post_init__(self) -> None:
        # A check this late means the gateway itself was not scheduled.
        stall = max(0.25, 2 * self.check_s)
        object.__setattr__(self, "watchdog", fsm.Watchdog(self.silence_s, self.check_s, stall))


def admit(method: bytes, path: str, body: bytes) -> str | None:
    """Why a request must not reach any pod (None: it may). A completion
    whose body is not a JSON object would be refused by every pod, after
    costing one; the continuation field is the gateway's to write, never a
    client's."""
    if method != b"POST" or path not in COMPLETIONS:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return "the request body is not valid JSON"
    if not isinstance(doc, dict):
        return "the request body must be a JSON object"
    if FIELD in doc:
        return f"'{FIELD}' is not a request field"
    if "stream" in doc and not isinstance(doc["stream"], bool):
        return "'stream' must be a boolean"
    return None


# As OpenAI's API answers a missing or wrong key (and vLLM's --api-key).
_UNAUTHORIZED = [downstream.JSON, (b"WWW-Authenticate", b'Bearer realm="understudy"')]
_UNAUTHORIZED_BODY = json.dumps(
    {
        "error": {
            "message": "a valid API key is required: Authorization: Bearer <key>",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


# How a pod is found dead (``pods.Broke``, ``pods.Silent``, a pod that leaves
# the list): the reasons of ``understudy_gateway_migrations_total``.
_DEATHS = ("refused", "reset", "silent", "removed")


class GatewayMetrics(FrontMetrics):
    """The forwarder's metrics under the gateway's names, less the engine
    routing's (lock, epochs, hangs), and the pods'."""

    _OWN = "understudy_gateway_"
    # The forwarder's ``migrations{kind}`` gives way to ``migrations{reason}``.
    _SKIP = frozenset(
        {
            "migrations", "failovers", "stale_epochs", "hung_engines", "lost_requests",
            "lost_idle_connections",
            "restarts", "routing", "route_epoch", "lock_watch_up", "start_seconds",
            "failover_gap_seconds", "detection_seconds",
        }
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.moved = Labelled("reason")  # requests moved off a dead pod, by its death
        self.routable = Gauge()
        self.unauthorized = Counter()  # requests refused 401: no valid API key

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for family in super().collect():
            short = family.name.removeprefix("understudy_front_")
            if short in self._SKIP:
                continue
            family.name = self._OWN + short
            family.samples = [
                s._replace(name=self._OWN + s.name.removeprefix("understudy_front_"))
                for s in family.samples
            ]
            yield family
        moved = CounterMetricFamily(
            self._OWN + "migrations",
            "Requests moved to another pod when theirs died, by how it was found dead: "
            "refused, reset, silent (no heartbeat or probe past the deadline), removed",
            labels=["reason"],
        )
        # Every reason from the start, at 0 until its first move: a rule's
        # increase() cannot see a series' first sample, so a series that
        # appeared with the first move would hide it (docs/monitoring.md).
        for reason in sorted({*_DEATHS, *self.moved.by}):
            c = self.moved.by.get(reason)
            moved.add_metric([reason], c.value if c is not None else 0.0)
        yield moved
        yield GaugeMetricFamily(
            self._OWN + "pods_routable", "Pods ready to take requests", value=self.routable.get()
        )
        yield CounterMetricFamily(
            self._OWN + "unauthorized",
            "Requests refused 401 for want of a valid API key (--api-key-file)",
            value=self.unauthorized.value,
        )


async def probe(host: str, port: int, within: float) -> bool | None:
    """A pod front's ``/ready``: True (200), False (another answer), None (none)."""
    writer = None
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /ready HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
            line = await reader.readline()
        return line.split(b" ", 2)[1:2] == [b"200"]
    except (OSError, TimeoutError):
        return None
    finally:
        if writer is not None:
            writer.close()


class PodRouter:
    """The gateway's routes: the pods, their probes and silences, and the waits."""

    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.fleet = pods.Fleet({})
        self.held = 0
        self._ups: dict[str, tuple[int, upstream.Upstream]] = {}
        self._changed = asyncio.Event()
        self._turn = 0
        self._probing: dict[str, asyncio.Task[None]] = {}
        # Pods no longer listed, and how they died: their requests break after
        # they are gone from the fleet, and are counted by it. Bounded: only the
        # requests in flight at a removal ask, and only soon after.
        self._gone: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop = asyncio.get_running_loop()
        self._slices: slicewatch.SliceWatch | None = None
        metrics.routable.set_function(lambda: pods.routable(self.fleet))
        if cfg.pods:
            self.list_pods(cfg.pods)

    # ----------------------------------------------------------- the core --

    def list_pods(self, listings: tuple[pods.Listing, ...] | list[pods.Listing]) -> None:
        now = self._loop.time()
        self.fleet, actions = pods.listed(self.fleet, listings, now, self.cfg.grace_s)
        for name in self.fleet.pods:  # listed again: its own phase says how it died
            self._gone.pop(name, None)
        log_event(log, "pods_listed", pods=sorted(li.name for li in listings))
        self._execute(actions)

    def feed(self, event: pods.Event) -> None:
        self.fleet, actions = pods.feed(self.fleet, event, self._loop.time())
        self._execute(actions)

    def _execute(self, actions: list[pods.Action]) -> None:
        for action in actions:
            match action:
                case pods.Routed(name=name, generation=generation):
                    log_event(log, "pod_routed", pod=name, generation=generation)
                case pods.Unrouted(name=name):
                    log_event(log, "pod_unready", logging.WARNING, pod=name)
                case pods.Leaving(name=name, until=until):
                    log_event(
                        log, "pod_leaving", pod=name, busy=self._busy(name),
                        grace_s=round(until - self._loop.time(), 3),
                    )  # fmt: skip
                case pods.Dead(name=name, reason=reason):
                    entry = self._ups.pop(name, None)
                    busy = entry[1].busy if entry else 0
                    if name not in self.fleet.pods:
                        self._gone[name] = reason
                        while len(self._gone) > _GONE_KEPT:
                            del self._gone[next(iter(self._gone))]
                    if entry is not None:
                        entry[1].abort()  # its requests break, and move
                    log_event(log, "pod_dead", logging.WARNING, pod=name, reason=reason, busy=busy)
                case _:
                    assert_never(action)
            self._changed.set()
            self._changed = asyncio.Event()

    # ------------------------------------------------------------ Routes --

    def _busy(self, name: str) -> int:
        entry = self._ups.get(name)
        return entry[1].busy if entry is not None else 0

    @property
    def route(self) -> fsm.Route | None:
        p = pods.pick(self.fleet, self._busy, self._turn)
        self._turn += 1
        return fsm.Route(p.name, p.generation) if p is not None else None

    def _current(self, route: fsm.Route) -> pods.Pod | None:
        """``route``'s pod, if it is still that generation and ready."""
        p = self.fleet.pods.get(route.engine_id)
        ok = p is not None and p.generation == route.epoch and p.phase is pods.Phase.READY
        return p if ok else None

    def upstream(self, route: fsm.Route) -> upstream.Upstream:
        entry = self._ups.get(route.engine_id)
        if entry is not None and entry[0] == route.epoch:
            return entry[1]
        p = self.fleet.pods.get(route.engine_id)
        li = p.listing if p is not None else None
        up = upstream.Upstream(
            route.engine_id,
            tcp=(li.host, li.port) if li is not None else ("", 0),
            headers=[(RELAY_HEADER, RELAY_TOKENS)],
            connect_s=self.cfg.connect_s,
        )
        if p is None or p.generation != route.epoch or p.phase is pods.Phase.DEAD:
            up.abort()  # a route of the past: it connects nowhere
            return up
        if entry is not None:
            entry[1].abort()
        self._ups[route.engine_id] = (route.epoch, up)
        return up

    async def hold(self, deadline: float) -> fsm.Route | None:
        route = self.route
        if route is not None:
            return route
        since = self._loop.time()
        self.held += 1
        self.metrics.held_total.inc()
        try:
            while route is None and (remaining := deadline - self._loop.time()) > 0:
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await changed.wait()
                route = self.route
        finally:  # a client that hangs up while held is no longer held
            self.held -= 1
        if route is not None:
            self.metrics.hold.observe(self._loop.time() - since)
        return route

    async def retry_after(self, route: fsm.Route, outcome: fsm.Outcome, deadline: float) -> None:
        broke = {fsm.Outcome.UNREACHABLE: "refused", fsm.Outcome.BROKEN: "reset"}.get(outcome)
        if broke is not None and self._current(route) is not None:
            self.feed(pods.Broke(route.engine_id, broke))
        if outcome is fsm.Outcome.BROKEN:  # the forwarder moves the request
            p = self.fleet.pods.get(route.engine_id)
            reason = (p.reason if p is not None else self._gone.get(route.engine_id)) or "reset"
            self.metrics.moved.labels(reason=reason).inc()
        if self._current(route) is None:
            return  # another pod is the route, or none: the hold waits for one
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, min(_RETRY_S, deadline - self._loop.time()))):
                await changed.wait()

    def served(self, route: fsm.Route) -> None:
        pass  # a pod's answer changes nothing: its probes say whether it is ready

    # ------------------------------------------------------------- loops --

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._check(), name="pod-checks")]
        if self.cfg.pods_file is not None:
            self._tasks.append(asyncio.create_task(self._watch_list(), name="pods-file"))
        if self.cfg.endpointslices is not None:
            namespace, service = self.cfg.endpointslices
            self._slices = slicewatch.SliceWatch(namespace, service, self.list_pods, self._loop)
            self._slices.start()

    async def _check(self) -> None:
        """Every ``check_s``: probe each pod (one probe in flight per pod),
        and judge the silence of its probes and of its open streams."""
        w = self.cfg.watchdog
        last = self._loop.time()
        while True:
            await asyncio.sleep(w.check_s)
            now = self._loop.time()
            due, last = last + w.check_s, now
            for p in self.fleet.pods.values():
                task = self._probing.get(p.name)
                if task is None or task.done():
                    self._probing[p.name] = asyncio.create_task(self._probe(p.listing))
            events: list[pods.Event] = [*pods.silent(self.fleet, w, due, now)]
            for event in [*events, *pods.overdue(self.fleet, now)]:
                self.feed(event)
            for name, (_, up) in list(self._ups.items()):
                if pods.stream_silent(w, due, now, up.quiet_since()):
                    self.feed(pods.Broke(name, "silent"))

    async def _probe(self, li: pods.Listing) -> None:
        sent = self._loop.time()
        ready = await probe(li.host, li.status_port, min(_PROBE_TIMEOUT_S, self.cfg.silence_s))
        p = self.fleet.pods.get(li.name)
        if ready is not None and p is not None and p.listing.address == li.address:
            self.feed(pods.Probed(li.name, ready, sent))

    async def _watch_list(self) -> None:
        """The pods file, re-read whenever it changes (the local stand-in for
        the EndpointSlices a gateway watches in a cluster); a file that
        cannot be read leaves the pods as they were."""
        assert self.cfg.pods_file is not None
        seen: tuple[int, int] | None = None
        while True:
            with contextlib.suppress(OSError):
                st = os.stat(self.cfg.pods_file)
                if (st.st_mtime_ns, st.st_size) != seen:
                    seen = (st.st_mtime_ns, st.st_size)
                    try:
                        self.list_pods(pods.parse_pods_file(self.cfg.pods_file.read_text()))
                    except pods.PodListError as exc:
                        log_event(log, "pods_file_unreadable", logging.ERROR, error=str(exc))
            await asyncio.sleep(_LIST_POLL_S)

    # ------------------------------------------------------------ surface --

    def view(self) -> list[dict[str, Any]]:
        return [
            {
                "name": p.name,
                "phase": p.phase.value,
                "generation": p.generation,
                "reason": p.reason,
                "busy": self._busy(p.name),
                "streams": self._ups[p.name][1].streams if p.name in self._ups else 0,
            }
            for p in self.fleet.pods.values()
        ]

    async def close(self) -> None:
        if self._slices is not None:
            self._slices.stop()
        tasks = [*self._tasks, *self._probing.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, up in self._ups.values():
            up.close()


class Gateway:
    """The gateway's port, its router over pods, and its status port."""

    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or GatewayMetrics()
        self.router = PodRouter(cfg, self.metrics)
        policy = fsm.Policy(cfg.hold_s, cfg.migration_limit)
        self.forwarder = Forwarder(self.router, policy, self.metrics)
        limits = downstream.Limits(max_body=cfg.max_body, idle_s=cfg.idle_s)
        self._server = downstream.Server(self._handle, limits, self.forwarder.refused)
        self._status: downstream.Server | None = None
        self.port = cfg.port
        self.metrics.inflight.set_function(lambda: self.forwarder.inflight)
        self.metrics.held.set_function(lambda: self.router.held)

    def _handle(self, ex: downstream.Exchange) -> None:
        keys = self.cfg.api_keys
        if keys is not None:
            if not keys.allows(ex.headers):
                self.metrics.unauthorized.inc()
                self.forwarder.refused(401)
                with contextlib.suppress(downstream.ClientGone):
                    ex.answer(401, _UNAUTHORIZED, _UNAUTHORIZED_BODY)
                return
            # The key is the gateway's business: no pod sees it (or logs it).
            ex.headers = [h for h in ex.headers if h[0].lower() != b"authorization"]
        path = ex.target.split(b"?", 1)[0].decode("latin-1")
        reason = admit(ex.method, path, ex.body)
        if reason is None:
            self.forwarder.handle(ex)
            return
        self.forwarder.refused(400)
        with contextlib.suppress(downstream.ClientGone):
            ex.error(400, reason)

    def ready(self) -> tuple[bool, str]:
        n = pods.routable(self.router.fleet)
        return (True, f"{n} pods routable") if n else (False, "no pod routable")

    def pressure(self) -> dict[str, Any]:
        return {
            "inflight": self.forwarder.inflight,
            "held": self.router.held,
            "routable": pods.routable(self.router.fleet),
        }

    def view(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "pods": self.router.view(), **self.pressure()}

    async def start(self) -> None:
        # Under ``understudy respawn --listen`` (the rendered Deployment) both
        # ports are the respawner's, bound once: a gateway that dies is
        # started again in place while new connections wait in the kernel's
        # queue, instead of being refused until its Service drops the replica.
        serving = respawn.inherited_socket("serving")
        if serving is None:
            self.port = await self._server.listen(self.cfg.host, self.cfg.port)
        else:
            self._server.serve_on(serving, handover.BACKLOG)
            self.port = serving.getsockname()[1]
        self._status = await status_port.serve(
            self, self.cfg.host, self.cfg.metrics_port, respawn.inherited_socket("status")
        )
        self.router.start()
        respawn.notify_ready()
        log_event(
            log, "gateway_listening", port=self.port, metrics_port=self.cfg.metrics_port,
            hold_s=self.cfg.hold_s, silence_s=self.cfg.silence_s, beat_s=BEAT_INTERVAL_S,
        )  # fmt: skip

    async def drain(self) -> None:
        self._server.stop_accepting()
        await self.forwarder.settle(self.cfg.drain_s)
        await self.close()

    async def close(self) -> None:
        await self.router.close()
        self._server.close()
        if self._status is not None:
            self._status.close()


async def run(cfg: GatewayConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain."""
    gw = Gateway(cfg)
    await gw.start()
    await downstream.until_stopped()
    log_event(log, "draining", inflight=gw.forwarder.inflight, held=gw.router.held)
    await gw.drain()
