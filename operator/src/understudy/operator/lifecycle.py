"""Lifecycle of one GpuInstance replica: one transition table, and the step that reads it.

The phases and attempt fencing follow PyLet's instance lifecycle; the split
between checks that only report and one place that decides follows Backend.AI
Sokovan's handlers and coordinator.

* The planner's **checks** (``checks.py``, ``membership.py``) look at a
  replica's pod and report what they saw as an event record: ``Bound``,
  ``Unschedulable``, ``Unbound`` (still waiting), and so on. Each report
  belongs to one :class:`Check` and names the attempt it saw.
* ``step(replica, event, now) -> (replica, actions)`` is the only function
  that changes a replica. It reads :data:`TRANSITIONS`, ``(phase, event type)
  -> Entry(handler, targets)``, through ``understudy.wire.machine.run_step``:
  a pair the table lacks, or a handler landing outside its targets, raises
  :class:`InvalidTransition` and changes nothing.
* The **handlers** make every decision. Progress moves on. A failure counts a
  retry and gives up past its limit. Waiting expires once the phase's budget
  (:data:`BUDGETS`, the one table of deadlines) has run out. A lost pod or
  node moves back.
* The **actions** say what the operator does about it: :class:`Record` a
  history entry (which also becomes a Kubernetes Event), :class:`CreatePod`
  for a new attempt.

The attempt counter rises on every placement (``Placed``) and nowhere else. A
pod carries its attempt in an annotation, so a report about a pod of another
attempt is not about this replica any more: ``step`` drops it before the
table, changing nothing and doing nothing.

Core module: no I/O imports; ``now`` is epoch seconds passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import ClassVar

from understudy.operator.api import ReplicaPhase
from understudy.operator.conditions import Reason
from understudy.wire import machine
from understudy.wire.machine import Entry

P = ReplicaPhase


class Check(StrEnum):
    """Who reported (``status.history[].handler``)."""

    SCHEDULE = "schedule"  # Pending: find a placement and create the pod
    PRESENCE = "presence"  # a pod of the current attempt exists and has not failed
    BIND = "bind"  # Scheduled: the pod got a node
    NODE = "node"  # the pod's node is Ready
    START = "start"  # Starting: the pod runs
    RECOVER = "recover"  # Unknown: the node is back and the pod still runs
    RETRY_FAILED = "retry-failed"  # Failed: wait out the back-off
    DRAIN = "drain"  # Draining: the pod is out of the Service's endpoints and settled


class Verdict(StrEnum):
    """What a handler made of a report (``status.history[].result``)."""

    SUCCESS = "Success"
    NEED_RETRY = "NeedRetry"
    EXPIRED = "Expired"
    GIVE_UP = "GiveUp"
    SKIPPED = "Skipped"


# ------------------------------------------------------------------ state


@dataclass(frozen=True, slots=True)
class Policy:
    """Time budgets (seconds): the longest a replica may stay in a phase."""

    bind_timeout: float = 300.0
    start_timeout: float = 1800.0 + 300.0
    unknown_timeout: float = 60.0
    failed_backoff: float = 300.0
    drain_timeout: float = 30.0 + 2.0


# The one table of deadlines: a phase's budget in a Policy. A phase not listed
# has none. The waiting handlers expire by it, and the planner asks for a pass
# at each deadline by it (expiry is judged when a pass runs).
BUDGETS: dict[ReplicaPhase, Callable[[Policy], float]] = {
    P.SCHEDULED: lambda p: p.bind_timeout,
    P.STARTING: lambda p: p.start_timeout,
    P.UNKNOWN: lambda p: p.unknown_timeout,
    P.FAILED: lambda p: p.failed_backoff,
    P.DRAINING: lambda p: p.drain_timeout,
}


@dataclass(frozen=True, slots=True)
class Replica:
    """The record of one replica (persisted in status.replicas) and the budgets it is judged by."""

    index: int
    phase: ReplicaPhase = P.PENDING
    attempt: int = 0
    retries: int = 0  # failures reported in the current phase
    since: float = 0.0  # when the phase began
    node: str | None = None
    policy: Policy = Policy()


def budget(replica: Replica) -> float | None:
    """How long the replica may stay in its phase; None: as long as it takes."""
    of = BUDGETS.get(replica.phase)
    return None if of is None else of(replica.policy)


def deadline(replica: Replica) -> float | None:
    """When the replica's phase expires; None: never."""
    b = budget(replica)
    return None if b is None else replica.since + b


