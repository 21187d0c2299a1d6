"""The front door's decision core: where requests go, and what a failed one does next.

Four pure parts, all with time passed in:

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
  itself was not scheduled (a stall of the whole machine);
- **poison isolation** (``isolate``, one ``ISOLATION`` table, and
  ``may_send``): which requests are suspects of the engines' deaths, which
  one runs alone, and which one is the poison (docs/poison.md).

The shells feed lock events, heartbeat times and attempt outcomes and carry
out what comes back (``router``: the routing machine and the heartbeat;
``forwarder``: the verdicts); they make no decision of their own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
    # Its engine died while it ran alone (``isolate``): the request is the poison.
    poison: bool = False


@dataclass(frozen=True, slots=True)
class Policy:
    hold_s: float = 30.0
    # The last guard, under poison isolation: a request whose engines died
    # more often than this fails, whoever is to blame. Isolation names a
    # poison at its third death; an innocent one moves at most twice, and
    # once more for each turn alone sent to an engine already dead.
    migration_limit: int = 8


class Verdict(enum.Enum):
    RELAY = "relay"  # give the engine's answer to the client as it is
    WAIT = "wait"  # wait for an Active engine (or a new one), then send again
    MIGRATE_NEW = "new"  # send the whole request to the next Active engine
    MIGRATE_ONGOING = "ongoing"  # continue the stream on the next Active engine
    FAIL = "fail"  # tell the client: nothing more can be done within its limits
    POISON = "poison"  # tell the client: this request kills the engines that run it


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
            if attempt.poison:
                return Verdict.POISON
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
    # A silent engine whose process still burns CPU is starved of its event
    # loop (another thread holds the GIL, its cgroup loses to a restarting
    # engine's imports), not stopped: it is given this long. A spinning hang
    # (a CUDA sync that never returns) is caught here too, only later.
    working_hang_after_s: float = 5.0


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


def judge_beat(
    w: Watchdog, due: float, now: float, beat_at: float | None, *, working: bool = False
) -> Judged:
    """Judge the routed engine's heartbeat at ``now``, on a check that was due
    at ``due``; ``beat_at``: its last heartbeat (None: none to read); ``working``:
    its process used CPU lately (``cpu_progressed``). All times on the one
    clock the heartbeat is written with."""
    late = now - due
    if late > w.stall_s:
        return Judged(Beat.STALLED, late, 0.0)
    if beat_at is None:
        return Judged(Beat.UNKNOWN, late, 0.0)
    silent = now - beat_at
    limit = max(w.hang_after_s, w.working_hang_after_s) if working else w.hang_after_s
    return Judged(Beat.HUNG if silent > limit else Beat.ALIVE, late, silent)


# How far back ``cpu_progressed`` looks: short enough that a process stopped
# a heartbeat limit ago shows none, long enough that a starved one shows some.
CPU_WINDOW_S = 0.5


def cpu_progressed(samples: Sequence[tuple[float, int]], now: float) -> bool:
    """Whether a process used CPU over the last ``CPU_WINDOW_S``, from its
    ``(time, CPU ticks)`` samples (times rising). False until the samples span
    the window: no evidence of work is no reprieve."""
    if not samples:
        return False
    base = [ticks for at, ticks in samples if at <= now - CPU_WINDOW_S]
    return bool(base) and samples[-1][1] > base[-1]


# ----------------------------------------------------- poison isolation ----
#
# Blame needs evidence (docs/poison.md). A request in flight when its engine
# dies is a suspect, not a culprit: when faults stack (an engine killed, then
# the one that took over), innocent requests die twice too. After its second
# death a suspect runs alone; if an engine dies running only it, it is the
# poison, and only it is told. One that completes alone is cleared.
#
# Requests are keys chosen by the shell. The machine holds only the requests
# that died at least once, so the shell feeds it nothing on the path a
# request takes when no engine dies.


class Isolation(enum.Enum):
    OPEN = "open"  # no suspect waits to run alone: every request may go
    # A suspect is next to run alone: nothing else goes; it goes once no
    # request is out at an engine (those already out finish first).
    CLEARING = "clearing"
    ALONE = "alone"  # the suspect is out, alone: nothing else goes


@dataclass(frozen=True, slots=True)
class Suspects:
    phase: Isolation = Isolation.OPEN
    # request -> the engines that died while it was out at them. One engine's
    # death counts once: a request sent again to it before the lock named the
    # next one breaks there again, which is no second death.
    deaths: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    waiting: tuple[int, ...] = ()  # suspects waiting for their turn alone, oldest first
    alone: int | None = None  # the suspect whose turn it is (CLEARING, ALONE)
    # Engines seen dying (the latest few): a suspect sent alone to one of
    # them went to an engine dead before it (the route had not moved yet),
    # and its break there is no evidence against it.
    dead: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Died:
    """An engine died while this request was out at it (its attempt broke)."""

    request: int
    engine: str = ""  # the engine it was out at


@dataclass(frozen=True, slots=True)
class Sent:
    """The suspect whose turn it is went out, alone."""

    request: int


@dataclass(frozen=True, slots=True)
class Returned:
    """The suspect's attempt ended without running (refused, unreachable)."""

    request: int


