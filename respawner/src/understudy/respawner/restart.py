"""When a container's process is started again: the restart policy (pure).

``understudy respawn`` (``understudy.respawner.shell``) runs a component's
process as the child of a tiny PID 1 and restarts it in place when it dies,
so a death costs a process start instead of kubelet's CrashLoopBackOff
(10 s, doubling to 5 min, for the second death within 10 minutes). This
module decides *when*; the shell forks, waits and forwards signals.

A child that said it started (``Ready``: an engine that reached Standby, a
front that listens) and then died is restarted at once: it proved it can
start, its death was a fault of the running process (a crash, a kill, a lost
lock), and the pod is unarmed until it is back. A child that died before it
said so failed to *start*. If no child of this respawner ever started, the
container cannot start at all (a bad model path, a broken config): the
respawner exits with the child's code at once, and the container is
kubelet's, whose CrashLoopBackOff is what a user's tooling watches for that.
If one did, the failure is more likely passing (the pod's state changed
under it): it is backed off (``Policy``: 1 s, then 2 s, …), and after
``give_up_after`` failures in a row the respawner exits all the same.

With ``Policy.spare``, the next process is started ahead of time: once the
child has started, a *spare* runs the slow, harmless part of a start (an
engine's imports: seconds of CPU, a minute for vLLM), then waits for its
turn without touching anything shared (no port, no lock, no GMS session).
When the child dies the spare is told to go on (``Go``), so the restart
costs only the part of a start that needs the pod, and a new spare is
started once the promoted one has started in turn. A spare that dies is not
replaced until the next child has started.

A spare (``Policy.spare``: the next process started ahead of time, its
imports done, waiting for its turn) is started ``spare_after_s`` after the
child said it started, not at once: on two cores, a spare importing for a
second of CPU while the pod is in a failover (the death that promoted the
last spare hands the lock to another engine at that very moment) made the
failover's gap up to five times longer in a drill. Deaths that come faster
than that find no spare and start cold, which is still a start in place.

``TRANSITIONS`` is the one table (``understudy.wire.machine``). Time is a
parameter: ``TimerFired`` is fed by the shell at the deadline of ``ArmTimer``
(in BACKOFF the next start is due; in RUNNING the spare is).
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
    spare: bool = False  # keep the next process started ahead of time
    spare_after_s: float = 5.0  # after the child said it started (module docstring)

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
    deadline: float | None = None  # BACKOFF: the next start is due; RUNNING: the spare
    last_code: int | None = None
    spare: bool = False  # a spare process is running (waiting for its turn)
    ever_ready: bool = False  # some child of this respawner said it started

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
class SpareExited:
    """The spare ended before its turn (or was stopped)."""

    code: int


@dataclass(frozen=True, slots=True)
class TimerFired:
    """The state's deadline passed (``ArmTimer``)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The respawner got a stop signal (SIGTERM, SIGINT): pass it on, then exit."""

    signal: int


Event = Ready | Exited | SpareExited | TimerFired | Stop

# --------------------------------------------------------------- actions --


@dataclass(frozen=True, slots=True)
class Start:
    """Start the child; ``restarts`` is how many came before it."""

    restarts: int


@dataclass(frozen=True, slots=True)
class StartSpare:
    """Start a spare: it prepares, then waits for ``Go``."""


@dataclass(frozen=True, slots=True)
class Go:
    """The spare becomes the child; ``restarts`` is how many came before it."""

    restarts: int


@dataclass(frozen=True, slots=True)
class StopSpare:
    """End the spare (it holds nothing shared: SIGKILL is enough)."""


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


Action = Start | StartSpare | Go | StopSpare | Signal | ArmTimer | Exit | Note
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
    new = _moved(s, Phase.RUNNING, now, failures=0, ever_ready=True)
    actions: list[Action] = [Note("child_ready", (("after_s", round(now - s.since, 3)),))]
    if s.policy.spare and not s.spare:
        if s.policy.spare_after_s <= 0:
            return replace(new, spare=True), [*actions, StartSpare()]
        due = now + s.policy.spare_after_s
        return replace(new, deadline=due), [*actions, ArmTimer(due)]
    return new, actions