# The retry limits: failures in a row before a check gives up.
PLACE_RETRIES = 30
BIND_RETRIES = 60
START_RETRIES = 20

TERMINAL: frozenset[ReplicaPhase] = frozenset({P.TERMINATING})
# Phases of a replica on its way out: it no longer counts toward the replica count.
LEAVING: frozenset[ReplicaPhase] = frozenset({P.DRAINING, P.TERMINATING})


# ----------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Report:
    """What a check saw of the replica's pod of attempt ``attempt``."""

    check: ClassVar[Check]
    attempt: int
    message: str = ""


@dataclass(frozen=True, slots=True)
class Placed(Report):
    """The scheduler chose a node (None: kube-scheduler picks): a new attempt starts."""

    check: ClassVar[Check] = Check.SCHEDULE
    node: str | None = None


@dataclass(frozen=True, slots=True)
class Unplaceable(Report):
    """No node fits the replica."""

    check: ClassVar[Check] = Check.SCHEDULE


@dataclass(frozen=True, slots=True)
class Fencing(Report):
    """Not placed yet: an older attempt's pod is still going (or the status lags a newer one)."""

    check: ClassVar[Check] = Check.SCHEDULE


@dataclass(frozen=True, slots=True)
class PodPresent(Report):
    """The attempt's pod exists and has not failed."""

    check: ClassVar[Check] = Check.PRESENCE


@dataclass(frozen=True, slots=True)
class PodLost(Report):
    """The attempt's pod is gone, being deleted, of another attempt, or finished."""

    check: ClassVar[Check] = Check.PRESENCE


@dataclass(frozen=True, slots=True)
class NodeReady(Report):
    """The pod's node is Ready (or cannot be read: never taken for lost)."""

    check: ClassVar[Check] = Check.NODE


@dataclass(frozen=True, slots=True)
class NodeLost(Report):
    """The pod's node is NotReady or gone."""

    check: ClassVar[Check] = Check.NODE


@dataclass(frozen=True, slots=True)
class Bound(Report):
    """kube-scheduler bound the pod (and DRA allocated its claim)."""

    check: ClassVar[Check] = Check.BIND


@dataclass(frozen=True, slots=True)
class Unschedulable(Report):
    """kube-scheduler says the pod does not fit (PodScheduled=False)."""

    check: ClassVar[Check] = Check.BIND


@dataclass(frozen=True, slots=True)
class Unbound(Report):
    """Still waiting for kube-scheduler."""

    check: ClassVar[Check] = Check.BIND


@dataclass(frozen=True, slots=True)
class Started(Report):
    """The pod runs."""

    check: ClassVar[Check] = Check.START


@dataclass(frozen=True, slots=True)
class StartFailed(Report):
    """A container waits for a reason that is a failure (an image that cannot be pulled)."""

    check: ClassVar[Check] = Check.START


@dataclass(frozen=True, slots=True)
class NotStarted(Report):
    """The containers are still starting."""

    check: ClassVar[Check] = Check.START


@dataclass(frozen=True, slots=True)
class NodeBack(Report):
    """The lost node is back and the pod still runs."""

    check: ClassVar[Check] = Check.RECOVER


@dataclass(frozen=True, slots=True)
class StillLost(Report):
    """The node is still lost."""

    check: ClassVar[Check] = Check.RECOVER


@dataclass(frozen=True, slots=True)
class BackingOff(Report):
    """A failed replica waits out its back-off."""

    check: ClassVar[Check] = Check.RETRY_FAILED


