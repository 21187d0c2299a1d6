"""Lifecycle of one GpuInstance replica: one transition table, one coordinator.

The states and attempt fencing follow PyLet's instance lifecycle; the split
of responsibilities follows Backend.AI Sokovan's handlers and coordinator:

* **handlers** look at one replica and its pod and only *report* an
  :class:`Outcome` (success / failure / skipped) for the replica's current
  ``attempt``;
* each handler **declares** which :class:`Event` each verdict means
  (:class:`Transitions`), but never changes a state itself;
* the **coordinator** (:func:`judge`) ignores reports of a stale attempt or
  for a phase the handler does not target, counts failures, decides
  NEED_RETRY / GIVE_UP (retry count) or EXPIRED (time in phase), and applies
  the declared event through :func:`step`, the only function that changes a
  phase, which consults :data:`TRANSITIONS` and raises
  :class:`InvalidTransition` on a miss, leaving the record unchanged.

``step(replica, event, now) -> (replica, actions)`` has the shape every core
shares (``understudy.wire.machine``). Its action list is always empty: a
phase change here has no effect of its own, and what the operator records of
it (the :class:`HistoryEntry`) needs the handler and verdict that only
:func:`judge` knows.

Every judged report yields a :class:`HistoryEntry`; the history is bounded
(:func:`append_history`) and each entry becomes a Kubernetes Event.

The attempt counter rises on every placement (``PLACED``) and nowhere else;
a pod carries its attempt in an annotation, so anything observed from a pod of
an older attempt arrives here as a stale report and is dropped.

Core module: no I/O imports; ``now`` is epoch seconds passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Never

from understudy.operator.api import ReplicaPhase
from understudy.wire import machine
from understudy.wire.machine import Entry

P = ReplicaPhase


class Event(StrEnum):
    PLACED = "Placed"  # the scheduler chose a placement; a pod of a new attempt is created
    BOUND = "Bound"  # kube-scheduler bound the pod (and DRA allocated its claim)
    STARTED = "Started"  # the pod runs
    NODE_LOST = "NodeLost"  # the pod's node is NotReady or gone
    NODE_BACK = "NodeBack"  # the node came back and the pod still runs
    POD_LOST = "PodLost"  # the pod of the current attempt vanished or failed for good
    EXPIRED = "Expired"  # too long in the current phase (coordinator)
    GAVE_UP = "GaveUp"  # too many failures in the current phase (coordinator)
    RESET = "Reset"  # a failed replica gets another chance (spec changed)
    DRAIN = "Drain"  # a serving replica leaves (scale-down, rollout): unroute it first
    DRAINED = "Drained"  # out of the Service's endpoints and settled: delete it gracefully
    DELETE = "Delete"  # scale down or instance deletion


@dataclass(frozen=True, slots=True)
class Replica:
    """The coordinator's record of one replica (persisted in status.replicas)."""

    index: int
    phase: ReplicaPhase = P.PENDING
    attempt: int = 0
    retries: int = 0
    since: float = 0.0
    node: str | None = None


Result = tuple[Replica, list[Never]]


def _to(target: ReplicaPhase, *, new_attempt: bool = False) -> Entry[Replica, Never, ReplicaPhase]:
    """An entry that moves the replica to ``target``; a placement starts a new attempt."""

    def handler(replica: Replica, event: Event, now: float) -> Result:
        attempt = replica.attempt + 1 if new_attempt else replica.attempt
        return replace(replica, phase=target, attempt=attempt, retries=0, since=now), []

    return Entry(handler, frozenset({target}))


