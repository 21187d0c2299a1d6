"""A client's request to an engine and its answer back: handle, attempt, relay, continue.

A :class:`Forwarder` serves each request a client sends (``downstream``) over
the connections to a route (``upstream``) that it asks a router for
(:class:`Routes`: the pod's is ``router.Router``); it knows nothing of locks,
heartbeats or pods. One that finds no route waits for one (the hold); one
whose engine dies under it is sent again to the next (migration): replayed
whole, or, for a stream that already sent tokens, continued after them.
``fsm.verdict`` decides which; ``forwarding`` is what a request becomes on
its way to an engine, and back.

Every request ends in exactly one of these (the give-ups tell the client
through ``forwarding.answer_error``):

- ``forwarding.relay``: the engine's answer, as it is (any status);
- ``give_up_hold``: no route within the hold (503, ``Retry-After``);
- ``give_up_limit``: its engines died more often than it may move, or it
  cannot move (a plain answer half relayed) (503);
- ``isolation.answer_poison``: an engine died while it ran alone, after two
  deaths beside others: it is the poison (422; docs/poison.md);
- ``give_up_rejected``: the next engine refused to continue its stream (502);
- ``answer_bug``: the front failed (500, or a stream cut short);
- its client left (nothing to answer);

and then in ``finish``, which counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol, assert_never

from understudy.front import connlog, continuation, downstream, fsm, upstream
from understudy.front import forwarding as fw
from understudy.front.isolation import Isolation
from understudy.front.metrics import FrontMetrics
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.front")

# An engine's whole answer, to relay as it is.
_Answer = tuple[upstream.Response, bytes]
# An attempt already sent (by the fast path), and where to.
_Sent = tuple[fsm.Route, upstream.Response]


class Routes(Protocol):
    """What a forwarder asks of a router, and all it asks."""

    @property
    def route(self) -> fsm.Route | None:
        """The route now (None: nobody to route to), without waiting."""

    def upstream(self, route: fsm.Route) -> upstream.Upstream:
        """The connections to ``route``'s target."""

    async def hold(self, deadline: float) -> fsm.Route | None:
        """The route, waiting for one until ``deadline`` (loop time) if there
        is none now; None when the wait ran out."""

    async def retry_after(self, route: fsm.Route, outcome: fsm.Outcome, deadline: float) -> None:
        """After an attempt at ``route`` that ended in ``outcome`` (refused,
        unreachable, or broken by its engine's death): return when it is
        worth trying again (the route changed, the target came up, or the
        patience for that outcome ran out), never after ``deadline``."""

    def served(self, route: fsm.Route) -> None:
        """``route`` answered a request."""