@dataclass(frozen=True, slots=True)
class Drained(Report):
    """The pod is out of the Service's endpoints and settled: it may go."""

    check: ClassVar[Check] = Check.DRAIN


@dataclass(frozen=True, slots=True)
class NotDrained(Report):
    """The pod is still in the endpoints, or settling."""

    check: ClassVar[Check] = Check.DRAIN


# The planner's decisions about a replica (not reports about a pod, so no attempt).


@dataclass(frozen=True, slots=True)
class Reset:
    """A new generation of the spec gives a Failed replica another chance."""


@dataclass(frozen=True, slots=True)
class Drain:
    """A serving replica leaves (scale-down, rollout): unroute it first."""


@dataclass(frozen=True, slots=True)
class Delete:
    """A replica leaves at once (it serves nothing, or the instance goes)."""


Progress = Bound | Started | NodeBack | Drained
Loss = PodLost | NodeLost
Failure = Unplaceable | Unschedulable | StartFailed
Waiting = Fencing | Unbound | NotStarted | StillLost | BackingOff | NotDrained
Fine = PodPresent | NodeReady
Command = Reset | Drain | Delete
Event = Placed | Progress | Loss | Failure | Waiting | Fine | Command


# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    time: float
    replica: int
    attempt: int  # the attempt the report was about
    check: Check
    verdict: Verdict
    reason: Reason | None  # the transition the verdict caused; None: the phase held
    phase: ReplicaPhase  # the phase after the verdict
    message: str


@dataclass(frozen=True, slots=True)
class Record:
    """Keep this entry in the history (and post it as an Event if it is news)."""

    entry: HistoryEntry


@dataclass(frozen=True, slots=True)
class CreatePod:
    """Create the pod of the replica's new attempt (on ``node``; None: kube-scheduler picks)."""

    index: int
    attempt: int
    node: str | None


Action = Record | CreatePod
Result = tuple[Replica, list[Action]]


class LifecycleError(Exception):
    """Base of lifecycle errors."""


class InvalidTransition(machine.InvalidTransition, LifecycleError):
    """A (phase, event) pair absent from TRANSITIONS: a bug in the planner."""


# --------------------------------------------------------------- handlers


def _enter(replica: Replica, phase: ReplicaPhase, now: float) -> Replica:
    """The replica in ``phase`` from ``now`` on, its retry count cleared."""
    return replace(replica, phase=phase, retries=0, since=now)


def _record(
    before: Replica,
    after: Replica,
    report: Report,
    verdict: Verdict,
    reason: Reason | None,
    now: float,
) -> Record:
    return Record(
        HistoryEntry(
            time=now,
            replica=before.index,
            attempt=before.attempt,
            check=report.check,
            verdict=verdict,
            reason=reason,
            phase=after.phase,
            message=report.message,
        )
    )


def _placed(replica: Replica, event: Placed, now: float) -> Result:
    new = replace(_enter(replica, P.SCHEDULED, now), attempt=replica.attempt + 1, node=event.node)
    record = _record(replica, new, event, Verdict.SUCCESS, Reason.PLACED, now)
    return new, [record, CreatePod(new.index, new.attempt, event.node)]


def _moves(to: ReplicaPhase, verdict: Verdict, reason: Reason) -> Entry[Replica, Action, P]:
    """Progress (or a loss): the replica moves to ``to``."""

    def handler(replica: Replica, event: Progress | Loss, now: float) -> Result:
        new = _enter(replica, to, now)
        return new, [_record(replica, new, event, verdict, reason, now)]

    return Entry(handler, frozenset({to}))


def _advances(to: ReplicaPhase, reason: Reason) -> Entry[Replica, Action, P]:
    return _moves(to, Verdict.SUCCESS, reason)


def _lost(to: ReplicaPhase, reason: Reason) -> Entry[Replica, Action, P]:
    return _moves(to, Verdict.NEED_RETRY, reason)


