"""The engine's life: Init → Standby → Waking → Active (→ Draining) → Dead.

Sans-IO: ``step(state, event, now) -> (state, actions)``, the shape every core
shares (``understudy.wire.machine``). The main loop and the monitors feed
events; the core answers with the next state and the actions to carry out.
``TRANSITIONS`` is the one table: each (state, event type) names the handler
that computes the actions and the state it leads to; a pair that is not in it
raises ``InvalidTransition`` and changes nothing. The time budgets travel in
the state, so ``step`` needs nothing else.
There is no way back to Standby after Waking: a shadow is single-use, and a
dead engine is restarted as a new process (which re-arms as a standby).

Active is entered only after the wake *and* the serving endpoint are done
(``ServingReady``), never before: a liveness probe must not judge a healthy
but slow wake by the serving endpoint's health.

An Active engine that loses GMS (the GMS container died) does not die: its
mappings stay valid (memfd pages, imported VMM handles are reference-counted),
so it keeps serving and gives its allocations back to the restarted GMS
(``Readopt``), which re-commits them under the same layout; the standbys
remap that layout when their turn comes. Only if that fails does it exit.
A waking engine does the same: GMS reports a loss only for a session that
is mapped (``gms.client``), so its weights are in hand, and it goes on
waking while it gives them back; otherwise the restarted GMS would wait for
a cold load while the weights sat mapped in the engine taking over. An
engine in any other state still ends on ``GmsLost``.

``Terminate`` (SIGTERM: a pod deletion, a rollout, a node drain) ends an
engine that serves nothing at once; an Active engine drains first: it stops
taking requests (the front holds new ones for the next Active engine),
finishes the ones it has within its drain budget, and only then exits, which
releases the lock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace

from understudy.wire import machine
from understudy.wire.machine import Entry


class State(enum.Enum):
    INIT = "Init"
    STANDBY = "Standby"
    WAKING = "Waking"
    ACTIVE = "Active"
    DRAINING = "Draining"
    DEAD = "Dead"


# ---------------------------------------------------------------- events --


@dataclass(frozen=True, slots=True)
class InitDone:
    """Weights loaded or imported, then put to sleep."""


@dataclass(frozen=True, slots=True)
class InitTimeout:
    """The startup budget ran out before InitDone."""


@dataclass(frozen=True, slots=True)
class LockGranted:
    epoch: int


@dataclass(frozen=True, slots=True)
class WakeDone:
    """Weights remapped and working memory (KV cache) allocated."""


@dataclass(frozen=True, slots=True)
class ServingReady:
    """The serving endpoint is bound and answering."""


@dataclass(frozen=True, slots=True)
class WakeTimeout:
    """Waking lasted longer than the wake timeout."""


@dataclass(frozen=True, slots=True)
class LockLost:
    reason: str


@dataclass(frozen=True, slots=True)
class GmsLost:
    reason: str


@dataclass(frozen=True, slots=True)
class Readopted:
    """The restarted GMS took the engine's allocations back (same layout)."""


@dataclass(frozen=True, slots=True)
class ReadoptFailed:
    reason: str


@dataclass(frozen=True, slots=True)
class EpochReissued:
    """The restarted lock server had lost its record and re-granted this
    engine's lock under a new epoch: the engine keeps serving, fenced by it."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Terminate:
    """SIGTERM: finish what is in flight, take nothing new, exit."""


@dataclass(frozen=True, slots=True)
class Drained:
    """Every in-flight request finished (or the drain budget ran out)."""

    unfinished: int = 0


@dataclass(frozen=True, slots=True)
class Fatal:
    """Anything else that must end the process: an init error, a failed remap."""

    reason: str


Event = (
    InitDone
    | InitTimeout
    | LockGranted
    | WakeDone
    | ServingReady
    | WakeTimeout
    | LockLost
    | GmsLost
    | Readopted
    | ReadoptFailed
    | EpochReissued
    | Terminate
    | Drained
    | Fatal
)

# --------------------------------------------------------------- actions --


@dataclass(frozen=True, slots=True)
class Acquire:
    """Block on the pod's lock; the grant is the wake trigger (there is no wake call)."""


@dataclass(frozen=True, slots=True)
class Wake:
    """Remap the weights and allocate working memory, within ``deadline``."""

    deadline: float


@dataclass(frozen=True, slots=True)
class BindServing:
    """Bind the serving port: only now may this engine take traffic."""