@dataclass(frozen=True, slots=True)
class Finished:
    """A request that died at least once ended, however it ended."""

    request: int


IsolationEvent = Died | Sent | Returned | Finished


@dataclass(frozen=True, slots=True)
class Suspected:
    request: int
    deaths: int


@dataclass(frozen=True, slots=True)
class RunAlone:
    request: int  # its turn: nothing else goes until it ends


@dataclass(frozen=True, slots=True)
class Poisoned:
    request: int
    deaths: int  # its engines' deaths, the last one with it alone


@dataclass(frozen=True, slots=True)
class Cleared:
    request: int  # ran alone and ended without a death


IsolationAction = Suspected | RunAlone | Poisoned | Cleared


class InvalidIsolation(machine.InvalidTransition):
    """An event the isolation's phase does not accept (a bug in the shell)."""


class Blame(enum.Enum):
    """What an event means for the isolation (``blame``): the table's second key."""

    FIRST = "Died (first death)"
    SUSPECT = "Died (second death, or later while not alone)"
    ALONE_DIED = "Died (alone)"
    ALONE_MISSED = "Died (alone, at an engine already dead)"
    REPEAT = "Died (again, at the same engine)"
    ALONE_SENT = "Sent (its turn)"
    ALONE_RETURNED = "Returned (never ran)"
    ALONE_ENDED = "Finished (its turn)"
    ENDED = "Finished (not its turn)"
    # Sent or Returned by a request whose turn it is not: in no phase (a
    # shell that let it out broke the isolation).
    OUT_OF_TURN = "Sent or Returned (not its turn)"


def blame(s: Suspects, e: IsolationEvent) -> Blame:
    """Judge an isolation event against the state (pure; the table does the rest)."""
    match e:
        case Died(request=r, engine=engine):
            if r == s.alone and s.phase is Isolation.ALONE:
                return Blame.ALONE_MISSED if engine and engine in s.dead else Blame.ALONE_DIED
            seen = s.deaths.get(r, ())
            if engine and engine in seen:
                return Blame.REPEAT
            return Blame.SUSPECT if seen else Blame.FIRST
        case Sent(request=r):
            return Blame.ALONE_SENT if r == s.alone else Blame.OUT_OF_TURN
        case Returned(request=r):
            return Blame.ALONE_RETURNED if r == s.alone else Blame.OUT_OF_TURN
        case Finished(request=r):
            return Blame.ALONE_ENDED if r == s.alone else Blame.ENDED
        case _:
            assert_never(e)


IsoResult = tuple[Suspects, list[IsolationAction]]


def _next_turn(s: Suspects, actions: list[IsolationAction]) -> IsoResult:
    """Give the turn to the oldest waiting suspect, if any; else open."""
    if not s.waiting:
        return replace(s, phase=Isolation.OPEN, alone=None), actions
    first, *rest = s.waiting
    new = replace(s, phase=Isolation.CLEARING, alone=first, waiting=tuple(rest))
    return new, [*actions, RunAlone(first)]


_DEAD_KEPT = 8  # engines remembered dead: more than die within one suspect's turn


def _seen_dying(s: Suspects, e: Died) -> Suspects:
    if not e.engine or e.engine in s.dead:
        return s
    return replace(s, dead=(*s.dead, e.engine)[-_DEAD_KEPT:])


def _forget(s: Suspects, r: int) -> Suspects:
    deaths = {k: v for k, v in s.deaths.items() if k != r}
    return replace(s, deaths=deaths, waiting=tuple(w for w in s.waiting if w != r))


def _first_death(s: Suspects, e: Died, now: float) -> IsoResult:
    s = _seen_dying(s, e)
    return replace(s, deaths={**s.deaths, e.request: (e.engine,)}), [Suspected(e.request, 1)]


def _suspect(s: Suspects, e: Died, now: float) -> IsoResult:
    engines = (*s.deaths[e.request], e.engine)
    n = len(engines)
    s = replace(_seen_dying(s, e), deaths={**s.deaths, e.request: engines})
    actions: list[IsolationAction] = [Suspected(e.request, n)]
    if e.request == s.alone or e.request in s.waiting:
        return s, actions  # its turn is already given or queued
    s = replace(s, waiting=(*s.waiting, e.request))
    if s.phase is Isolation.OPEN:
        return _next_turn(s, actions)
    return s, actions