def _fine(phase: ReplicaPhase) -> Entry[Replica, Action, P]:
    """A check found nothing wrong: not news.

    Like every success it clears the retry count. The presence and node checks
    run before bind and start in each pass, so those two count one failure at
    most and, in practice, leave their phase by its budget (docs/operator.md).
    """

    def handler(replica: Replica, event: Fine, now: float) -> Result:
        return replace(replica, retries=0), []

    return Entry(handler, frozenset({phase}))


def _fails(phase: ReplicaPhase, limit: int, gives_up_to: ReplicaPhase) -> Entry[Replica, Action, P]:
    """A failure counts; past ``limit`` failures the check gives up and the replica moves on."""

    def handler(replica: Replica, event: Failure, now: float) -> Result:
        retries = replica.retries + 1
        if retries > limit:
            new = _enter(replica, gives_up_to, now)
            return new, [_record(replica, new, event, Verdict.GIVE_UP, Reason.GAVE_UP, now)]
        new = replace(replica, retries=retries)
        return new, [_record(replica, new, event, Verdict.NEED_RETRY, None, now)]

    return Entry(handler, frozenset({phase, gives_up_to}))


def _waits(
    phase: ReplicaPhase, expires_to: ReplicaPhase | None = None
) -> Entry[Replica, Action, P]:
    """Still waiting: the phase holds until its budget has run out, then expires to ``expires_to``.

    ``expires_to`` is None exactly for a phase without a budget (tests check it).
    """

    def handler(replica: Replica, event: Waiting, now: float) -> Result:
        b = budget(replica)
        if expires_to is not None and b is not None and now - replica.since > b:
            new = _enter(replica, expires_to, now)
            return new, [_record(replica, new, event, Verdict.EXPIRED, Reason.EXPIRED, now)]
        return replica, [_record(replica, replica, event, Verdict.SKIPPED, None, now)]

    targets = {phase} if expires_to is None else {phase, expires_to}
    return Entry(handler, frozenset(targets))


def _commanded(to: ReplicaPhase) -> Entry[Replica, Action, P]:
    """The planner's decision: the replica moves to ``to``, nothing to record."""

    def handler(replica: Replica, event: Command, now: float) -> Result:
        return _enter(replica, to, now), []

    return Entry(handler, frozenset({to}))


_DELETE = _commanded(P.TERMINATING)

