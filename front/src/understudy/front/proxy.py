"""The front door's asyncio shell: the pod's serving port, for the pod's whole life.

Three loops feed the routing core (``fsm``) and one handler per request asks
it what to do:

- the **lock watch**: the holder and its epoch, the instant they change (a
  killed engine's lock connection closes with its process);
- the **heartbeat check**: the routed engine's heartbeat, every
  ``beat_check_s``; one older than ``hang_after_s`` makes the engine hung,
  and the front kills it so that its death hands the lock on;
- **requests**: read by the front's own HTTP/1.1 server (``downstream``) and
  forwarded over the Active engine's Unix socket (``upstream``). One that
  finds no Active engine waits for one (the hold); one whose engine dies
  under it is sent again to the next (migration): replayed whole, or, for a
  stream that already sent tokens, continued after them.

What a request becomes on its way to an engine, and back, is ``forwarding``;
the probes and metrics are on their own port (``status``), off the
request's path.

The serving socket is not the front's own: the lock server keeps it and hands
it to each front that starts (``understudy.wire.handover``), so a front's
death refuses no connection; they wait in the kernel's queue until the next
front accepts them. A restarted front accepts first and imports the rest
after (the lock watch's protocol, the metrics' exposition): its start is
the clients' wait. What its death loses, the requests inside it, the next
front counts (``ledger``).

Engines answer ``409`` with ``X-Understudy-Not-Active`` when a request reaches
them while not Active or under another epoch; the front then waits for the
route the lock names.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import socket
import time
from typing import Any, assert_never

from understudy.front import continuation, downstream, fsm, upstream
from understudy.front import forwarding as fw
from understudy.front import status as status_port
from understudy.front.config import FrontConfig
from understudy.front.ledger import LEDGER, Ledger, Predecessor
from understudy.front.metrics import FrontMetrics
from understudy.wire import handover, heap
from understudy.wire.heartbeat import read_beat
from understudy.wire.obs import log_event
from understudy.wire.serving import heartbeat_path, serving_socket

log = logging.getLogger("understudy.front")

# After a failed connect to the route (the engine is still waking), wait for
# its socket to appear (one watcher per engine, polling every _WATCH_S, wakes
# every waiting request at once) or at most this long before trying again.
# Sixteen requests retrying their connects every few milliseconds took CPU
# from the very engine they were waiting for.
_RETRY_S = 0.05
_WATCH_S = 0.001
# After an engine died under a request: wait at most this long for the lock to
# name the next one before trying again.
_MIGRATE_RETRY_S = 0.005
# After the engine refused (draining, or another epoch): the lock will name
# another engine soon; until then, ask again only this often.
_REFUSED_RETRY_S = 0.25
# A heartbeat check that comes this much later than asked means the front was
# not scheduled either: no verdict on the engine from it.
_STALL_S = 0.25
# Asking for the serving socket: while the keeper holds the port but does not
# answer yet (it is restarting too), ask again this often, this long.
_OBTAIN_RETRY_S = 0.05
_OBTAIN_FOR_S = 30.0


class Front:
    def __init__(self, cfg: FrontConfig, metrics: FrontMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or FrontMetrics()
        self.policy = fsm.Policy(cfg.hold_s, cfg.migration_limit)
        self.state = fsm.FrontState()
        self._changed = asyncio.Event()
        self._upstreams: dict[str, upstream.Upstream] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._routed_at: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._status: downstream.Server | None = None
        self._listener: socket.socket | None = None
        self._ledger: Ledger | None = None
        self._server = downstream.Server(
            self.handle,
            downstream.Limits(max_body=cfg.max_body, idle_s=cfg.idle_s),
            self._refused,
            self._on_busy,
        )
        codes = ("2xx", "3xx", "4xx", "5xx")
        self._codes = {c: self.metrics.requests.labels(code=c) for c in codes}
        self._inflight = 0
        self._held = 0
        # Read when scraped, not set on every request.
        self.metrics.inflight.set_function(lambda: self._inflight)
        self.metrics.held.set_function(lambda: self._held)
        self._drained: asyncio.Event | None = None  # set when draining ends
        self._loop = asyncio.get_running_loop()

    # ----------------------------------------------------------- the core --

    def _now(self) -> float:
        return self._loop.time()

    def feed(self, event: fsm.Event) -> None:
        self.state, actions = fsm.step(self.state, event, self._now())
        for action in actions:
            self._execute(action)

    def _execute(self, action: fsm.Action) -> None:
        m = self.metrics
        match action:
            case fsm.RouteTo(route=route, handover=handover):
                if handover and self.state.lost_at is not None:
                    m.detection.observe(max(0.0, self._now() - self.state.lost_at))
                    m.failovers.inc()
                m.routing.set(1)
                m.epoch.set(route.epoch)
                log_event(
                    log, "route", engine=route.engine_id, epoch=route.epoch, failover=handover
                )
                self._wake()
            case fsm.Unroute(reason=reason):
                m.routing.set(0)
                log_event(log, "unrouted", logging.WARNING, reason=reason)
                self._wake()
            case fsm.Kill(engine_id=engine_id, reason=reason):
                self._kill(engine_id, reason)
            case fsm.IgnoredStale(holder=holder, epoch=epoch, newest=newest):
                m.stale.inc()
                log_event(
                    log, "stale_epoch_ignored", logging.WARNING,
                    holder=holder, epoch=epoch, newest=newest,
                )  # fmt: skip
            case fsm.GapEnded(seconds=seconds):
                m.gap.observe(seconds)
                log_event(log, "gap_ended", gap_ms=round(seconds * 1000, 2))
            case _:
                assert_never(action)

    def _wake(self) -> None:
        """Wake every request waiting for a route change."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _kill(self, engine_id: str, reason: str) -> None:
        beat = read_beat(heartbeat_path(self.cfg.run_dir, engine_id))
        self.metrics.hung.inc()
        if beat is None:
            log_event(log, "hung_engine_unknown_pid", logging.ERROR, engine=engine_id)
            return
        log_event(
            log, "killing_hung_engine", logging.WARNING,
            engine=engine_id, pid=beat.pid, reason=reason,
        )  # fmt: skip
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(beat.pid, signal.SIGKILL)

    # ------------------------------------------------------------- loops --

    def _on_busy(self, n: int) -> None:
        if self._ledger is not None:
            self._ledger.busy(n)

    async def _watch_lock(self) -> None:
        # The lock's protocol (pydantic) is imported only now, off the loop:
        # the front already accepts, and routes by the keeper's offer.
        await asyncio.to_thread(importlib.import_module, "understudy.lockserver")
        from understudy.lockserver import Address, LockError, watch

        heap.freeze()  # start-up is over: what it imported stays
        address = Address.parse(self.cfg.lock_socket)
        while True:
            try:
                async for h in watch(address):
                    self.metrics.lock_watch_up.set(1)
                    self.feed(fsm.HolderSeen(h.holder, h.epoch))
            except LockError as exc:
                # The lock server restarts: keep routing where we route (the
                # engine still lives), and listen again.
                self.metrics.lock_watch_up.set(0)
                log_event(log, "lock_watch_lost", logging.WARNING, reason=str(exc))
                await asyncio.sleep(0.05)

    async def _check_beats(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.beat_check_s)
            now = time.monotonic()
            late, last = now - last - self.cfg.beat_check_s, now
            if late > _STALL_S:
                # The front itself did not run for a while: the whole machine
                # stalled (CPU starvation, a VM pause), so a silent engine now
                # proves nothing. Judge again on the next, punctual check.
                log_event(log, "beat_check_skipped", logging.WARNING, late_ms=round(late * 1000))
                continue
            route = self.state.route
            if route is None:
                continue
            beat = read_beat(heartbeat_path(self.cfg.run_dir, route.engine_id))
            if beat is None:
                continue
            silent = now - beat.monotonic
            if silent > self.cfg.hang_after_s:
                self.feed(fsm.Hung(route.engine_id, silent))

    # ------------------------------------------------------------ engines --

    def _upstream(self, engine_id: str) -> upstream.Upstream:
        up = self._upstreams.get(engine_id)
        if up is None:
            up = upstream.Upstream(str(serving_socket(self.cfg.run_dir, engine_id)))
            # Connections to engines that are gone are only dead weight.
            for old in [k for k in self._upstreams if k != engine_id]:
                self._upstreams.pop(old).close()
            self._upstreams[engine_id] = up
        return up

    async def _route(self, deadline: float) -> fsm.Route | None:
        """The route to use now, waiting for one until ``deadline``."""
        while self.state.route is None:
            remaining = deadline - self._now()
            if remaining <= 0:
                return None
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()
        return self.state.route

    async def _hold(self, deadline: float) -> fsm.Route | None:
        """The route now, or after holding the request until one exists (or the
        deadline); counted as held while it waits, whatever ends the wait."""
        if self.state.route is not None:
            return self.state.route
        since = self._now()
        self._held += 1
        self.metrics.held_total.inc()
        try:
            route = await self._route(deadline)
        finally:  # a client that hangs up while held is no longer held
            self._held -= 1
        if route is not None:
            self.metrics.hold.observe(self._now() - since)
        return route

    async def _await_change(self, route: fsm.Route, deadline: float, patience: float) -> None:
        """After an attempt the engine refused or could not take: wait up to
        ``patience`` for the lock to name another route, then try again anyway."""
        if self.state.route != route:
            return
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, min(patience, deadline - self._now()))):
                await changed.wait()

    def _watch_socket(self, route: fsm.Route, deadline: float) -> None:
        """Wake the waiting requests the moment the waking engine's socket
        appears (one watcher per engine, however many requests wait)."""
        task = self._watchers.get(route.engine_id)
        if task is None or task.done():
            self._watchers = {k: t for k, t in self._watchers.items() if not t.done()}
            self._watchers[route.engine_id] = asyncio.create_task(
                self._socket_appears(route, deadline), name=f"listen-{route.engine_id}"
            )

    async def _socket_appears(self, route: fsm.Route, deadline: float) -> None:
        path = serving_socket(self.cfg.run_dir, route.engine_id)
        if path.exists():
            return  # there already and still refusing: the waiters' own retry covers it
        while self.state.route == route and self._now() < deadline:
            await asyncio.sleep(_WATCH_S)
            if path.exists():
                self._wake()
                return

    # ----------------------------------------------------------- requests --

    def _refused(self, status: int) -> None:
        """A request the server refused before it was whole (too large, malformed)."""
        self._codes[f"{status // 100}xx"].inc()

    def handle(self, ex: downstream.Exchange) -> None:
        """A client's request, whole.

        The fast path, taken by most requests: an engine is routed to, the
        request is not a stream, and a kept-alive connection to the engine is
        idle. The request goes out at once and the answer is relayed from the
        connection's callback (``_answered``), with no task, future or
        coroutine on the way: on two cores the front's own CPU is most of the
        latency it adds. Everything else (no route, no idle connection, a
        stream, or a first attempt that was not simply answered) is served
        by ``_serve`` in a task, which makes every decision of the hold and
        of migration; the fast path decides nothing it would not.
        """
        req = fw.parse(ex, self._now())
        self._inflight += 1
        try:
            route = self.state.route
            if route is not None and not req.streaming:
                up = self._upstreams.get(route.engine_id)
                if up is not None:
                    sent = up.send_idle(
                        req.method, req.target, fw.headers_for(req, route), fw.payload(req)
                    )
                    if sent is not None:
                        sent.on_complete(lambda: self._answered(req, ex, route, sent))
                        return
            ex.task = asyncio.create_task(self._serve_task(req, ex, None))
        except Exception as exc:  # a bug: the client still gets an answer
            self._failed(req, ex, exc)
            self._done(req, ex)

    def _answered(
        self, req: fw.Request, ex: downstream.Exchange, route: fsm.Route, sent: upstream.Response
    ) -> None:
        """The fast path's attempt ended: relay the answer, or hand the request,
        with this attempt, to ``_serve``."""
        if not sent.complete or fw.not_active(sent):
            ex.task = asyncio.create_task(self._serve_task(req, ex, (route, sent)))
            return
        try:
            self.feed(fsm.Served(route.engine_id))
            fw.relay(ex, sent, sent.body())
        except downstream.ClientGone:
            pass
        except Exception as exc:  # a bug: the client still gets an answer
            self._failed(req, ex, exc)
        self._done(req, ex)

    async def _serve_task(
        self, req: fw.Request, ex: downstream.Exchange, sent: _Sent | None
    ) -> None:
        try:
            await self._serve(req, ex, sent)
        except downstream.ClientGone:
            pass
        except Exception as exc:  # a bug: the client still gets an answer
            self._failed(req, ex, exc)
        finally:  # cancelled too: its client went away
            self._done(req, ex)

    def _failed(self, req: fw.Request, ex: downstream.Exchange, exc: Exception) -> None:
        log.error("serving %s failed", req.path, exc_info=exc)
        with contextlib.suppress(downstream.ClientGone):
            if ex.answered:
                ex.abort()  # a stream cut short: only closing can say so
            else:
                ex.error(500, f"the front failed: {type(exc).__name__}")

    def _done(self, req: fw.Request, ex: downstream.Exchange) -> None:
        self._inflight -= 1
        if not self._inflight and self._drained is not None:
            self._drained.set()
        self.metrics.duration.observe(self._now() - req.arrived)
        # A client that left before its answer began counts as a 4xx (nginx's
        # 499): it was the client's doing.
        self._codes[f"{ex.status // 100}xx" if ex.status else "4xx"].inc()

    async def _serve(self, req: fw.Request, ex: downstream.Exchange, sent: _Sent | None) -> None:
        """Serve a request through holds and migrations; ``sent``: an attempt
        already under way (the fast path's), to conclude first."""
        deadline = self._now() + self.cfg.hold_s
        while True:
            first = None
            if sent is not None:
                (route, first), sent = sent, None
            else:
                held = await self._hold(deadline)
                if held is None:
                    self.metrics.hold_expired.inc()
                    return self._give_up(
                        req, ex, 503,
                        f"no engine became active within the hold of {self.cfg.hold_s}s",
                    )  # fmt: skip
                route = held
            outcome, answer = await self._attempt(req, route, ex, first)
            attempt = fsm.Attempt(req.streaming, req.relayed, req.migrations)
            v = fsm.verdict(attempt, outcome, self.policy)
            match v:
                case fsm.Verdict.RELAY:
                    self.feed(fsm.Served(route.engine_id))
                    if answer is not None:  # else the stream went out already
                        fw.relay(ex, *answer)
                    return None
                case fsm.Verdict.WAIT:
                    await self._wait(route, outcome, deadline)
                case fsm.Verdict.MIGRATE_NEW | fsm.Verdict.MIGRATE_ONGOING:
                    deadline = await self._migrate(req, route, v)
                case fsm.Verdict.FAIL:
                    return self._fail(req, ex, outcome)
                case _:
                    assert_never(v)

    async def _wait(self, route: fsm.Route, outcome: fsm.Outcome, deadline: float) -> None:
        """The request never ran: wait for the engine to take it, or for the
        lock to name another."""
        refused = outcome is fsm.Outcome.NOT_ACTIVE
        if not refused:
            self._watch_socket(route, deadline)
        patience = _REFUSED_RETRY_S if refused else _RETRY_S
        await self._await_change(route, deadline, patience)

    async def _migrate(self, req: fw.Request, route: fsm.Route, v: fsm.Verdict) -> float:
        """The engine died under the request: count the move, wait for the
        next route; returns the new deadline (each failover gets its own hold)."""
        req.migrations += 1
        self.metrics.migrations.labels(kind=v.value).inc()
        log_event(
            log, "migrating", kind=v.value, path=req.path,
            tokens=len(req.token_ids), migrations=req.migrations,
            from_engine=route.engine_id,
        )  # fmt: skip
        deadline = self._now() + self.cfg.hold_s
        await self._await_change(route, deadline, _MIGRATE_RETRY_S)
        return deadline

    def _fail(self, req: fw.Request, ex: downstream.Exchange, outcome: fsm.Outcome) -> None:
        if outcome is fsm.Outcome.REJECTED:
            self.metrics.migrations_failed.labels(reason="rejected").inc()
            return self._give_up(
                req, ex, 502, f"the next engine refused to continue the stream: {req.rejection}"
            )
        reason = "limit" if req.migrations >= self.policy.migration_limit else "state"
        self.metrics.migrations_failed.labels(reason=reason).inc()
        return self._give_up(
            req,
            ex,
            503,
            f"the engine serving this request died {req.migrations + 1} times; "
            f"migration limit is {self.policy.migration_limit}",
        )

    def _give_up(self, req: fw.Request, ex: downstream.Exchange, status: int, message: str) -> None:
        log_event(log, "gave_up", logging.ERROR, path=req.path, status=status, reason=message)
        if ex.answered:
            # A stream already went out: all that is left is to end it with an
            # error event the client can see, as OpenAI's streams do. The
            # send does not wait: the stream ends here either way.
            err = {"error": {"message": message, "type": "server_error", "code": status}}
            with contextlib.suppress(downstream.ClientGone):
                ex.end_stream(b"data: " + json.dumps(err).encode() + b"\n\n")
            return
        ex.error(status, message, retry_after=1)

    async def _attempt(
        self,
        req: fw.Request,
        route: fsm.Route,
        ex: downstream.Exchange,
        sent: upstream.Response | None = None,
    ) -> tuple[fsm.Outcome, _Answer | None]:
        """One attempt at ``route``: its outcome, and the answer to relay."""
        up = self._upstream(route.engine_id)
        r = await self._head(req, route, up, sent)
        if isinstance(r, fsm.Outcome):
            return r, None
        try:
            if fw.not_active(r):
                await r.read()
                up.drop_idle()  # its other connections are as good as gone
                return fsm.Outcome.NOT_ACTIVE, None
            if req.streaming and r.status == 200:
                return await self._relay_stream(req, r, ex)
            payload = await r.read()
            if ex.answered:
                # The client's stream is open: a second answer there would
                # corrupt it (a new status line inside the chunked body).
                req.rejection = f"{r.status} {payload[:200].decode(errors='replace')}"
                return fsm.Outcome.REJECTED, None
            return fsm.Outcome.ANSWERED, (r, payload)
        except (upstream.UpstreamError, continuation.StreamError) as exc:
            return self._broken(req, route, exc), None
        finally:
            r.close()

    async def _head(
        self,
        req: fw.Request,
        route: fsm.Route,
        up: upstream.Upstream,
        sent: upstream.Response | None,
    ) -> upstream.Response | fsm.Outcome:
        """Send the request (or take the one ``sent``) and read the answer's
        head; an outcome instead when there is none."""
        headers = fw.headers_for(req, route)
        data = fw.payload(req)
        try:
            if sent is not None:
                return await sent.head()
            return await up.request(req.method, req.target, headers, data)
        except upstream.Stale as stale:
            # A kept-alive connection died before any answer: either it died
            # idle, or its engine died with the request in it. A new
            # connection tells which: it reaches the engine, or finds none
            # (then the request may have run there: a migration).
            try:
                return await up.request(req.method, req.target, headers, data)
            except upstream.Unreachable:
                return self._broken(req, route, stale)
            except upstream.UpstreamError as exc:
                return self._broken(req, route, exc)
        except upstream.Unreachable:
            return fsm.Outcome.UNREACHABLE
        except upstream.UpstreamError as exc:
            return self._broken(req, route, exc)

    def _broken(self, req: fw.Request, route: fsm.Route, exc: Exception) -> fsm.Outcome:
        log_event(
            log, "attempt_broken", logging.WARNING, engine=route.engine_id,
            error=type(exc).__name__, detail=str(exc)[:200], relayed=req.relayed,
            path=req.path,
        )  # fmt: skip
        return fsm.Outcome.BROKEN

    async def _relay_stream(
        self, req: fw.Request, r: upstream.Response, ex: downstream.Exchange
    ) -> tuple[fsm.Outcome, _Answer | None]:
        """Relay an engine's event stream, keeping the token ids it carries. A
        client that goes away cancels this (its connection's doing)."""
        decoder = continuation.EventDecoder()
        async for chunk in r.chunks():
            for ev in decoder.feed(chunk):
                if not ex.answered:
                    ex.open_stream(200, fw.SSE)
                await ex.send(ev.raw)
                req.relayed = True
                req.started = True
                req.token_ids.extend(ev.token_ids)
                if ev.done:
                    ex.end_stream()
                    return fsm.Outcome.ANSWERED, None
        raise upstream.Broken("the stream ended without [DONE]")

    # ------------------------------------------------------------ surface --

    def pressure(self) -> dict[str, Any]:
        return {
            "inflight": self._inflight,
            "held": self._held,
            "active": self.state.route is not None,
        }

    def view(self) -> dict[str, Any]:
        s = self.state
        return {
            "pid": os.getpid(),  # the front's own process (under the respawner)
            "phase": s.phase.value,
            "route": {"engine_id": s.route.engine_id, "epoch": s.route.epoch} if s.route else None,
            "newest_epoch": s.newest_epoch,
            "condemned": s.condemned,
            **self.pressure(),
        }

    def ready(self) -> tuple[bool, str]:
        if fsm.ready(self.state, self._now(), self.cfg.hold_s):
            return True, "serving" if self.state.route else "failover under way"
        return False, "no active engine"

    async def start(self, listener: socket.socket, offer: handover.Offer | None = None) -> None:
        """Accept on ``listener`` at once, then start everything else."""
        if offer is not None and offer.holder is not None:
            # The keeper's word on the lock until the watch's (the same word).
            self.feed(fsm.HolderSeen(offer.holder, offer.epoch))
        self._listener = listener
        self._ledger = Ledger(self.cfg.run_dir / LEDGER)
        before = self._ledger.take_over()
        self._server.serve_on(listener, handover.BACKLOG)
        self._took_over(before)
        self._status = await status_port.serve(self, self.cfg.host, self.cfg.status_port)
        self._tasks = [
            asyncio.create_task(self._watch_lock(), name="lock-watch"),
            asyncio.create_task(self._check_beats(), name="heartbeats"),
            asyncio.create_task(
                handover.offer_forever(
                    self.cfg.run_dir / handover.FRONT_SOCKET,
                    lambda: self._listener,
                    self._offer,
                    log,
                ),
                name="handover",
            ),
        ]
        log_event(
            log, "listening", port=self.cfg.port, status_port=self.cfg.status_port,
            hold_s=self.cfg.hold_s, migration_limit=self.cfg.migration_limit,
        )  # fmt: skip

    def _took_over(self, before: Predecessor) -> None:
        """Count what the previous front lost, and say it."""
        assert self._ledger is not None
        m = self.metrics
        m.lost.inc(self._ledger.lost)
        m.restarts.inc(self._ledger.starts - 1)
        if before.pid:
            log_event(
                log, "took_over", logging.WARNING if before.busy else logging.INFO,
                predecessor=before.pid, lost=before.busy if not before.torn else "unknown",
                lost_total=self._ledger.lost, restarts=self._ledger.starts - 1,
            )  # fmt: skip

    def _offer(self) -> handover.Offer:
        route = self.state.route
        return handover.Offer(
            port=self.cfg.port,
            keeper="front",
            pid=os.getpid(),
            holder=route.engine_id if route else None,
            epoch=route.epoch if route else 0,
        )

    async def drain(self) -> None:
        """Stop accepting (new connections wait for the next front), finish
        in-flight requests (bounded), then close."""
        self._server.stop_accepting()
        self._drained = asyncio.Event()
        if not self._inflight:
            self._drained.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.drain_s):
                await self._drained.wait()
        await self.close()

    async def close(self) -> None:
        tasks = [*self._tasks, *self._watchers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._server.close()
        if self._status is not None:
            self._status.close()
        for up in self._upstreams.values():
            up.close()
        if self._ledger is not None:
            self._ledger.busy(self._server.busy)  # what a drain could not finish
            self._ledger.close()


# An engine's whole answer, to relay as it is.
_Answer = tuple[upstream.Response, bytes]
# An attempt already sent (by the fast path), and where to.
_Sent = tuple[fsm.Route, upstream.Response]


async def obtain(cfg: FrontConfig) -> tuple[socket.socket, handover.Offer | None, str]:
    """The pod's serving socket: from the lock server that keeps it, else
    bound here (nobody keeps it: the front's death will refuse connections)."""
    keeper = [cfg.run_dir / handover.KEEPER_SOCKET]
    deadline = time.monotonic() + _OBTAIN_FOR_S
    while True:
        try:
            return handover.obtain(keeper, cfg.host, cfg.port)
        except OSError as exc:
            # Taken, but nobody offers it: the keeper restarts too. Ask again.
            if not handover.in_use(exc) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(_OBTAIN_RETRY_S)


async def run(cfg: FrontConfig, started: float | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain. ``started``: seconds since this
    process's exec when it was called (its start time is reported)."""
    t0 = time.monotonic()
    listener, offer, source = await obtain(cfg)
    front = Front(cfg)
    await front.start(listener, offer)
    seconds = (started or 0.0) + time.monotonic() - t0
    front.metrics.start_seconds.set(seconds)
    log_event(
        log, "accepting", source=source, start_ms=round(seconds * 1000, 1),
        cpu_ms=round(time.process_time() * 1000, 1),  # of that start: the machine's load aside
    )  # fmt: skip
    if source == "bound":
        log_event(
            log, "serving_socket_unkept", logging.WARNING, keeper=str(cfg.run_dir),
            consequence="nobody keeps the serving socket: this front's death refuses connections",
        )  # fmt: skip
    from understudy.wire.respawn import notify_ready

    notify_ready()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log_event(log, "draining", inflight=front._inflight, held=front._held)
    await front.drain()
