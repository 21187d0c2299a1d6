"""The status a pass writes, and its conditions (pure).

* per replica (:func:`replica_statuses`): phase, attempt, node, the
  ``understudy.dev/routable`` label, the Active engine and its epoch from each
  engine's ``/state``, and the failovers seen as the epoch rises under a new
  Active engine;
* the history (:func:`history`): the lifecycle's records that are news
  (:func:`accepted`), bounded, and their Events;
* the instance (:func:`instance_status`): its phase, the conditions through
  ``set_condition``, the counts the scale subresource reads.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from understudy.operator import lifecycle as lc
from understudy.operator import render
from understudy.operator.api import (
    AutoscalerStatus,
    Condition,
    ConditionStatus,
    GpuInstance,
    GpuInstanceStatus,
    HistoryEntry,
    Phase,
    ReplicaPhase,
    ReplicaStatus,
)
from understudy.operator.conditions import (
    ConditionType,
    Reason,
    find_condition,
    parse_rfc3339,
    rfc3339,
    set_condition,
)
from understudy.operator.membership import engines_ready, routable, updated
from understudy.operator.view import Context, EngineView, EventSpec, LabelPatch, PodView

P = ReplicaPhase

# --------------------------------------------------------------- replicas


@dataclass(frozen=True, slots=True)
class Failover:
    """One failover seen in this pass: when, and how long it took (None: unknown)."""

    time: str
    duration: float | None


@dataclass(frozen=True, slots=True)
class Engines:
    """A replica's Active engine, its epoch, and the failovers counted for it."""

    active: str | None
    epoch: int | None
    failovers: int
    failover: Failover | None = None  # one seen in this pass
    event: EventSpec | None = None


def _engine_summary(pod: PodView | None) -> tuple[str | None, EngineView | None]:
    if pod is None:
        return None, None
    for name, view in sorted(pod.engines.items()):
        if view.state is not None and view.state.lower() == "active":
            return name, view
    return None, None


def _engines_known(pod: PodView) -> bool:
    return any(v.state is not None for v in pod.engines.values())


def engines(
    ctx: Context, index: int, prev: ReplicaStatus | None, current: PodView | None
) -> Engines:
    """The Active engine from ``/state``; a failover when the epoch rises under a new one.

    An unreachable ``/state`` is unknown, never a failover: the last known
    Active engine and epoch are kept.
    """
    active, view = _engine_summary(current)
    epoch = prev.epoch if prev is not None else None
    count = prev.failovers if prev is not None else 0
    if active is None or view is None or view.epoch is None:
        if prev is not None and current is not None and not _engines_known(current):
            active = prev.active_engine
        return Engines(active, epoch, count)
    prev_active = prev.active_engine if prev is not None else None
    if epoch is None or view.epoch <= epoch or prev_active in (None, active):
        return Engines(active, view.epoch, count)
    # Kill → Active: from the old holder's release when the lock server told
    # the engine, else (an older engine) from the grant.
    start = view.released_at if view.released_at is not None else view.granted_at
    duration = None
    if view.active_at is not None and start is not None:
        duration = max(0.0, view.active_at - start)
    event = EventSpec(
        "Warning",
        Reason.FAILOVER,
        f"replica {index}: {prev_active} -> {active} (epoch {epoch} -> {view.epoch})",
    )
    return Engines(active, view.epoch, count + 1, Failover(rfc3339(ctx.now), duration), event)


def routable_label(
    name: str, pod: PodView | None, is_routable: bool
) -> tuple[LabelPatch, EventSpec] | None:
    """The patch (and its Event) when the pod's routable label differs from the verdict."""
    if pod is None or pod.deleting:
        return None
    want = "true" if is_routable else "false"
    if pod.routable_label == want:
        return None
    reason = Reason.ROUTABLE if is_routable else Reason.NOT_ROUTABLE
    return LabelPatch(name, render.LABEL_ROUTABLE, want), EventSpec(
        "Normal", reason, f"pod {name} routable={want}"
    )


@dataclass(frozen=True, slots=True)
class ReplicaOut:
    status: ReplicaStatus
    label: LabelPatch | None
    events: tuple[EventSpec, ...]
    failover: Failover | None