def _spare_due(s: RestartState, e: TimerFired, now: float) -> Result:
    if s.spare or s.deadline is None or now < s.deadline:
        return s, []  # stale, or early: the shell asks again at the deadline
    return replace(s, spare=True, deadline=None), [StartSpare()]


def _died(s: RestartState, e: Exited, now: float) -> Result:
    """It had started: restart at once (the spare goes on, if there is one)."""
    go = Go(s.restarts + 1) if s.spare else Start(s.restarts + 1)
    new = _moved(
        s, Phase.STARTING, now, starts=s.starts + 1, last_code=e.code, spare=False, deadline=None
    )
    fields = (("code", e.code), ("ran_s", round(now - s.since, 3)), ("spare", s.spare))
    return new, [Note("restart", fields), go]


def _spare_gone(s: RestartState, e: SpareExited, now: float) -> Result:
    """Not replaced now: a spare that cannot prepare must not loop; the next
    child's start starts the next spare."""
    note = Note("spare_exited", (("code", e.code),))
    return replace(s, spare=False), ([] if s.phase is Phase.STOPPING else [note])


def _failed_to_start(s: RestartState, e: Exited, now: float) -> Result:
    failures = s.failures + 1
    if failures >= s.policy.give_up_after or not s.ever_ready:
        why = (
            f"failed to start {failures} times in a row, last code {e.code}"
            if s.ever_ready
            else f"the first process never started (code {e.code}): the container's to restart"
        )
        new = _moved(s, Phase.DONE, now, failures=failures, last_code=e.code, spare=False)
        return new, [*([StopSpare()] if s.spare else []), Exit(e.code or 1, why)]
    delay = s.policy.delay(failures)
    new = _moved(s, Phase.BACKOFF, now, failures=failures, deadline=now + delay, last_code=e.code)
    note = Note("backoff", (("code", e.code), ("failures", failures), ("delay_s", delay)))
    return new, [note, ArmTimer(now + delay)]


def _backoff_over(s: RestartState, e: TimerFired, now: float) -> Result:
    go = Go(s.restarts + 1) if s.spare else Start(s.restarts + 1)
    new = _moved(s, Phase.STARTING, now, starts=s.starts + 1, deadline=None, spare=False)
    return new, [go]


def _stop(s: RestartState, e: Stop, now: float) -> Result:
    stop_spare: list[Action] = [StopSpare()] if s.spare else []
    return _moved(s, Phase.STOPPING, now, deadline=None), [*stop_spare, Signal(e.signal)]


def _stop_again(s: RestartState, e: Stop, now: float) -> Result:
    return s, [Signal(e.signal)]  # a second signal goes on too (SIGINT twice, say)


def _stop_idle(s: RestartState, e: Stop, now: float) -> Result:
    stop_spare: list[Action] = [StopSpare()] if s.spare else []
    new = _moved(s, Phase.DONE, now, deadline=None, spare=False)
    return new, [*stop_spare, Exit(0, "stopped while backing off")]


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
    (P.RUNNING, TimerFired): Entry(_spare_due, frozenset({P.RUNNING})),
    (P.BACKOFF, TimerFired): Entry(_backoff_over, frozenset({P.STARTING})),
    (P.BACKOFF, Stop): Entry(_stop_idle, frozenset({P.DONE})),
    (P.STOPPING, Exited): Entry(_stopped, frozenset({P.DONE})),
    (P.STOPPING, Stop): Entry(_stop_again, frozenset({P.STOPPING})),
    (P.STOPPING, Ready): Entry(_ignore, frozenset({P.STOPPING})),
    **{(p, SpareExited): Entry(_spare_gone, frozenset({p})) for p in Phase if p is not P.DONE},
}


def _phase(s: RestartState, event: Event) -> Phase:
    return s.phase


def step(s: RestartState, event: Event, now: float) -> Result:
    """Apply one event. Raises InvalidTransition (state unchanged) on a miss."""
    return machine.run_step(TRANSITIONS, _phase, s, event, now, error=InvalidTransition)
