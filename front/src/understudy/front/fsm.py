"""The front door's decision core: where requests go, and what a failed one does next.

Three pure parts, all with time passed in:

- the **routing machine** (``step``, one ``TRANSITIONS`` table): which engine
  is Active and under which epoch, from the lock's holder and the hang
  detector. An event is first judged against the state (``kind``: an older
  epoch, nobody to route to, a new route, ...); the table maps the phase and
  that judgement to the handler and the one phase it leads to. An epoch
  older than the newest seen is never routed to, so a stale engine cannot
  take traffic even if it still answers;
- the **request verdicts** (``verdict``): after one attempt to forward a
  request, whether to relay the answer, wait for the next Active engine,
  migrate (replay a request whole, or continue a stream where it stopped) or
  give up with an error the client can act on;
- the **heartbeat judgement** (``judge_beat``): from the times alone, whether
  the routed engine is hung, alive, or cannot be judged because the front
  itself was not scheduled (a stall of the whole machine).

The shells feed lock events, heartbeat times and attempt outcomes and carry
out what comes back (``router``: the routing machine and the heartbeat;
``forwarder``: the verdicts); they make no decision of their own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, assert_never

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


# ---------------------------------------------------------------- kinds ----


class Kind(enum.Enum):
    """What an event means for the routing, judged against the state by
    :func:`kind`. The table's second key: an event's type alone does not say
    where it leads (the same ``HolderSeen`` may start a route, end it or be
    ignored), its meaning does, so each entry names the one phase it leads to."""

    OLDER = "HolderSeen (older epoch)"  # never routed to: a newer epoch was seen
    VACANT = "HolderSeen (nobody to route to)"  # released, or held by the condemned engine
    GRANTED = "HolderSeen (new route)"  # an engine, or an epoch, not routed to yet
    CURRENT = "HolderSeen (route taken)"  # the route the front already has
    HUNG = "Hung (routed engine)"
    HUNG_ELSEWHERE = "Hung (not routed)"  # the lock moved on already
    SERVED = "Served (routed engine)"
    SERVED_ELSEWHERE = "Served (earlier route)"  # an answer from before a handover


def kind(s: FrontState, e: Event) -> Kind:
    """Judge an event against the state (pure; the table does the rest)."""
    match e:
        case HolderSeen(holder=holder, epoch=epoch):
            if epoch < s.newest_epoch:
                return Kind.OLDER
            if holder is None or holder == s.condemned:
                return Kind.VACANT
            return Kind.CURRENT if s.route == Route(holder, epoch) else Kind.GRANTED
        case Hung(engine_id=engine_id):
            return Kind.HUNG if _routed(s, engine_id) else Kind.HUNG_ELSEWHERE
        case Served(engine_id=engine_id):
            return Kind.SERVED if _routed(s, engine_id) else Kind.SERVED_ELSEWHERE
        case _:
            assert_never(e)


def _routed(s: FrontState, engine_id: str) -> bool:
    return s.route is not None and s.route.engine_id == engine_id


# ------------------------------------------------------------- handlers ----

Result = tuple[FrontState, list[Action]]


def _older(s: FrontState, e: HolderSeen, now: float) -> Result:
    return s, [IgnoredStale(e.holder, e.epoch, s.newest_epoch)]


def _vacant(s: FrontState, e: HolderSeen, now: float) -> Result:
    """Nobody the front may route to holds the lock, and it routes nowhere."""
    return replace(s, newest_epoch=e.epoch), []


def _released(s: FrontState, e: HolderSeen, now: float) -> Result:
    """The routed engine let go (it died), or the lock names the condemned one."""
    lost = s.lost_at if s.lost_at is not None else now
    new = replace(s, phase=Phase.WAITING, route=None, newest_epoch=e.epoch, lost_at=lost)
    return new, [Unroute("released")]


def _granted(s: FrontState, e: HolderSeen, now: float) -> Result:
    assert e.holder is not None  # kind() made it GRANTED
    route = Route(e.holder, e.epoch)
    # Same engine, new epoch (a restarted lock server re-granted it): no failover.
    same_engine = _routed(s, e.holder)
    handover = s.route is not None and not same_engine
    lost_at = s.lost_at
    if handover and lost_at is None:
        lost_at = now  # a direct handover: the old engine died and a waiter got it at once
    new = replace(s, phase=Phase.ROUTING, route=route, newest_epoch=e.epoch, lost_at=lost_at)
    return new, [RouteTo(route, handover=handover or lost_at is not None)]


def _hung(s: FrontState, e: Hung, now: float) -> Result:
    lost = s.lost_at if s.lost_at is not None else now - e.silent_s
    new = replace(s, phase=Phase.WAITING, route=None, lost_at=lost, condemned=e.engine_id)
    return new, [
        Unroute("hung"),
        Kill(e.engine_id, f"no heartbeat for {e.silent_s:.2f}s"),
    ]


def _served(s: FrontState, e: Served, now: float) -> Result:
    if s.lost_at is None:
        return s, []  # no gap open: an answer like any other
    return replace(s, lost_at=None), [GapEnded(max(0.0, now - s.lost_at))]


def _ignore(s: FrontState, e: Event, now: float) -> Result:
    return s, []


W, R = Phase.WAITING, Phase.ROUTING
K = Kind
Entry = machine.Entry[FrontState, Action, Phase]


def _to(handler: Callable[[FrontState, Any, float], Result], phase: Phase) -> Entry:
    return machine.Entry(handler, frozenset({phase}))


# (phase, kind) -> (handler, the phase it leads to). A pair that is missing
# (say, the routed engine hung while nothing is routed) cannot be judged so.
TRANSITIONS: dict[tuple[Phase, Kind], Entry] = {
    (W, K.OLDER): _to(_older, W),
    (R, K.OLDER): _to(_older, R),
    (W, K.VACANT): _to(_vacant, W),
    (R, K.VACANT): _to(_released, W),
    (W, K.GRANTED): _to(_granted, R),
    (R, K.GRANTED): _to(_granted, R),
    (R, K.CURRENT): _to(_ignore, R),
    (R, K.HUNG): _to(_hung, W),
    (W, K.HUNG_ELSEWHERE): _to(_ignore, W),
    (R, K.HUNG_ELSEWHERE): _to(_ignore, R),
    (R, K.SERVED): _to(_served, R),
    (W, K.SERVED_ELSEWHERE): _to(_ignore, W),
    (R, K.SERVED_ELSEWHERE): _to(_ignore, R),
}


def _phase(s: FrontState, e: object) -> Phase:
    return s.phase


def step(s: FrontState, event: Event, now: float) -> Result:
    """Apply one event. Raises InvalidTransition (state unchanged) on a miss."""
    judged = kind(s, event)
    return machine.run_step(
        TRANSITIONS, _phase, s, event, now, kind_of=lambda _: judged, error=InvalidTransition
    )


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


# --------------------------------------------------- heartbeat judgement ----


@dataclass(frozen=True, slots=True)
class Watchdog:
    """The heartbeat check's bounds."""

    hang_after_s: float = 1.0  # a routed engine silent this long is hung
    check_s: float = 0.1  # the check runs this often
    # A check this much later than it was due means the front was not
    # scheduled either (CPU starvation, a VM pause): its silence proves nothing.
    stall_s: float = 0.25


class Beat(enum.Enum):
    ALIVE = "alive"  # its heartbeat is recent enough
    HUNG = "hung"  # silent past the limit, seen by a punctual check
    STALLED = "stalled"  # the check itself came late: no verdict on the engine
    UNKNOWN = "unknown"  # no heartbeat to read: no verdict


@dataclass(frozen=True, slots=True)
class Judged:
    beat: Beat
    late_s: float  # how much later than due the check ran
    silent_s: float  # since the engine's last heartbeat (0 when there is none)


def judge_beat(w: Watchdog, due: float, now: float, beat_at: float | None) -> Judged:
    """Judge the routed engine's heartbeat at ``now``, on a check that was due
    at ``due``; ``beat_at``: its last heartbeat (None: none to read). All times
    on the one clock the heartbeat is written with."""
    late = now - due
    if late > w.stall_s:
        return Judged(Beat.STALLED, late, 0.0)
    if beat_at is None:
        return Judged(Beat.UNKNOWN, late, 0.0)
    silent = now - beat_at
    return Judged(Beat.HUNG if silent > w.hang_after_s else Beat.ALIVE, late, silent)
