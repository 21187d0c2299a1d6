"""Conditions of a GpuInstance: ``set_condition`` and every reason.

``set_condition`` has the semantics of apimachinery's ``meta.SetStatusCondition``:
upsert by type, ``lastTransitionTime`` moves only when the status flips,
``observedGeneration`` is always recorded, and the caller learns whether
anything changed so that the status is patched only then: a pass that
changes nothing makes no API call.

Core module: no I/O imports; ``now`` is passed in (epoch seconds) and
converted to RFC 3339 here because conditions are persisted API fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from enum import StrEnum

from understudy.operator.api import Condition, ConditionStatus


class ConditionType(StrEnum):
    READY = "Ready"  # at least replicas.desired replicas have an Active, routable engine
    SCHEDULED = "Scheduled"  # every replica pod is bound to a node
    STANDBY_READY = "StandbyReady"  # every replica pod is Ready: all engines Standby or Active
    DEGRADED = "Degraded"  # something needs attention (a replica failed, lost, or gave up)


class Reason(StrEnum):
    """Every CamelCase reason the operator writes (conditions and Events)."""

    # Ready
    REPLICAS_SERVING = "ReplicasServing"
    TOO_FEW_SERVING = "TooFewServing"
    # Scheduled
    ALL_BOUND = "AllBound"
    WAITING_FOR_SCHEDULER = "WaitingForScheduler"
    UNSCHEDULABLE = "Unschedulable"  # kube-scheduler said why (its message follows)
    NO_FEASIBLE_NODE = "NoFeasibleNode"
    # StandbyReady
    STANDBY_ARMED = "StandbyArmed"
    STANDBY_MISSING = "StandbyMissing"
    FAILOVER_DISABLED = "FailoverDisabled"
    # Degraded
    AS_EXPECTED = "AsExpected"
    REPLICA_FAILED = "ReplicaFailed"
    NODE_LOST = "NodeLost"
    # lifecycle Events (NODE_LOST above too): a transition, or a failure that held the phase
    PLACED = "Placed"
    BOUND = "Bound"
    STARTED = "Started"
    POD_LOST = "PodLost"
    NODE_BACK = "NodeBack"
    DRAINED = "Drained"
    EXPIRED = "Expired"
    GAVE_UP = "GaveUp"
    NEED_RETRY = "NeedRetry"
    SKIPPED = "Skipped"
    # membership Events
    SCALED_DOWN = "ScaledDown"
    SCALED_UP = "ScaledUp"
    REMOVED = "Removed"
    SCALE_OVERRIDDEN = "ScaleOverridden"  # someone else wrote replicas.desired (autoscaler on)
    SPEC_CHANGED = "SpecChanged"
    FAILOVER = "Failover"
    ROUTABLE = "Routable"
    NOT_ROUTABLE = "NotRoutable"
    # in-place resize after a failover (resize.py, apply.py)
    RESIZED = "Resized"
    RESIZE_REFUSED = "ResizeRefused"


def rfc3339(now: float) -> str:
    """Epoch seconds to the API's time format (second precision, UTC)."""
    return datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        try:
            return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None


def find_condition(conds: Sequence[Condition], type_: str) -> Condition | None:
    return next((c for c in conds if c.type == type_), None)


def set_condition(
    conds: Sequence[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int,
    now: float,
) -> tuple[list[Condition], bool]:
    """Upsert one condition; return the new list and whether anything changed."""
    existing = find_condition(conds, type_)
    if existing is None:
        new = Condition(
            type=type_,
            status=status,
            reason=reason,
            message=message,
            observed_generation=generation,
            last_transition_time=rfc3339(now),
        )
        return [*conds, new], True
    transition = existing.last_transition_time if existing.status == status else rfc3339(now)
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        observed_generation=generation,
        last_transition_time=transition,
    )
    if new == existing:
        return list(conds), False
    return [new if c.type == type_ else c for c in conds], True
