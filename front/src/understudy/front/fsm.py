"""The front door's decision core: where requests go, and what a failed one does next.

Two pure parts, both with time passed in:

- the **routing machine** (``step``, one ``TRANSITIONS`` table): which engine
  is Active and under which epoch, from the lock's holder and the hang
  detector. An epoch older than the newest seen is never routed to, so a
  stale engine cannot take traffic even if it still answers;
- the **request verdicts** (``verdict``): after one attempt to forward a
  request, whether to relay the answer, wait for the next Active engine,
  migrate (replay a request whole, or continue a stream where it stopped) or
  give up with an error the client can act on.

The shell (``proxy``) feeds lock events and attempt outcomes and carries out
what comes back; it makes no decision of its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from understudy.wire import machine

# ---------------------------------------------------------------- state ----


class Phase(enum.Enum):
    WAITING = "waiting"  # no Active engine known: requests are held
    ROUTING = "routing"  # requests go to the engine that holds the lock


@dataclass(frozen=True, slots=True)
class Route:
    engine_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class FrontState:
    phase: Phase = Phase.WAITING
    route: Route | None = None
    newest_epoch: int = 0
    # When the front last lost its route (a release, a hang, a handover):
    # the start of the gap a client sees. None while routing normally.
    lost_at: float | None = None
    # An engine declared hung keeps the lock until it dies; it is never
    # routed to again whatever the lock says meanwhile.
    condemned: str | None = None


# --------------------------------------------------------------- events ----


@dataclass(frozen=True, slots=True)
class HolderSeen:
    """The lock's holder (None: nobody) and the epoch, as the lock server says."""

    holder: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class Hung:
    """The routed engine's heartbeat stopped for longer than the hang limit."""

    engine_id: str
    silent_s: float


@dataclass(frozen=True, slots=True)
class Served:
    """A request was answered by the routed engine: the gap, if any, is over."""

    engine_id: str


Event = HolderSeen | Hung | Served

# -------------------------------------------------------------- actions ----


@dataclass(frozen=True, slots=True)
class RouteTo:
    route: Route
    handover: bool  # another engine was routed before (a failover)


@dataclass(frozen=True, slots=True)
class Unroute:
    reason: str  # "released" | "hung"


@dataclass(frozen=True, slots=True)
class Kill:
    """End a hung engine's process: its death releases the lock (the fence)."""

    engine_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class IgnoredStale:
    holder: str | None
    epoch: int
    newest: int


@dataclass(frozen=True, slots=True)
class GapEnded:
    seconds: float  # route lost -> first answer from the next engine


Action = RouteTo | Unroute | Kill | IgnoredStale | GapEnded


class InvalidTransition(machine.InvalidTransition):
    """An event the current phase does not accept (a bug in the shell)."""


# ------------------------------------------------------------- handlers ----

Result = tuple[FrontState, list[Action]]


def _holder_seen(s: FrontState, e: HolderSeen, now: float) -> Result:
    if e.epoch < s.newest_epoch:
        return s, [IgnoredStale(e.holder, e.epoch, s.newest_epoch)]
    s = replace(s, newest_epoch=e.epoch)
    if e.holder is None or e.holder == s.condemned:
        if s.route is None:
            return s, []
        lost = s.lost_at if s.lost_at is not None else now
        return replace(s, phase=Phase.WAITING, route=None, lost_at=lost), [Unroute("released")]
    route = Route(e.holder, e.epoch)
    if s.route == route:
        return s, []
    # Same engine, new epoch (a restarted lock server re-granted it): no failover.
    same_engine = s.route is not None and s.route.engine_id == e.holder
    handover = s.route is not None and not same_engine
    lost_at = s.lost_at
    if handover and lost_at is None:
        lost_at = now  # a direct handover: the old engine died and a waiter got it at once
    new = replace(s, phase=Phase.ROUTING, route=route, lost_at=lost_at)
    return new, [RouteTo(route, handover=handover or lost_at is not None)]


