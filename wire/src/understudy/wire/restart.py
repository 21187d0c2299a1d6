"""When a container's process is started again: the restart policy (pure).

``understudy respawn`` (``understudy.wire.respawn``) runs a component's
process as the child of a tiny PID 1 and restarts it in place when it dies,
so a death costs a process start instead of kubelet's CrashLoopBackOff
(10 s, doubling to 5 min, for the second death within 10 minutes). This
module decides *when*; the shell forks, waits and forwards signals.

A child that said it started (``Ready``: an engine that reached Standby, a
front that listens) and then died is restarted at once: it proved it can
start, its death was a fault of the running process (a crash, a kill, a lost
lock), and the pod is unarmed until it is back. A child that died before it
said so failed to *start*: that is a configuration or environment problem a
restart rarely cures, so it is backed off (``Policy``: 1 s, then 2 s, …), and
after ``give_up_after`` failures in a row the respawner exits with the
child's code, which hands the container to kubelet: its CrashLoopBackOff is
what a user's tooling watches for a container that cannot start.

``TRANSITIONS`` is the one table (``understudy.wire.machine``). Time is a
parameter: ``BackoffOver`` is fed by the shell at the deadline of ``ArmTimer``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from understudy.wire import machine
from understudy.wire.machine import Entry


class Phase(enum.Enum):
    STARTING = "starting"  # a child runs and has not said it started
    RUNNING = "running"  # the child said it started
    BACKOFF = "backoff"  # the last child failed to start; the next one waits
    STOPPING = "stopping"  # asked to stop: the child has the signal, we wait for it
    DONE = "done"  # the respawner exits


@dataclass(frozen=True, slots=True)
class Policy:
    """Back-off for a child that fails to start; none for one that started."""

    initial_s: float = 1.0
    max_s: float = 8.0
    give_up_after: int = 3  # start failures in a row; then exit, kubelet takes over

    def delay(self, failures: int) -> float:
        """The wait before the next start after ``failures`` failures in a row."""
        return float(min(self.max_s, self.initial_s * 2 ** max(0, failures - 1)))


@dataclass(frozen=True, slots=True)
class RestartState:
    phase: Phase
    policy: Policy
    since: float  # when the phase was entered
    starts: int = 1  # children started so far
    failures: int = 0  # start failures in a row
    deadline: float | None = None  # BACKOFF: when the next start is due
    last_code: int | None = None

    @property
    def restarts(self) -> int:
        return self.starts - 1


# ---------------------------------------------------------------- events --


@dataclass(frozen=True, slots=True)
class Ready:
    """The child said it started (one notification per child)."""


@dataclass(frozen=True, slots=True)
class Exited:
    """The child ended: its exit code, or 128 + the signal that killed it."""

    code: int


@dataclass(frozen=True, slots=True)
class BackoffOver:
    """The back-off's deadline passed."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The respawner got a stop signal (SIGTERM, SIGINT): pass it on, then exit."""

    signal: int


Event = Ready | Exited | BackoffOver | Stop

# --------------------------------------------------------------- actions --


@dataclass(frozen=True, slots=True)
class Start:
    """Start the child; ``restarts`` is how many came before it."""

    restarts: int


@dataclass(frozen=True, slots=True)
class Signal:
    """Send ``signal`` to the child."""

    signal: int


@dataclass(frozen=True, slots=True)
class ArmTimer:
    deadline: float