# The one table. (phase, event) -> the entry moving to the next phase;
# anything else is invalid.
TRANSITIONS: dict[tuple[ReplicaPhase, Event], Entry[Replica, Never, ReplicaPhase]] = {
    (P.PENDING, Event.PLACED): _to(P.SCHEDULED, new_attempt=True),
    (P.PENDING, Event.GAVE_UP): _to(P.FAILED),
    (P.PENDING, Event.DELETE): _to(P.TERMINATING),
    (P.SCHEDULED, Event.BOUND): _to(P.STARTING),
    (P.SCHEDULED, Event.POD_LOST): _to(P.PENDING),
    (P.SCHEDULED, Event.EXPIRED): _to(P.PENDING),
    (P.SCHEDULED, Event.GAVE_UP): _to(P.PENDING),
    (P.SCHEDULED, Event.DELETE): _to(P.TERMINATING),
    (P.STARTING, Event.STARTED): _to(P.RUNNING),
    (P.STARTING, Event.NODE_LOST): _to(P.UNKNOWN),
    (P.STARTING, Event.POD_LOST): _to(P.PENDING),
    (P.STARTING, Event.EXPIRED): _to(P.PENDING),
    (P.STARTING, Event.GAVE_UP): _to(P.PENDING),
    (P.STARTING, Event.DELETE): _to(P.TERMINATING),
    (P.RUNNING, Event.NODE_LOST): _to(P.UNKNOWN),
    (P.RUNNING, Event.POD_LOST): _to(P.PENDING),
    (P.RUNNING, Event.DRAIN): _to(P.DRAINING),
    (P.RUNNING, Event.DELETE): _to(P.TERMINATING),
    (P.DRAINING, Event.DRAINED): _to(P.TERMINATING),
    (P.DRAINING, Event.EXPIRED): _to(P.TERMINATING),
    (P.DRAINING, Event.POD_LOST): _to(P.TERMINATING),
    (P.DRAINING, Event.NODE_LOST): _to(P.TERMINATING),
    (P.DRAINING, Event.DELETE): _to(P.TERMINATING),
    (P.UNKNOWN, Event.NODE_BACK): _to(P.RUNNING),
    (P.UNKNOWN, Event.POD_LOST): _to(P.PENDING),
    (P.UNKNOWN, Event.EXPIRED): _to(P.PENDING),
    (P.UNKNOWN, Event.DELETE): _to(P.TERMINATING),
    (P.FAILED, Event.RESET): _to(P.PENDING),
    (P.FAILED, Event.EXPIRED): _to(P.PENDING),
    (P.FAILED, Event.DELETE): _to(P.TERMINATING),
}

TERMINAL: frozenset[ReplicaPhase] = frozenset({P.TERMINATING})
# Phases of a replica on its way out: it no longer counts toward the replica count.
LEAVING: frozenset[ReplicaPhase] = frozenset({P.DRAINING, P.TERMINATING})


class LifecycleError(Exception):
    """Base of lifecycle errors."""


class InvalidTransition(machine.InvalidTransition, LifecycleError):
    """A (phase, event) pair absent from TRANSITIONS: a bug in a handler declaration."""


class Outcome(StrEnum):
    """What a handler reports."""

    SUCCESS = "Success"
    FAILURE = "Failure"  # attempted and failed: counts as a retry
    SKIPPED = "Skipped"  # could not attempt yet (waiting): history only, expiry checked


class Verdict(StrEnum):
    """What the coordinator decides."""

    SUCCESS = "Success"
    NEED_RETRY = "NeedRetry"
    EXPIRED = "Expired"
    GIVE_UP = "GiveUp"
    SKIPPED = "Skipped"


class Handler(StrEnum):
    SCHEDULE = "schedule"  # Pending: find a placement and create the pod
    PRESENCE = "presence"  # a pod of the current attempt exists and has not failed
    BIND = "bind"  # Scheduled: the pod got a node
    NODE = "node"  # the pod's node is Ready
    START = "start"  # Starting: the pod runs
    RECOVER = "recover"  # Unknown: the node is back and the pod still runs
    RETRY_FAILED = "retry-failed"  # Failed: wait out the back-off
    DRAIN = "drain"  # Draining: the pod is out of the Service's endpoints and settled