def replica_status(
    ctx: Context, rec: lc.Replica, deleted: frozenset[str], drain_clock: float | None
) -> ReplicaOut:
    """One replica's status entry, its routable label and the Events about it."""
    i = rec.index
    name = render.pod_name(ctx.inst, i)
    current = ctx.current_pod(rec) if name not in deleted else None
    is_routable = current is not None and routable(ctx, rec)
    label = routable_label(name, ctx.pod(i), is_routable)
    prev = next((r for r in ctx.inst.status.replicas if r.index == i), None)
    eng = engines(ctx, i, prev, current)
    status = ReplicaStatus(
        index=i,
        pod=name,
        phase=rec.phase,
        phase_since=rfc3339(rec.since),
        attempt=rec.attempt,
        retries=rec.retries,
        node=(current.node if current is not None and current.node else rec.node),
        active_engine=eng.active,
        epoch=eng.epoch,
        routable=is_routable,
        standby_ready=current is not None and engines_ready(ctx.inst, current),
        failovers=eng.failovers,
        updated=updated(ctx, rec),
        pressure=(
            current.pressure.total if current is not None and current.pressure is not None else None
        ),
        unrouted_since=rfc3339(drain_clock) if drain_clock is not None else None,
    )
    events = (*([label[1]] if label else []), *([eng.event] if eng.event else []))
    return ReplicaOut(status, label[0] if label else None, events, eng.failover)


@dataclass(frozen=True, slots=True)
class Failovers:
    """The instance-wide failover tally."""

    count: int
    last_time: str | None
    last_duration: float | None

    def after(self, seen: Failover | None) -> Failovers:
        if seen is None:
            return self
        duration = seen.duration if seen.duration is not None else self.last_duration
        return Failovers(self.count + 1, seen.time, duration)


@dataclass(frozen=True, slots=True)
class Replicas:
    statuses: tuple[ReplicaStatus, ...]
    labels: tuple[LabelPatch, ...]
    events: tuple[EventSpec, ...]
    failovers: Failovers


def replica_statuses(
    ctx: Context,
    records: Mapping[int, lc.Replica],
    deleted: frozenset[str],
    clocks: Mapping[int, float | None],
) -> Replicas:
    """Every replica's status in index order; the failover tally carried across them."""
    s = ctx.inst.status
    tally = Failovers(s.failovers, s.last_failover_time, s.last_failover_duration_seconds)
    outs = []
    for i in sorted(records):
        clock = clocks.get(i) if records[i].phase is P.DRAINING else None
        out = replica_status(ctx, records[i], deleted, clock)
        tally = tally.after(out.failover)
        outs.append(out)
    return Replicas(
        tuple(o.status for o in outs),
        tuple(o.label for o in outs if o.label is not None),
        tuple(e for o in outs for e in o.events),
        tally,
    )


# ---------------------------------------------------------------- history


HISTORY_LIMIT = 32


def accepted(
    history: Sequence[lc.HistoryEntry], entries: Sequence[lc.HistoryEntry]
) -> list[lc.HistoryEntry]:
    """The entries worth storing.

    A verdict without a transition that repeats the same check's last entry
    for the replica (a replica waiting, pass after pass) is dropped, so the
    history and its Events record changes, not polling. (A success without a
    transition is never recorded at all.)
    """
    out: list[lc.HistoryEntry] = []
    last: dict[tuple[int, lc.Check], lc.HistoryEntry] = {}
    for h in history:
        last[(h.replica, h.check)] = h
    for e in entries:
        prev = last.get((e.replica, e.check))
        if (
            prev is not None
            and e.reason is None
            and (prev.verdict, prev.attempt, prev.message) == (e.verdict, e.attempt, e.message)
        ):
            continue
        out.append(e)
        last[(e.replica, e.check)] = e
    return out


def append_history(
    history: Sequence[lc.HistoryEntry],
    entries: Sequence[lc.HistoryEntry],
    limit: int = HISTORY_LIMIT,
) -> tuple[lc.HistoryEntry, ...]:
    """Bounded history: the last ``limit`` accepted entries."""
    return tuple([*history, *accepted(history, entries)][-limit:])


def _history_in(inst: GpuInstance) -> tuple[lc.HistoryEntry, ...]:
    out = []
    for h in inst.status.history:
        try:
            check = lc.Check(h.handler)
            verdict = lc.Verdict(h.result)
        except ValueError:
            continue
        out.append(
            lc.HistoryEntry(
                time=parse_rfc3339(h.time) or 0.0,
                replica=h.replica,
                attempt=h.attempt,
                check=check,
                verdict=verdict,
                reason=None,
                phase=P.PENDING,
                message=h.message,
            )
        )
    return tuple(out)