# The one table: (phase, event type) -> the handler and the phases it may lead
# to; anything else is invalid.
TRANSITIONS: dict[tuple[ReplicaPhase, type], Entry[Replica, Action, ReplicaPhase]] = {
    (P.PENDING, Placed): Entry(_placed, frozenset({P.SCHEDULED})),
    (P.PENDING, Unplaceable): _fails(P.PENDING, PLACE_RETRIES, gives_up_to=P.FAILED),
    (P.PENDING, Fencing): _waits(P.PENDING),
    (P.PENDING, Delete): _DELETE,
    (P.SCHEDULED, PodPresent): _fine(P.SCHEDULED),
    (P.SCHEDULED, PodLost): _lost(P.PENDING, Reason.POD_LOST),
    (P.SCHEDULED, Bound): _advances(P.STARTING, Reason.BOUND),
    (P.SCHEDULED, Unschedulable): _fails(P.SCHEDULED, BIND_RETRIES, gives_up_to=P.PENDING),
    (P.SCHEDULED, Unbound): _waits(P.SCHEDULED, expires_to=P.PENDING),
    (P.SCHEDULED, Delete): _DELETE,
    (P.STARTING, PodPresent): _fine(P.STARTING),
    (P.STARTING, PodLost): _lost(P.PENDING, Reason.POD_LOST),
    (P.STARTING, NodeReady): _fine(P.STARTING),
    (P.STARTING, NodeLost): _lost(P.UNKNOWN, Reason.NODE_LOST),
    (P.STARTING, Started): _advances(P.RUNNING, Reason.STARTED),
    (P.STARTING, StartFailed): _fails(P.STARTING, START_RETRIES, gives_up_to=P.PENDING),
    (P.STARTING, NotStarted): _waits(P.STARTING, expires_to=P.PENDING),
    (P.STARTING, Delete): _DELETE,
    (P.RUNNING, PodPresent): _fine(P.RUNNING),
    (P.RUNNING, PodLost): _lost(P.PENDING, Reason.POD_LOST),
    (P.RUNNING, NodeReady): _fine(P.RUNNING),
    (P.RUNNING, NodeLost): _lost(P.UNKNOWN, Reason.NODE_LOST),
    (P.RUNNING, Drain): _commanded(P.DRAINING),
    (P.RUNNING, Delete): _DELETE,
    (P.UNKNOWN, PodPresent): _fine(P.UNKNOWN),
    (P.UNKNOWN, PodLost): _lost(P.PENDING, Reason.POD_LOST),
    (P.UNKNOWN, NodeBack): _advances(P.RUNNING, Reason.NODE_BACK),
    (P.UNKNOWN, StillLost): _waits(P.UNKNOWN, expires_to=P.PENDING),
    (P.UNKNOWN, Delete): _DELETE,
    (P.FAILED, BackingOff): _waits(P.FAILED, expires_to=P.PENDING),
    (P.FAILED, Reset): _commanded(P.PENDING),
    (P.FAILED, Delete): _DELETE,
    # A draining replica goes whatever happens: nothing comes back to it.
    (P.DRAINING, PodPresent): _fine(P.DRAINING),
    (P.DRAINING, PodLost): _lost(P.TERMINATING, Reason.POD_LOST),
    (P.DRAINING, NodeReady): _fine(P.DRAINING),
    (P.DRAINING, NodeLost): _lost(P.TERMINATING, Reason.NODE_LOST),
    (P.DRAINING, Drained): _advances(P.TERMINATING, Reason.DRAINED),
    (P.DRAINING, NotDrained): _waits(P.DRAINING, expires_to=P.TERMINATING),
    (P.DRAINING, Delete): _DELETE,
}


def _phase(replica: Replica, event: Event) -> ReplicaPhase:
    return replica.phase


def step(replica: Replica, event: Event, now: float) -> Result:
    """The only change of a replica. Raises InvalidTransition (record unchanged) on a miss.

    A report about another attempt than the replica's is dropped: the record
    and no actions come back.
    """
    if isinstance(event, Report) and event.attempt != replica.attempt:
        return replica, []
    return machine.run_step(TRANSITIONS, _phase, replica, event, now, error=InvalidTransition)


# Which checks report in which phase: those whose events the table takes there.
_OBSERVES: frozenset[tuple[ReplicaPhase, Check]] = frozenset(
    (phase, kind.check) for phase, kind in TRANSITIONS if issubclass(kind, Report)
)


def observes(phase: ReplicaPhase, check: Check) -> bool:
    """Whether ``check`` reports on a replica in ``phase`` (the table takes its events there)."""
    return (phase, check) in _OBSERVES


def delete(replica: Replica, now: float) -> Replica:
    """Deletion without a drain: every non-terminal phase may be terminated."""
    if replica.phase in TERMINAL:
        return replica
    return step(replica, Delete(), now)[0]


def retire(replica: Replica, now: float) -> Replica:
    """Scale-down or rollout: drain where the table allows it, else terminate.

    Only a phase with a ``Drain`` entry (a serving replica) drains; one
    that serves nothing has nothing to drain and is terminated at once. A
    replica already leaving is left alone.
    """
    if replica.phase in LEAVING:
        return replica
    if (replica.phase, Drain) in TRANSITIONS:
        return step(replica, Drain(), now)[0]
    return delete(replica, now)


def reset(replica: Replica, now: float) -> Replica:
    """A spec change gives a Failed replica another chance."""
    if replica.phase is P.FAILED:
        return step(replica, Reset(), now)[0]
    return replica