@dataclass(frozen=True, slots=True)
class Transitions:
    """The event each verdict means for one handler; None keeps the phase."""

    success: Event | None = None
    need_retry: Event | None = None
    expired: Event | None = None
    give_up: Event | None = None


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    targets: frozenset[ReplicaPhase]
    transitions: Transitions
    max_retries: int | None  # None: never gives up
    timeout: str | None  # a field of Policy: the longest time in the phase, or None


HANDLERS: dict[Handler, HandlerSpec] = {
    Handler.SCHEDULE: HandlerSpec(
        frozenset({P.PENDING}),
        Transitions(success=Event.PLACED, give_up=Event.GAVE_UP),
        max_retries=30,
        timeout=None,
    ),
    Handler.PRESENCE: HandlerSpec(
        frozenset({P.SCHEDULED, P.STARTING, P.RUNNING, P.UNKNOWN, P.DRAINING}),
        Transitions(need_retry=Event.POD_LOST),
        max_retries=None,
        timeout=None,
    ),
    Handler.BIND: HandlerSpec(
        frozenset({P.SCHEDULED}),
        Transitions(success=Event.BOUND, expired=Event.EXPIRED, give_up=Event.GAVE_UP),
        max_retries=60,
        timeout="bind_timeout",
    ),
    Handler.NODE: HandlerSpec(
        frozenset({P.STARTING, P.RUNNING, P.DRAINING}),
        Transitions(need_retry=Event.NODE_LOST),
        max_retries=None,
        timeout=None,
    ),
    Handler.START: HandlerSpec(
        frozenset({P.STARTING}),
        Transitions(success=Event.STARTED, expired=Event.EXPIRED, give_up=Event.GAVE_UP),
        max_retries=20,
        timeout="start_timeout",
    ),
    Handler.RECOVER: HandlerSpec(
        frozenset({P.UNKNOWN}),
        Transitions(success=Event.NODE_BACK, expired=Event.EXPIRED),
        max_retries=None,
        timeout="unknown_timeout",
    ),
    Handler.RETRY_FAILED: HandlerSpec(
        frozenset({P.FAILED}),
        Transitions(expired=Event.EXPIRED),
        max_retries=None,
        timeout="failed_backoff",
    ),
    Handler.DRAIN: HandlerSpec(
        frozenset({P.DRAINING}),
        Transitions(success=Event.DRAINED, expired=Event.EXPIRED),
        max_retries=None,
        timeout="drain_timeout",
    ),
}


@dataclass(frozen=True, slots=True)
class Policy:
    """Time budgets (seconds) the coordinator judges expiry with."""

    bind_timeout: float = 300.0
    start_timeout: float = 1800.0 + 300.0
    unknown_timeout: float = 60.0
    failed_backoff: float = 300.0
    drain_timeout: float = 30.0 + 2.0

    def budget(self, name: str | None) -> float | None:
        if name is None:
            return None
        value: float = getattr(self, name)
        return value


@dataclass(frozen=True, slots=True)
class Report:
    handler: Handler
    replica: int
    attempt: int
    outcome: Outcome
    message: str = ""
    node: str | None = None  # for SCHEDULE success: the chosen node (None: kube-scheduler picks)


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    time: float
    replica: int
    attempt: int
    handler: Handler
    verdict: Verdict
    event: Event | None
    phase: ReplicaPhase  # the phase after the verdict
    message: str


HISTORY_LIMIT = 32


def _phase(replica: Replica, event: Event) -> ReplicaPhase:
    return replica.phase


def _itself(event: Event) -> Event:
    return event  # events are enum members, not classes: the member is the key


def step(replica: Replica, event: Event, now: float) -> Result:
    """The only phase change. Raises InvalidTransition (record unchanged) on a miss."""
    return machine.run_step(
        TRANSITIONS, _phase, replica, event, now, kind_of=_itself, error=InvalidTransition
    )