def _history_out(entries: Sequence[lc.HistoryEntry]) -> list[HistoryEntry]:
    return [
        HistoryEntry(
            time=rfc3339(e.time),
            replica=e.replica,
            attempt=e.attempt,
            handler=e.check.value,
            result=e.verdict.value,
            message=e.message[:1024],
        )
        for e in entries
    ]


# The Event reason of a verdict that held the phase (a transition names its own).
_HELD: dict[lc.Verdict, Reason] = {
    lc.Verdict.NEED_RETRY: Reason.NEED_RETRY,
    lc.Verdict.SKIPPED: Reason.SKIPPED,
}
_WARNING = frozenset({lc.Verdict.NEED_RETRY, lc.Verdict.EXPIRED, lc.Verdict.GIVE_UP})


def _event_of(e: lc.HistoryEntry) -> EventSpec:
    arrow = f" -> {e.phase}" if e.reason is not None else ""
    return EventSpec(
        type="Warning" if e.verdict in _WARNING else "Normal",
        reason=e.reason if e.reason is not None else _HELD[e.verdict],
        message=(
            f"replica {e.replica} attempt {e.attempt}: {e.check} {e.verdict}{arrow}: {e.message}"
        ),
    )


def history(
    inst: GpuInstance, entries: Sequence[lc.HistoryEntry]
) -> tuple[list[HistoryEntry], tuple[EventSpec, ...]]:
    """The bounded history with this pass's news, and an Event for each but quiet waiting."""
    old = _history_in(inst)
    fresh = accepted(old, entries)
    events = tuple(_event_of(e) for e in fresh if e.verdict is not lc.Verdict.SKIPPED or e.reason)
    return _history_out(append_history(old, entries)), events


# --------------------------------------------------------------- instance


def instance_phase(records: Mapping[int, lc.Replica], serving: int, threshold: int) -> Phase:
    phases = [r.phase for r in records.values() if r.phase not in lc.LEAVING]
    if phases and all(p is P.FAILED for p in phases):
        return Phase.FAILED
    if serving >= threshold:
        trouble = any(p in (P.FAILED, P.UNKNOWN) for p in phases) or serving < len(phases)
        return Phase.DEGRADED if trouble else Phase.RUNNING
    if serving > 0 or any(p in (P.FAILED, P.UNKNOWN) for p in phases):
        return Phase.DEGRADED
    if any(p in (P.STARTING, P.RUNNING) for p in phases):
        return Phase.STARTING
    if any(p is P.SCHEDULED for p in phases):
        return Phase.SCHEDULING
    return Phase.PENDING


Wanted = tuple[ConditionType, bool, Reason, str]


# kube-scheduler's messages name every node's reason; the condition keeps
# the start of each, which is what a reader needs.
SCHEDULER_MESSAGE_LIMIT = 512


def unschedulable(ctx: Context, live: Sequence[lc.Replica]) -> list[str]:
    """kube-scheduler's word on each replica pod it could not bind (PodScheduled=False)."""
    out = []
    for r in live:
        pod = ctx.current_pod(r) if r.phase is P.SCHEDULED else None
        if pod is not None and pod.node is None and pod.unschedulable:
            out.append(f"replica {r.index}: {pod.unschedulable[:SCHEDULER_MESSAGE_LIMIT]}")
    return out


def _scheduled(ctx: Context, live: Sequence[lc.Replica]) -> Wanted:
    bound = sum(1 for r in live if r.phase in (P.STARTING, P.RUNNING))
    gave_up = any(r.phase is P.FAILED for r in live)
    why = unschedulable(ctx, live)
    if bound == len(live):
        reason = Reason.ALL_BOUND
    elif gave_up:
        reason = Reason.NO_FEASIBLE_NODE
    else:
        reason = Reason.UNSCHEDULABLE if why else Reason.WAITING_FOR_SCHEDULER
    msg = "; ".join([f"{bound} of {len(live)} replica pod(s) bound to a node", *why])
    return ConditionType.SCHEDULED, bound == len(live), reason, msg


