"""Poison isolation (``fsm.isolate``) in its asyncio shell, for a forwarder.

The core decides; this keeps what it needs from the loop: how many requests
are out at an engine (``out``, counted from the moment one may go until its
attempt ends), the wait of a request that may not go yet (bounded by its
hold), and the log and metrics of what the core says. Requests are keyed by
``id()`` of the forwarder's request object, which lives until it finishes
(and the core forgets it then).

The rule and why: docs/poison.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol, assert_never

from understudy.front import downstream, fsm
from understudy.front import forwarding as fw
from understudy.front.metrics import FrontMetrics
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.front")

# While a request may not go, it looks again this often (as well as when the
# isolation changes): the route standing long enough is not an event here.
_RECHECK_S = 0.02


class Routed(Protocol):
    @property
    def route(self) -> fsm.Route | None: ...


class Isolation:
    """Which request may go to an engine now, and which one is the poison."""

    def __init__(self, metrics: FrontMetrics) -> None:
        self.metrics = metrics
        self.state = fsm.Suspects()
        self.out = 0  # requests allowed out and whose attempt has not ended
        self._route: fsm.Route | None = None  # the route last seen, and since when
        self._since = 0.0
        self._poisoned: dict[int, int] = {}  # poison -> its engines' deaths, until answered
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    @property
    def open(self) -> bool:
        """No suspect waits to run alone: anything may go (the fast path's check)."""
        return self.state.phase is fsm.Isolation.OPEN

    def may_resend(self, key: int) -> bool:
        """May a request that is out already go out again on a new connection?"""
        return self.open or key == self.state.alone

    async def admit(self, key: int, deadline: float, router: Routed) -> bool:
        """Wait until the request may go (False: not before ``deadline``); it is
        then out until ``ended``."""
        while not fsm.may_send(self.state, key, self.out, self._routed_for(router.route)):
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, _RECHECK_S)):
                    await changed.wait()
        self.out += 1
        if key == self.state.alone:
            self._feed(fsm.Sent(key))
        return True

    def _routed_for(self, route: fsm.Route | None) -> float:
        """How long ``route`` has stood, as far as this has seen (0: none)."""
        now = self._loop.time()
        if route != self._route:
            self._route, self._since = route, now
        return now - self._since if route is not None else 0.0

    def ended(self, key: int, outcome: fsm.Outcome | None, engine: str = "") -> bool:
        """A request's attempt at ``engine`` ended (``None``: cut short, its
        client left); True when it is the poison."""
        self.out -= 1
        poison = False
        if outcome is fsm.Outcome.BROKEN:
            for a in self._feed(fsm.Died(key, engine)):
                if isinstance(a, fsm.Poisoned):
                    self._poisoned[a.request] = a.deaths
                    poison = True
        elif (
            outcome in (fsm.Outcome.NOT_ACTIVE, fsm.Outcome.UNREACHABLE)
            and key == self.state.alone
            and self.state.phase is fsm.Isolation.ALONE
        ):
            self._feed(fsm.Returned(key))
        if not self.out and self.state.phase is fsm.Isolation.CLEARING:
            self._wake()  # the suspect whose turn it is may go now
        return poison

    def back(self) -> None:
        """A fast-path attempt ended (it was let out while open)."""
        self.out -= 1
        if not self.out and self.state.phase is fsm.Isolation.CLEARING:
            self._wake()

    def finished(self, key: int) -> None:
        """A request ended; the core hears of those that died at least once."""
        if key in self.state.deaths:
            self._feed(fsm.Finished(key))

    def answer_poison(self, req: fw.Request, ex: downstream.Exchange) -> None:
        """Tell the poison's client. A 4xx with no Retry-After: clients
        (OpenAI's SDK among them) retry a 5xx, and each retry would kill
        engines again."""
        deaths = self._poisoned.pop(id(req), req.migrations + 1)
        message = (
            f"this request killed the engine that ran it alone, after {deaths - 1} "
            f"engine deaths beside other requests ({deaths} in all); it is not sent again"
        )
        fw.answer_error(req, ex, 422, message, retry_after=None)

    def _feed(self, event: fsm.IsolationEvent) -> list[fsm.IsolationAction]:
        self.state, actions = fsm.isolate(self.state, event, self._loop.time())
        for action in actions:
            self._execute(action)
        self._wake()
        return actions

    def _execute(self, action: fsm.IsolationAction) -> None:
        m = self.metrics
        match action:
            case fsm.Suspected(request=r, deaths=n):
                log_event(log, "suspect", logging.WARNING, request=r, deaths=n)
            case fsm.RunAlone(request=r):
                m.isolated.inc()
                log_event(log, "run_alone", logging.WARNING, request=r, out=self.out)
            case fsm.Poisoned(request=r, deaths=n):
                m.poison.inc()
                log_event(log, "poison", logging.ERROR, request=r, deaths=n)
            case fsm.Cleared(request=r):
                log_event(log, "suspect_cleared", request=r)
            case _:
                assert_never(action)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
