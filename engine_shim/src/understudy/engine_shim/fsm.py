"""The engine's life: Init → Standby → Waking → Active → Dead (seed 002, Decision 2).

Sans-IO. The main loop and the monitors feed events; the core answers with
the next state and the actions to carry out. ``TRANSITIONS`` is the one table:
a pair that is not in it raises ``InvalidTransition`` and changes nothing.
There is no way back to Standby after Waking: a shadow is single-use, and a
dead engine is restarted as a new process (which re-arms as a standby).

Active is entered only after the wake *and* the serving endpoint are done
(``ServingReady``), never before: a liveness probe must not judge a healthy
but slow wake by the serving endpoint's health.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import assert_never


class State(enum.Enum):
    INIT = "Init"
    STANDBY = "Standby"
    WAKING = "Waking"
    ACTIVE = "Active"
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
    | Fatal
)

# --------------------------------------------------------------- actions --


@dataclass(frozen=True, slots=True)
class Acquire:
    """Block on the pod's lock; the grant is the wake trigger (Decision 4)."""


@dataclass(frozen=True, slots=True)
class Wake:
    """Remap the weights and allocate working memory, within ``deadline``."""

    deadline: float


@dataclass(frozen=True, slots=True)
class BindServing:
    """Bind the serving port: only now may this engine take traffic."""


@dataclass(frozen=True, slots=True)
class Exit:
    code: int
    reason: str
    state: State  # the state the engine died in, for the one exit log line


Action = Acquire | Wake | BindServing | Exit


class ExitCode(enum.IntEnum):
    """Process exit codes of ``understudy engine run`` (README)."""

    FATAL = 1  # init error, failed remap (timeout, stale layout, lost GMS), bind failure
    LOCK_LOST = 3
    GMS_LOST = 4
    WAKE_TIMEOUT = 5
    INIT_TIMEOUT = 6


class InvalidTransition(Exception):
    pass


# ----------------------------------------------------------------- state --


@dataclass(frozen=True, slots=True)
class Budgets:
    startup_s: float
    wake_s: float


@dataclass(frozen=True, slots=True)
class EngineState:
    state: State
    since: float  # monotonic time the state was entered
    started: float  # process start (Init entered)
    epoch: int | None = None
    last_event: str = "start"

    def time_in_state(self, now: float) -> float:
        return max(0.0, now - self.since)


def initial(now: float) -> EngineState:
    return EngineState(State.INIT, since=now, started=now)


def deadline(s: EngineState, budgets: Budgets) -> float | None:
    """When the shell must feed a timeout event, if the state has a deadline."""
    if s.state is State.INIT:
        return s.started + budgets.startup_s
    if s.state is State.WAKING:
        return s.since + budgets.wake_s
    return None


# ----------------------------------------------------------------- table --

S = State
_DIE = {LockLost: ExitCode.LOCK_LOST, GmsLost: ExitCode.GMS_LOST, Fatal: ExitCode.FATAL}

# (state, event type) -> next state. Action choice is below, by event type.
TRANSITIONS: dict[tuple[State, type], State] = {
    (S.INIT, InitDone): S.STANDBY,
    (S.INIT, InitTimeout): S.DEAD,
    (S.INIT, Fatal): S.DEAD,
    (S.INIT, GmsLost): S.DEAD,
    (S.STANDBY, LockGranted): S.WAKING,
    (S.STANDBY, Fatal): S.DEAD,
    (S.WAKING, WakeDone): S.WAKING,
    (S.WAKING, ServingReady): S.ACTIVE,
    (S.WAKING, WakeTimeout): S.DEAD,
    (S.WAKING, LockLost): S.DEAD,
    (S.WAKING, GmsLost): S.DEAD,
    (S.WAKING, Fatal): S.DEAD,
    (S.ACTIVE, LockLost): S.DEAD,
    (S.ACTIVE, GmsLost): S.DEAD,
    (S.ACTIVE, Fatal): S.DEAD,
}


def _actions(s: EngineState, event: Event, now: float, budgets: Budgets) -> list[Action]:
    match event:
        case InitDone():
            return [Acquire()]
        case LockGranted():
            return [Wake(deadline=now + budgets.wake_s)]
        case WakeDone():
            return [BindServing()]
        case ServingReady():
            return []
        case InitTimeout():
            why = f"startup budget of {budgets.startup_s:g}s exceeded"
            return [Exit(ExitCode.INIT_TIMEOUT, why, s.state)]
        case WakeTimeout():
            why = f"wake took longer than {budgets.wake_s:g}s"
            return [Exit(ExitCode.WAKE_TIMEOUT, why, s.state)]
        case LockLost(reason=reason) | GmsLost(reason=reason) | Fatal(reason=reason):
            return [Exit(_DIE[type(event)], reason, s.state)]
        case _:
            assert_never(event)


def step(
    s: EngineState, event: Event, now: float, budgets: Budgets
) -> tuple[EngineState, list[Action]]:
    target = TRANSITIONS.get((s.state, type(event)))
    if target is None:
        raise InvalidTransition(f"{type(event).__name__} in {s.state.value}")
    actions = _actions(s, event, now, budgets)
    epoch = event.epoch if isinstance(event, LockGranted) else s.epoch
    since = now if target is not s.state else s.since
    return replace(
        s, state=target, since=since, epoch=epoch, last_event=type(event).__name__
    ), actions