@dataclass(frozen=True, slots=True)
class Readopt:
    """Give the weights' allocations back to the restarted GMS, within ``deadline``;
    report Readopted or ReadoptFailed. Serving goes on meanwhile."""

    deadline: float


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop accepting requests; report Drained when none is left or at ``deadline``."""

    deadline: float


@dataclass(frozen=True, slots=True)
class Exit:
    code: int
    reason: str
    state: State  # the state the engine died in, for the one exit log line


Action = Acquire | Wake | BindServing | Readopt | Drain | Exit


class ExitCode(enum.IntEnum):
    """Process exit codes of ``understudy engine run`` (README)."""

    DONE = 0  # terminated (SIGTERM), after draining when Active
    FATAL = 1  # init error, failed remap (timeout, stale layout, lost GMS), bind failure
    LOCK_LOST = 3
    GMS_LOST = 4
    WAKE_TIMEOUT = 5
    INIT_TIMEOUT = 6


class InvalidTransition(machine.InvalidTransition):
    """An event the engine's state does not take (a bug in the main loop)."""


# ----------------------------------------------------------------- state --


@dataclass(frozen=True, slots=True)
class Budgets:
    startup_s: float
    wake_s: float
    drain_s: float = 25.0


@dataclass(frozen=True, slots=True)
class EngineState:
    state: State
    since: float  # monotonic time the state was entered
    started: float  # process start (Init entered)
    budgets: Budgets
    epoch: int | None = None
    last_event: str = "start"
    readopting: bool = False  # Active, giving the weights back to a restarted GMS

    def time_in_state(self, now: float) -> float:
        return max(0.0, now - self.since)


def initial(now: float, budgets: Budgets) -> EngineState:
    return EngineState(State.INIT, since=now, started=now, budgets=budgets)


@dataclass(frozen=True, slots=True)
class Deadline:
    """A state's time limit: when it runs out, and the event the shell then feeds.

    ``at`` reads the budget from the state; ``expired`` builds the timeout
    event from what the shell knows at that moment (the requests still in
    flight, which only ``Drained`` reports)."""

    at: Callable[[EngineState], float]
    expired: Callable[[int], InitTimeout | WakeTimeout | Drained]


# The states with a time limit (a lookup, as the transition table is one).
# Init's budget runs from the process start, the others' from entering the state.
DEADLINES: dict[State, Deadline] = {
    State.INIT: Deadline(lambda s: s.started + s.budgets.startup_s, lambda inflight: InitTimeout()),
    State.WAKING: Deadline(lambda s: s.since + s.budgets.wake_s, lambda inflight: WakeTimeout()),
    State.DRAINING: Deadline(
        lambda s: s.since + s.budgets.drain_s, lambda inflight: Drained(unfinished=inflight)
    ),
}


def deadline(s: EngineState) -> float | None:
    """When the shell must feed ``expired(s, …)``, if the state has a deadline."""
    limit = DEADLINES.get(s.state)
    return None if limit is None else limit.at(s)


def expired(s: EngineState, inflight: int) -> Event:
    """The timeout event of the state's deadline (KeyError if it has none)."""
    return DEADLINES[s.state].expired(inflight)


# -------------------------------------------------------------- handlers --

Result = tuple[EngineState, list[Action]]


def _moved(s: EngineState, target: State, event: Event, now: float) -> EngineState:
    since = now if target is not s.state else s.since
    return replace(s, state=target, since=since, last_event=type(event).__name__)


def _init_done(s: EngineState, e: InitDone, now: float) -> Result:
    return _moved(s, State.STANDBY, e, now), [Acquire()]


def _lock_granted(s: EngineState, e: LockGranted, now: float) -> Result:
    new = replace(_moved(s, State.WAKING, e, now), epoch=e.epoch)
    return new, [Wake(deadline=now + s.budgets.wake_s)]


def _wake_done(s: EngineState, e: WakeDone, now: float) -> Result:
    return _moved(s, State.WAKING, e, now), [BindServing()]  # Active only once serving


def _serving_ready(s: EngineState, e: ServingReady, now: float) -> Result:
    return _moved(s, State.ACTIVE, e, now), []


def _init_timeout(s: EngineState, e: InitTimeout, now: float) -> Result:
    why = f"startup budget of {s.budgets.startup_s:g}s exceeded"
    return _moved(s, State.DEAD, e, now), [Exit(ExitCode.INIT_TIMEOUT, why, s.state)]


def _wake_timeout(s: EngineState, e: WakeTimeout, now: float) -> Result:
    why = f"wake took longer than {s.budgets.wake_s:g}s"
    return _moved(s, State.DEAD, e, now), [Exit(ExitCode.WAKE_TIMEOUT, why, s.state)]


def _reissued(s: EngineState, e: EpochReissued, now: float) -> Result:
    return replace(s, epoch=e.epoch, last_event=type(e).__name__), []


def _terminate(s: EngineState, e: Terminate, now: float) -> Result:
    return _moved(s, State.DEAD, e, now), [Exit(ExitCode.DONE, "terminated", s.state)]