def _alone_died(s: Suspects, e: Died, now: float) -> IsoResult:
    n = len(s.deaths.get(e.request, ())) + 1
    return _next_turn(_forget(_seen_dying(s, e), e.request), [Poisoned(e.request, n)])


def _alone_missed(s: Suspects, e: Died, now: float) -> IsoResult:
    # Sent alone to an engine whose death others had reported already: it
    # never ran alone. No death counted; the turn stays its own.
    return replace(s, phase=Isolation.CLEARING), []


def _alone_sent(s: Suspects, e: Sent, now: float) -> IsoResult:
    return replace(s, phase=Isolation.ALONE), []


def _alone_returned(s: Suspects, e: Returned, now: float) -> IsoResult:
    # It never ran: the turn stays its own, for its next attempt.
    return replace(s, phase=Isolation.CLEARING), []


def _alone_ended(s: Suspects, e: Finished, now: float) -> IsoResult:
    # Out alone and ended without a death (answered, or its client left):
    # cleared. Still waiting for its turn (its hold ran out): just gone.
    actions: list[IsolationAction] = [Cleared(e.request)] if s.phase is Isolation.ALONE else []
    return _next_turn(_forget(s, e.request), actions)


def _repeat(s: Suspects, e: Died, now: float) -> IsoResult:
    return s, []


def _ended(s: Suspects, e: Finished, now: float) -> IsoResult:
    return _forget(s, e.request), []


OP, CL, AL = Isolation.OPEN, Isolation.CLEARING, Isolation.ALONE
IsoEntry = machine.Entry[Suspects, IsolationAction, Isolation]


def _into(handler: Callable[[Suspects, Any, float], IsoResult], *phases: Isolation) -> IsoEntry:
    return machine.Entry(handler, frozenset(phases))


# (phase, blame) -> (handler, the phases it may lead to). While a suspect
# runs alone nothing else is out, so no other request can die then.
ISOLATION: dict[tuple[Isolation, Blame], IsoEntry] = {
    (OP, Blame.FIRST): _into(_first_death, OP),
    (CL, Blame.FIRST): _into(_first_death, CL),
    (OP, Blame.SUSPECT): _into(_suspect, CL),
    (CL, Blame.SUSPECT): _into(_suspect, CL),
    (AL, Blame.ALONE_DIED): _into(_alone_died, OP, CL),
    (AL, Blame.ALONE_MISSED): _into(_alone_missed, CL),
    (OP, Blame.REPEAT): _into(_repeat, OP),
    (CL, Blame.REPEAT): _into(_repeat, CL),
    (CL, Blame.ALONE_SENT): _into(_alone_sent, AL),
    (AL, Blame.ALONE_RETURNED): _into(_alone_returned, CL),
    (CL, Blame.ALONE_ENDED): _into(_alone_ended, OP, CL),
    (AL, Blame.ALONE_ENDED): _into(_alone_ended, OP, CL),
    (OP, Blame.ENDED): _into(_ended, OP),
    (CL, Blame.ENDED): _into(_ended, CL),
    (AL, Blame.ENDED): _into(_ended, AL),  # a suspect waiting its turn gave up
}


def isolate(s: Suspects, event: IsolationEvent, now: float) -> IsoResult:
    """Apply one isolation event. Raises InvalidIsolation (state unchanged) on a miss."""
    judged = blame(s, event)
    return machine.run_step(
        ISOLATION, lambda st, _: st.phase, s, event, now,
        kind_of=lambda _: judged, error=InvalidIsolation,
    )  # fmt: skip


# A suspect's turn alone waits until the route has stood this long: an
# engine that took over and dies at once (a fault stacked on the failover,
# the cluster's takeover-kill) is not a trial of the suspect.
TRUSTED_AFTER_S = 0.5


def may_send(s: Suspects, request: int, out: int, routed_for: float) -> bool:
    """May ``request`` go to an engine now, with ``out`` requests out at one
    and the route standing for ``routed_for`` seconds? Anything while no
    suspect waits; on a suspect's turn, only it, once nothing else is out
    and the route has stood ``TRUSTED_AFTER_S``."""
    match s.phase:
        case Isolation.OPEN:
            return True
        case Isolation.CLEARING:
            return request == s.alone and out == 0 and routed_for >= TRUSTED_AFTER_S
        case Isolation.ALONE:
            return False
        case _:
            assert_never(s.phase)