class Forwarder:
    """Serves each client request through holds and migrations."""

    def __init__(self, router: Routes, policy: fsm.Policy, metrics: FrontMetrics) -> None:
        self.router = router
        self.policy = policy
        self.metrics = metrics
        self.isolation = Isolation(metrics)  # who may go: all, but on a suspect's turn
        self.inflight = 0  # requests not finished
        # Requests sent to an engine whose answer is not whole yet: what a test
        # waits for before it kills that engine (``/state``).
        self.at_engine = 0
        codes = ("2xx", "3xx", "4xx", "5xx")
        self._codes = {c: metrics.requests.labels(code=c) for c in codes}
        self._idle: asyncio.Event | None = None  # set when nothing is in flight
        self._loop = asyncio.get_running_loop()

    # ---------------------------------------------------------- the paths --

    def handle(self, ex: downstream.Exchange) -> None:
        """A client's request, whole.

        The fast path, taken by most requests: a route exists, the request is
        not a stream, and a kept-alive connection to the route is idle. The
        request goes out at once and the answer is relayed from the
        connection's callback (``_answered``), with no task, future or
        coroutine on the way: on two cores the front's own CPU is most of the
        latency it adds. Everything else (no route, no idle connection, a
        stream, or a first attempt that was not simply answered) is served
        by ``_serve`` in a task, which makes every decision of the hold and
        of migration; the fast path decides nothing it would not.
        """
        req = fw.parse(ex, self._loop.time())
        self.inflight += 1
        try:
            route = self.router.route
            if route is not None and not req.streaming and self.isolation.open:
                sent = self.router.upstream(route).send_idle(
                    req.method, req.target, fw.headers_for(req, route), fw.payload(req)
                )
                if sent is not None:
                    self.at_engine += 1
                    self.isolation.out += 1  # let out while open (``_answered`` ends it)
                    sent.on_complete(lambda: self._answered(req, ex, route, sent))
                    return
            ex.task = asyncio.create_task(self._serve_task(req, ex, None))
        except Exception as exc:  # a bug: the client still gets an answer
            self.answer_bug(req, ex, exc)
            self.finish(req, ex)

    def resume(self, ex: downstream.Exchange, stream: connlog.Stream) -> None:
        """A stream a front that died had under way on this connection
        (``downstream.ClientConnection.adopt``): it goes on from the tokens
        its client has, as a migration's would."""
        req = fw.resumed_request(ex, stream, self._loop.time())
        self.inflight += 1
        self.metrics.adopted_streams.inc()
        if req.relay_tokens:
            fw.start_beats(req, ex)
        ex.task = asyncio.create_task(self._serve_task(req, ex, None))

    def _answered(
        self, req: fw.Request, ex: downstream.Exchange, route: fsm.Route, sent: upstream.Response
    ) -> None:
        """The fast path's attempt ended: relay the answer, or hand the request,
        with this attempt, to ``_serve``."""
        self.at_engine -= 1
        if not sent.complete or fw.not_active(sent):
            ex.task = asyncio.create_task(self._serve_task(req, ex, (route, sent)))
            return
        self.isolation.back()
        try:
            self.router.served(route)
            fw.relay(ex, sent, sent.body())
        except downstream.ClientGone:
            pass
        except Exception as exc:  # a bug: the client still gets an answer
            self.answer_bug(req, ex, exc)
        self.finish(req, ex)

    async def _serve_task(
        self, req: fw.Request, ex: downstream.Exchange, sent: _Sent | None
    ) -> None:
        try:
            await self._serve(req, ex, sent)
        except downstream.ClientGone:
            pass
        except Exception as exc:  # a bug: the client still gets an answer
            self.answer_bug(req, ex, exc)
        finally:  # cancelled too: its client went away
            self.finish(req, ex)

    async def _serve(self, req: fw.Request, ex: downstream.Exchange, sent: _Sent | None) -> None:
        """Serve a request through holds and migrations; ``sent``: an attempt
        already under way (the fast path's), to conclude first."""
        deadline: float | None = self._loop.time() + self.policy.hold_s
        while deadline is not None:
            route, first = sent if sent is not None else (None, None)
            # Its turn first (held behind a suspect that runs alone), then the
            # newest route.
            if sent is None and not await self.isolation.admit(id(req), deadline, self.router):
                return self.give_up_hold(req, ex)
            sent, outcome, engine = None, None, ""
            try:
                if (route := route or await self.router.hold(deadline)) is None:
                    outcome = fsm.Outcome.UNREACHABLE  # it never ran
                    return self.give_up_hold(req, ex)
                engine = route.engine_id
                outcome, answer = await self._attempt(req, route, ex, first)
            finally:  # cancelled too (its client left): the attempt is over
                poison = self.isolation.ended(id(req), outcome, engine)
            deadline = await self._conclude(req, ex, route, outcome, answer, deadline, poison)
        return None

    async def _conclude(
        self,
        req: fw.Request,
        ex: downstream.Exchange,
        route: fsm.Route,
        outcome: fsm.Outcome,
        answer: _Answer | None,
        deadline: float,
        poison: bool = False,
    ) -> float | None:
        """Do what the attempt's verdict says: the deadline of the next
        attempt, or None when the request ended."""
        attempt = fsm.Attempt(req.streaming, req.relayed, req.migrations, poison)
        v = fsm.verdict(attempt, outcome, self.policy)
        match v:
            case fsm.Verdict.RELAY:
                self.router.served(route)
                if answer is not None:  # else the stream went out already
                    fw.relay(ex, *answer)
                return None
            case fsm.Verdict.WAIT if self._loop.time() >= deadline:
                # A route all along, and none took it (one that never
                # listens, or refuses): the hold is over all the same.
                self.give_up_hold(req, ex)
                return None
            case fsm.Verdict.WAIT:
                # The request never ran: wait for the engine to take it, or
                # for the lock to name another.
                await self.router.retry_after(route, outcome, deadline)
                return deadline
            case fsm.Verdict.MIGRATE_NEW | fsm.Verdict.MIGRATE_ONGOING:
                return await self._migrate(req, route, v)
            case fsm.Verdict.FAIL if outcome is fsm.Outcome.REJECTED:
                self.give_up_rejected(req, ex)
                return None
            case fsm.Verdict.FAIL:
                self.give_up_limit(req, ex)
                return None
            case fsm.Verdict.POISON:
                self.isolation.answer_poison(req, ex)
                return None
            case _:
                assert_never(v)

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
        deadline = self._loop.time() + self.policy.hold_s
        await self.router.retry_after(route, fsm.Outcome.BROKEN, deadline)
        return deadline

    # ------------------------------------------------------------ attempts --

    async def _attempt(
        self,
        req: fw.Request,
        route: fsm.Route,
        ex: downstream.Exchange,
        sent: upstream.Response | None = None,
    ) -> tuple[fsm.Outcome, _Answer | None]:
        """One attempt at ``route`` (``sent``: the request already went out
        there): its outcome, and the answer to relay."""
        up = self.router.upstream(route)
        if sent is None:
            headers, data = fw.headers_for(req, route), fw.payload(req)
            try:
                sent = await up.send(req.method, req.target, headers, data)
            except upstream.Unreachable:
                return fsm.Outcome.UNREACHABLE, None
        self.at_engine += 1
        try:
            r = await self._head(req, route, up, sent)
            if isinstance(r, fsm.Outcome):
                outcome, answer = r, None
            else:
                outcome, answer = await self._answer(req, route, up, r, ex)
        finally:
            self.at_engine -= 1
        if outcome is fsm.Outcome.BROKEN:
            # Resent with the others its engine's death broke (COHORT_HEADER):
            # the next engine starts them together as soon as all are in.
            req.cohort = up.broke_together
        return outcome, answer

    async def _answer(
        self,
        req: fw.Request,
        route: fsm.Route,
        up: upstream.Upstream,
        r: upstream.Response,
        ex: downstream.Exchange,
    ) -> tuple[fsm.Outcome, _Answer | None]:
        """Read the answer whose head came back."""
        try:
            if fw.not_active(r):
                await r.read()
                up.drop_idle()  # its other connections are as good as gone
                return fsm.Outcome.NOT_ACTIVE, None
            if req.streaming and r.status == 200:
                return await fw.relay_stream(req, r, ex)
            payload = await r.read()
            if ex.answered:
                # The client's stream is open: a second answer there would
                # corrupt it (a new status line inside the chunked body).
                req.rejection = f"{r.status} {payload[:200].decode(errors='replace')}"
                return fsm.Outcome.REJECTED, None
            return fsm.Outcome.ANSWERED, (r, payload)
        except (upstream.UpstreamError, continuation.StreamError) as exc:
            return _attempt_broke(req, route, exc), None
        finally:
            r.close()

    async def _head(
        self, req: fw.Request, route: fsm.Route, up: upstream.Upstream, sent: upstream.Response
    ) -> upstream.Response | fsm.Outcome:
        """The head of the answer to the request ``sent``; an outcome instead
        when there is none."""
        try:
            try:
                return await sent.head()
            except BaseException:
                sent.close()  # cancelled, or the engine is gone: its connection is done
                raise
        except upstream.Stale as stale:
            # A kept-alive connection died before any answer: either it died
            # idle, or its engine died with the request in it. A new
            # connection tells which: it reaches the engine, or finds none
            # (then the request may have run there: a migration).
            if not self.isolation.may_resend(id(req)):
                # A suspect runs alone now: this one waits for its turn again.
                return fsm.Outcome.UNREACHABLE
            headers, data = fw.headers_for(req, route), fw.payload(req)
            try:
                return await up.request(req.method, req.target, headers, data)
            except upstream.Unreachable:
                return _attempt_broke(req, route, stale)
            except upstream.UpstreamError as exc:
                return _attempt_broke(req, route, exc)
        except upstream.UpstreamError as exc:
            return _attempt_broke(req, route, exc)

    # ----------------------------------------------------------- endings --

    def give_up_hold(self, req: fw.Request, ex: downstream.Exchange) -> None:
        self.metrics.hold_expired.inc()
        hold = self.policy.hold_s
        fw.answer_error(req, ex, 503, f"no engine became active within the hold of {hold}s")

    def give_up_limit(self, req: fw.Request, ex: downstream.Exchange) -> None:
        """Its engine died once more than it may move (or it cannot move:
        ``state``, a plain answer already half relayed)."""
        limit = self.policy.migration_limit
        reason = "limit" if req.migrations >= limit else "state"
        self.metrics.migrations_failed.labels(reason=reason).inc()
        fw.answer_error(
            req,
            ex,
            503,
            f"the engine serving this request died {req.migrations + 1} times; "
            f"migration limit is {limit}",
        )

    def give_up_rejected(self, req: fw.Request, ex: downstream.Exchange) -> None:
        self.metrics.migrations_failed.labels(reason="rejected").inc()
        message = f"the next engine refused to continue the stream: {req.rejection}"
        fw.answer_error(req, ex, 502, message)

    def answer_bug(self, req: fw.Request, ex: downstream.Exchange, exc: Exception) -> None:
        """The front failed serving it (a bug): the client still gets an answer."""
        log.error("serving %s failed", req.path, exc_info=exc)
        ex.fail(exc)

    def finish(self, req: fw.Request, ex: downstream.Exchange) -> None:
        """Every request ends here, once, however it ended: counted."""
        self.isolation.finished(id(req))
        self.inflight -= 1
        if not self.inflight and self._idle is not None:
            self._idle.set()
        self.metrics.duration.observe(self._loop.time() - req.arrived)
        # A client that left before its answer began counts as a 4xx (nginx's
        # 499): it was the client's doing.
        self._codes[f"{ex.status // 100}xx" if ex.status else "4xx"].inc()

    def refused(self, status: int) -> None:
        """A request the server refused before it was whole (too large, malformed)."""
        self._codes[f"{status // 100}xx"].inc()

    async def settle(self, within: float) -> None:
        """Wait until no request is in flight, at most ``within`` seconds."""
        self._idle = asyncio.Event()
        if not self.inflight:
            self._idle.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self._idle.wait()


def _attempt_broke(req: fw.Request, route: fsm.Route, exc: Exception) -> fsm.Outcome:
    """The attempt's connection died after the request went out."""
    log_event(
        log, "attempt_broken", logging.WARNING, engine=route.engine_id,
        error=type(exc).__name__, detail=str(exc)[:200], relayed=req.relayed,
        path=req.path,
    )  # fmt: skip
    return fsm.Outcome.BROKEN