def _drain(s: EngineState, e: Terminate, now: float) -> Result:
    return _moved(s, State.DRAINING, e, now), [Drain(deadline=now + s.budgets.drain_s)]


def _drained(s: EngineState, e: Drained, now: float) -> Result:
    why = "drained" if not e.unfinished else f"drain budget over, {e.unfinished} unfinished"
    return _moved(s, State.DEAD, e, now), [Exit(ExitCode.DONE, why, s.state)]


def _gms_lost_mapped(s: EngineState, e: GmsLost, now: float) -> Result:
    """Serve (or wake) on from the mappings; give them back to the next GMS (once)."""
    new = replace(s, readopting=True, last_event=type(e).__name__)
    if s.readopting:
        return new, []  # another device's session, lost in the same death
    return new, [Readopt(deadline=now + s.budgets.wake_s)]


def _readopted(s: EngineState, e: Readopted, now: float) -> Result:
    return replace(s, readopting=False, last_event=type(e).__name__), []


_DIE = {
    LockLost: ExitCode.LOCK_LOST,
    GmsLost: ExitCode.GMS_LOST,
    ReadoptFailed: ExitCode.GMS_LOST,
    Fatal: ExitCode.FATAL,
}


def _died(s: EngineState, e: LockLost | GmsLost | ReadoptFailed | Fatal, now: float) -> Result:
    return _moved(s, State.DEAD, e, now), [Exit(_DIE[type(e)], e.reason, s.state)]


# ----------------------------------------------------------------- table --

S = State
_DEAD = frozenset({S.DEAD})

# (state, event type) -> (handler, the state it leads to).
TRANSITIONS: dict[tuple[State, type], Entry[EngineState, Action, State]] = {
    (S.INIT, InitDone): Entry(_init_done, frozenset({S.STANDBY})),
    (S.INIT, InitTimeout): Entry(_init_timeout, _DEAD),
    (S.INIT, Fatal): Entry(_died, _DEAD),
    (S.INIT, GmsLost): Entry(_died, _DEAD),
    (S.STANDBY, LockGranted): Entry(_lock_granted, frozenset({S.WAKING})),
    (S.STANDBY, Fatal): Entry(_died, _DEAD),
    (S.WAKING, WakeDone): Entry(_wake_done, frozenset({S.WAKING})),
    (S.WAKING, ServingReady): Entry(_serving_ready, frozenset({S.ACTIVE})),
    (S.WAKING, WakeTimeout): Entry(_wake_timeout, _DEAD),
    (S.WAKING, LockLost): Entry(_died, _DEAD),
    (S.WAKING, GmsLost): Entry(_gms_lost_mapped, frozenset({S.WAKING})),
    (S.WAKING, Readopted): Entry(_readopted, frozenset({S.WAKING})),
    (S.WAKING, ReadoptFailed): Entry(_died, _DEAD),
    (S.WAKING, Fatal): Entry(_died, _DEAD),
    (S.ACTIVE, LockLost): Entry(_died, _DEAD),
    (S.ACTIVE, GmsLost): Entry(_gms_lost_mapped, frozenset({S.ACTIVE})),
    (S.ACTIVE, Readopted): Entry(_readopted, frozenset({S.ACTIVE})),
    (S.ACTIVE, ReadoptFailed): Entry(_died, _DEAD),
    (S.ACTIVE, Fatal): Entry(_died, _DEAD),
    (S.WAKING, EpochReissued): Entry(_reissued, frozenset({S.WAKING})),
    (S.ACTIVE, EpochReissued): Entry(_reissued, frozenset({S.ACTIVE})),
    (S.DRAINING, EpochReissued): Entry(_reissued, frozenset({S.DRAINING})),
    (S.INIT, Terminate): Entry(_terminate, _DEAD),
    (S.STANDBY, Terminate): Entry(_terminate, _DEAD),
    (S.WAKING, Terminate): Entry(_terminate, _DEAD),
    (S.ACTIVE, Terminate): Entry(_drain, frozenset({S.DRAINING})),
    (S.DRAINING, Drained): Entry(_drained, _DEAD),
    (S.DRAINING, LockLost): Entry(_died, _DEAD),
    (S.DRAINING, GmsLost): Entry(_died, _DEAD),
    # A drain that began while the weights were being given back.
    (S.DRAINING, Readopted): Entry(_readopted, frozenset({S.DRAINING})),
    (S.DRAINING, ReadoptFailed): Entry(_died, _DEAD),
    (S.DRAINING, Fatal): Entry(_died, _DEAD),
}


def _state_of(s: EngineState, event: Event) -> State:
    return s.state


def step(s: EngineState, event: Event, now: float) -> Result:
    """Apply one event at ``now``. Raises InvalidTransition (state unchanged) on a miss."""
    return machine.run_step(TRANSITIONS, _state_of, s, event, now, error=InvalidTransition)