def _hung(s: FrontState, e: Hung, now: float) -> Result:
    if s.route is None or s.route.engine_id != e.engine_id:
        return s, []  # not the engine we route to: the lock moved on already
    lost = s.lost_at if s.lost_at is not None else now - e.silent_s
    new = replace(s, phase=Phase.WAITING, route=None, lost_at=lost, condemned=e.engine_id)
    return new, [
        Unroute("hung"),
        Kill(e.engine_id, f"no heartbeat for {e.silent_s:.2f}s"),
    ]


def _served(s: FrontState, e: Served, now: float) -> Result:
    if s.lost_at is None or s.route is None or s.route.engine_id != e.engine_id:
        return s, []
    return replace(s, lost_at=None), [GapEnded(max(0.0, now - s.lost_at))]


def _ignore(s: FrontState, e: Event, now: float) -> Result:
    return s, []


_ANY = frozenset(Phase)
W, R = Phase.WAITING, Phase.ROUTING

TRANSITIONS: dict[tuple[Phase, type], machine.Entry[FrontState, Action, Phase]] = {
    (W, HolderSeen): machine.Entry(_holder_seen, _ANY),
    (R, HolderSeen): machine.Entry(_holder_seen, _ANY),
    (W, Hung): machine.Entry(_ignore, frozenset({W})),
    (R, Hung): machine.Entry(_hung, _ANY),
    (W, Served): machine.Entry(_ignore, frozenset({W})),
    (R, Served): machine.Entry(_served, frozenset({R})),
}


def _phase(s: FrontState, e: object) -> Phase:
    return s.phase


def step(s: FrontState, event: Event, now: float) -> Result:
    """Apply one event. Raises InvalidTransition (state unchanged) on a miss."""
    return machine.run_step(TRANSITIONS, _phase, s, event, now, error=InvalidTransition)


def ready(s: FrontState, now: float, hold_s: float) -> bool:
    """Can the pod take a request now: an Active engine, or a failover within the hold."""
    if s.route is not None:
        return True
    return s.lost_at is not None and now - s.lost_at < hold_s


# ------------------------------------------------------ request verdicts ----


class Outcome(enum.Enum):
    ANSWERED = "answered"  # the engine answered (any status); the body is complete
    NOT_ACTIVE = "not_active"  # the engine refused: not Active, draining, or another epoch
    UNREACHABLE = "unreachable"  # could not connect: not serving (yet), or gone
    BROKEN = "broken"  # the connection died after the request was sent
    # The continuation of a stream the client is already reading was answered
    # with an error: it cannot be relayed in the stream, nor sent again.
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class Attempt:
    streaming: bool
    relayed: bool  # response bytes already went to the client
    migrations: int  # how many times this request moved to another engine


@dataclass(frozen=True, slots=True)
class Policy:
    hold_s: float = 30.0
    migration_limit: int = 3


class Verdict(enum.Enum):
    RELAY = "relay"  # give the engine's answer to the client as it is
    WAIT = "wait"  # wait for an Active engine (or a new one), then send again
    MIGRATE_NEW = "new"  # send the whole request to the next Active engine
    MIGRATE_ONGOING = "ongoing"  # continue the stream on the next Active engine
    FAIL = "fail"  # tell the client: nothing more can be done within its limits


def verdict(attempt: Attempt, outcome: Outcome, policy: Policy) -> Verdict:
    """What to do after one attempt. A 4xx or any other answer is relayed and
    never replayed: the engine judged the request itself, not its own death."""
    match outcome:
        case Outcome.ANSWERED:
            return Verdict.RELAY
        case Outcome.NOT_ACTIVE | Outcome.UNREACHABLE:
            # The request never ran: waiting costs no migration.
            return Verdict.WAIT
        case Outcome.REJECTED:
            return Verdict.FAIL
        case Outcome.BROKEN:
            if attempt.migrations >= policy.migration_limit:
                return Verdict.FAIL
            if attempt.relayed:
                return Verdict.MIGRATE_ONGOING if attempt.streaming else Verdict.FAIL
            return Verdict.MIGRATE_NEW