def _event_for(verdict: Verdict, tr: Transitions) -> Event | None:
    match verdict:
        case Verdict.SUCCESS:
            return tr.success
        case Verdict.NEED_RETRY:
            return tr.need_retry
        case Verdict.EXPIRED:
            return tr.expired
        case Verdict.GIVE_UP:
            return tr.give_up
        case Verdict.SKIPPED:
            return None


def judge(
    replica: Replica, report: Report, policy: Policy, now: float
) -> tuple[Replica, HistoryEntry | None]:
    """Coordinator: apply one report. Stale or inapplicable reports change nothing."""
    if report.replica != replica.index or report.attempt != replica.attempt:
        return replica, None
    spec = HANDLERS[report.handler]
    if replica.phase not in spec.targets:
        return replica, None
    retries = replica.retries
    match report.outcome:
        case Outcome.SUCCESS:
            verdict = Verdict.SUCCESS
            retries = 0
        case Outcome.FAILURE:
            retries += 1
            if spec.max_retries is not None and retries > spec.max_retries:
                verdict = Verdict.GIVE_UP
            else:
                verdict = Verdict.NEED_RETRY
        case Outcome.SKIPPED:
            budget = policy.budget(spec.timeout)
            if budget is not None and now - replica.since > budget:
                verdict = Verdict.EXPIRED
            else:
                verdict = Verdict.SKIPPED
    event = _event_for(verdict, spec.transitions)
    updated = replace(replica, retries=retries)
    if event is not None:
        updated, _ = step(updated, event, now)
        if event is Event.PLACED:
            updated = replace(updated, node=report.node)
    entry = HistoryEntry(
        time=now,
        replica=replica.index,
        attempt=replica.attempt,
        handler=report.handler,
        verdict=verdict,
        event=event,
        phase=updated.phase,
        message=report.message,
    )
    return updated, entry


def delete(replica: Replica, now: float) -> Replica:
    """Deletion without a drain: every non-terminal phase may be terminated."""
    if replica.phase in TERMINAL:
        return replica
    return step(replica, Event.DELETE, now)[0]


def retire(replica: Replica, now: float) -> Replica:
    """Scale-down or rollout: drain where the table allows it, else terminate.

    Only a phase with a ``DRAIN`` entry (a serving replica) drains; one
    that serves nothing has nothing to drain and is terminated at once. A
    replica already leaving is left alone.
    """
    if replica.phase in LEAVING:
        return replica
    if (replica.phase, Event.DRAIN) in TRANSITIONS:
        return step(replica, Event.DRAIN, now)[0]
    return delete(replica, now)


def reset(replica: Replica, now: float) -> Replica:
    """A spec change gives a Failed replica another chance."""
    if replica.phase is P.FAILED:
        return step(replica, Event.RESET, now)[0]
    return replica


def accepted(
    history: Sequence[HistoryEntry], entries: Sequence[HistoryEntry]
) -> list[HistoryEntry]:
    """The entries worth storing.

    A success that changes nothing (a check that passed) is not news; a verdict
    without an event that repeats the same handler's last entry for the replica
    (a replica waiting, pass after pass) is dropped, so the history and its
    Events record changes, not polling.
    """
    out: list[HistoryEntry] = []
    last: dict[tuple[int, Handler], HistoryEntry] = {}
    for h in history:
        last[(h.replica, h.handler)] = h
    for e in entries:
        if e.event is None and e.verdict is Verdict.SUCCESS:
            continue
        prev = last.get((e.replica, e.handler))
        if (
            prev is not None
            and e.event is None
            and (prev.verdict, prev.attempt, prev.message) == (e.verdict, e.attempt, e.message)
        ):
            continue
        out.append(e)
        last[(e.replica, e.handler)] = e
    return out


def append_history(
    history: Sequence[HistoryEntry], entries: Sequence[HistoryEntry], limit: int = HISTORY_LIMIT
) -> tuple[HistoryEntry, ...]:
    """Bounded history: the last ``limit`` accepted entries."""
    return tuple([*history, *accepted(history, entries)][-limit:])