def _standby(ctx: Context, live: Sequence[lc.Replica], armed: int) -> Wanted:
    t = ConditionType.STANDBY_READY
    if not ctx.inst.spec.failover.enabled:
        return t, False, Reason.FAILOVER_DISABLED, "failover.enabled is false"
    ok = armed == len(live)
    reason = Reason.STANDBY_ARMED if ok else Reason.STANDBY_MISSING
    return t, ok, reason, f"{armed} of {len(live)} replica(s) have every engine Standby or Active"


def _degraded(live: Sequence[lc.Replica]) -> Wanted:
    t = ConditionType.DEGRADED
    failed = sorted(r.index for r in live if r.phase is P.FAILED)
    lost = sorted(r.index for r in live if r.phase is P.UNKNOWN)
    if failed:
        return t, True, Reason.REPLICA_FAILED, f"replica(s) {failed} failed"
    if lost:
        return t, True, Reason.NODE_LOST, f"replica(s) {lost} on a lost node"
    return t, False, Reason.AS_EXPECTED, "no replica failed or lost"


def wanted_conditions(
    ctx: Context, records: Mapping[int, lc.Replica], serving: int, armed: int
) -> list[Wanted]:
    """Each condition's status, reason and message for this pass."""
    threshold = ctx.inst.spec.replicas.ready_threshold
    live = [r for r in records.values() if r.phase not in lc.LEAVING]
    ok = serving >= threshold
    ready: Wanted = (
        ConditionType.READY,
        ok,
        Reason.REPLICAS_SERVING if ok else Reason.TOO_FEW_SERVING,
        f"{serving} of {threshold} required replica(s) serving",
    )
    return [ready, _scheduled(ctx, live), _standby(ctx, live, armed), _degraded(live)]


def conditions(
    ctx: Context, records: Mapping[int, lc.Replica], serving: int, armed: int
) -> tuple[list[Condition], tuple[EventSpec, ...]]:
    """The conditions through ``set_condition``, and an Event for each that flips.

    A new reason is news too (``WaitingForScheduler`` becoming
    ``Unschedulable``: kube-scheduler has said why), so it gets its Event.
    """
    generation = ctx.inst.metadata.generation
    conds: list[Condition] = list(ctx.inst.status.conditions)
    events: list[EventSpec] = []
    for t, ok, reason, msg in wanted_conditions(ctx, records, serving, armed):
        status = ConditionStatus(str(ok))
        before = find_condition(conds, t)
        conds, _ = set_condition(conds, t, status, reason, msg, generation, ctx.now)
        if before is None or (before.status, before.reason) != (status, reason):
            # Good news is Normal: True for every condition but Degraded.
            good = (status is ConditionStatus.TRUE) != (t is ConditionType.DEGRADED)
            events.append(
                EventSpec("Normal" if good else "Warning", reason, f"{t}={status}: {msg}")
            )
    return conds, tuple(events)


@dataclass(frozen=True, slots=True)
class Built:
    status: GpuInstanceStatus
    labels: tuple[LabelPatch, ...]
    events: tuple[EventSpec, ...]


def instance_status(
    ctx: Context,
    records: Mapping[int, lc.Replica],
    replicas: Replicas,
    entries: Sequence[lc.HistoryEntry],
    target: int,
    autoscaler: AutoscalerStatus | None,
) -> Built:
    """The whole status of the instance: replicas, history, counts and conditions."""
    inst = ctx.inst
    statuses = replicas.statuses
    hist, hist_events = history(inst, entries)
    staying = [st for st in statuses if st.phase not in lc.LEAVING]
    serving = sum(1 for st in statuses if st.routable)
    armed = sum(1 for st in staying if st.standby_ready)
    conds, cond_events = conditions(ctx, records, serving, armed)
    tally = replicas.failovers
    status = GpuInstanceStatus(
        phase=instance_phase(records, serving, inst.spec.replicas.ready_threshold),
        observed_generation=inst.metadata.generation,
        conditions=conds,
        attempt=sum(r.attempt for r in records.values()),
        replicas=list(statuses),
        ready_replicas=serving,
        current_replicas=len(staying),
        updated_replicas=sum(1 for st in staying if st.updated),
        selector=f"{render.LABEL_INSTANCE}={inst.metadata.name}",
        autoscaler=autoscaler,
        active=f"{sum(1 for r in statuses if r.active_engine)}/{target}",
        failovers=tally.count,
        last_failover_time=tally.last_time,
        last_failover_duration_seconds=tally.last_duration,
        history=hist,
    )
    return Built(status, replicas.labels, (*replicas.events, *hist_events, *cond_events))