@dataclass(frozen=True, slots=True)
class Exit:
    """The respawner ends with ``code``."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class Note:
    """A decision worth a log line."""

    event: str
    fields: tuple[tuple[str, Any], ...] = ()


Action = Start | Signal | ArmTimer | Exit | Note
Result = tuple[RestartState, list[Action]]


class InvalidTransition(machine.InvalidTransition):
    """An event the phase does not take (a bug in the shell)."""


def initial(now: float, policy: Policy) -> Result:
    """The first child starts at once."""
    return RestartState(Phase.STARTING, policy, since=now), [Start(0)]


# -------------------------------------------------------------- handlers --


def _moved(s: RestartState, phase: Phase, now: float, **changes: Any) -> RestartState:
    return replace(s, phase=phase, since=now, **changes)


def _ready(s: RestartState, e: Ready, now: float) -> Result:
    new = _moved(s, Phase.RUNNING, now, failures=0)
    return new, [Note("child_ready", (("after_s", round(now - s.since, 3)),))]


def _died(s: RestartState, e: Exited, now: float) -> Result:
    """It had started: restart at once."""
    new = _moved(s, Phase.STARTING, now, starts=s.starts + 1, last_code=e.code)
    note = Note("restart", (("code", e.code), ("ran_s", round(now - s.since, 3))))
    return new, [note, Start(new.restarts)]


def _failed_to_start(s: RestartState, e: Exited, now: float) -> Result:
    failures = s.failures + 1
    if failures >= s.policy.give_up_after:
        why = f"failed to start {failures} times in a row, last code {e.code}"
        new = _moved(s, Phase.DONE, now, failures=failures, last_code=e.code)
        return new, [Exit(e.code or 1, why)]
    delay = s.policy.delay(failures)
    new = _moved(s, Phase.BACKOFF, now, failures=failures, deadline=now + delay, last_code=e.code)
    note = Note("backoff", (("code", e.code), ("failures", failures), ("delay_s", delay)))
    return new, [note, ArmTimer(now + delay)]


def _backoff_over(s: RestartState, e: BackoffOver, now: float) -> Result:
    new = _moved(s, Phase.STARTING, now, starts=s.starts + 1, deadline=None)
    return new, [Start(new.restarts)]


def _stop(s: RestartState, e: Stop, now: float) -> Result:
    return _moved(s, Phase.STOPPING, now), [Signal(e.signal)]


def _stop_again(s: RestartState, e: Stop, now: float) -> Result:
    return s, [Signal(e.signal)]  # a second signal goes on too (SIGINT twice, say)


def _stop_idle(s: RestartState, e: Stop, now: float) -> Result:
    return _moved(s, Phase.DONE, now, deadline=None), [Exit(0, "stopped while backing off")]


def _stopped(s: RestartState, e: Exited, now: float) -> Result:
    new = _moved(s, Phase.DONE, now, last_code=e.code)
    return new, [Exit(e.code, "stopped")]


def _ignore(s: RestartState, e: Ready, now: float) -> Result:
    return s, []  # it started while being stopped: too late to matter


# ----------------------------------------------------------------- table --

P = Phase

TRANSITIONS: dict[tuple[Phase, type], Entry[RestartState, Action, Phase]] = {
    (P.STARTING, Ready): Entry(_ready, frozenset({P.RUNNING})),
    (P.STARTING, Exited): Entry(_failed_to_start, frozenset({P.BACKOFF, P.DONE})),
    (P.STARTING, Stop): Entry(_stop, frozenset({P.STOPPING})),
    (P.RUNNING, Exited): Entry(_died, frozenset({P.STARTING})),
    (P.RUNNING, Stop): Entry(_stop, frozenset({P.STOPPING})),
    (P.BACKOFF, BackoffOver): Entry(_backoff_over, frozenset({P.STARTING})),
    (P.BACKOFF, Stop): Entry(_stop_idle, frozenset({P.DONE})),
    (P.STOPPING, Exited): Entry(_stopped, frozenset({P.DONE})),
    (P.STOPPING, Stop): Entry(_stop_again, frozenset({P.STOPPING})),
    (P.STOPPING, Ready): Entry(_ignore, frozenset({P.STOPPING})),
}


def _phase(s: RestartState, event: Event) -> Phase:
    return s.phase


def step(s: RestartState, event: Event, now: float) -> Result:
    """Apply one event. Raises InvalidTransition (state unchanged) on a miss."""
    return machine.run_step(TRANSITIONS, _phase, s, event, now, error=InvalidTransition)
