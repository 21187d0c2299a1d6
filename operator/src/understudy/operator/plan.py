"""``plan(instance, observed, now) -> Plan``: the whole reconcile decision (pure).

The shell (``handlers.py``) gathers :class:`Observed` (``observe.py``), calls
:func:`plan`, and hands the :class:`Plan` to ``apply.py``. Nothing here
depends on which kopf event fired: create, update, resume, the timer and pod
events all run the same level-based pass: the outcome depends on what is
observed, not on which events arrived.

One pass:

1. the replica records come from ``status.replicas``; replicas beyond the
   target are terminated, missing ones start Pending; a new generation gives
   Failed replicas another chance;
2. per replica, the lifecycle handlers look at the pod and *report*;
   ``lifecycle.judge`` applies the reports (attempt fencing, retry / expiry /
   give-up, the transition table) and yields history entries;
3. the pods to create (SCHEDULE success: a new attempt), to delete (stale
   attempt, terminated replica, outdated spec one at a time, a lost node's
   pod by force) and the ``understudy.dev/routable`` label to write follow;
4. status (replicas, active engine / epoch / failovers from each engine's
   ``/state``, conditions via ``set_condition``), Events and a requeue hint.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from understudy.operator import lifecycle as lc
from understudy.operator import render
from understudy.operator.api import (
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
    parse_rfc3339,
    rfc3339,
    set_condition,
)
from understudy.operator.scheduler import NodeInfo, Request, select

P = ReplicaPhase

# Container waiting reasons that are failures, not progress.
FAILING_WAIT_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)


# ---------------------------------------------------------------- observed


@dataclass(frozen=True, slots=True)
class ContainerView:
    name: str
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    waiting_reason: str | None = None


@dataclass(frozen=True, slots=True)
class EngineView:
    """An engine's ``/state`` JSON; every field None when unreachable (unknown)."""

    role: str | None = None
    state: str | None = None
    epoch: int | None = None
    granted_at: float | None = None
    active_at: float | None = None


@dataclass(frozen=True, slots=True)
class PodView:
    name: str
    index: int | None
    attempt: int | None
    spec_hash: str | None
    phase: str = "Pending"  # the pod's status.phase
    node: str | None = None
    deleting: bool = False
    unschedulable: str | None = None  # PodScheduled=False message
    routable_label: str | None = None
    front_ready: bool = False
    containers: tuple[ContainerView, ...] = ()
    engines: Mapping[str, EngineView] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Observed:
    pods: Mapping[str, PodView] = field(default_factory=dict)
    # Node name -> Ready; None when nodes cannot be read (then never "lost").
    node_ready: Mapping[str, bool] | None = None
    nodes: tuple[NodeInfo, ...] = ()  # placement candidates (empty: kube-scheduler decides)
    claim: Mapping[str, Any] | None = None  # the existing claim (template), if any


# -------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class Delete:
    kind: str
    name: str
    reason: str
    grace_seconds: int | None = None  # 0: force (the pod's node is gone)


@dataclass(frozen=True, slots=True)
class LabelPatch:
    pod: str
    key: str
    value: str


@dataclass(frozen=True, slots=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Plan:
    ensure: tuple[dict[str, Any], ...] = ()  # create if absent (Service: also patch)
    create_pods: tuple[dict[str, Any], ...] = ()
    deletes: tuple[Delete, ...] = ()
    labels: tuple[LabelPatch, ...] = ()
    status: dict[str, Any] | None = None  # full new status, None when unchanged
    events: tuple[EventSpec, ...] = ()
    requeue_after: float | None = None


# --------------------------------------------------------------- handlers


def _report(
    h: lc.Handler, rec: lc.Replica, outcome: lc.Outcome, msg: str, attempt: int | None = None
) -> lc.Report:
    return lc.Report(h, rec.index, rec.attempt if attempt is None else attempt, outcome, msg)


def _presence(rec: lc.Replica, pod: PodView | None) -> lc.Report:
    if pod is None:
        return _report(lc.Handler.PRESENCE, rec, lc.Outcome.FAILURE, "pod is gone")
    if pod.attempt != rec.attempt:
        return _report(
            lc.Handler.PRESENCE, rec, lc.Outcome.FAILURE, f"pod is of attempt {pod.attempt}"
        )
    if pod.deleting:
        return _report(lc.Handler.PRESENCE, rec, lc.Outcome.FAILURE, "pod is being deleted")
    if pod.phase in ("Failed", "Succeeded"):
        return _report(lc.Handler.PRESENCE, rec, lc.Outcome.FAILURE, f"pod {pod.phase}")
    return _report(lc.Handler.PRESENCE, rec, lc.Outcome.SUCCESS, "pod present")


def _node_ok(pod: PodView, node_ready: Mapping[str, bool] | None) -> bool | None:
    if node_ready is None or pod.node is None:
        return None
    return node_ready.get(pod.node, False)


def _node(rec: lc.Replica, pod: PodView, obs: Observed) -> lc.Report:
    ok = _node_ok(pod, obs.node_ready)
    if ok is False:
        return _report(
            lc.Handler.NODE, rec, lc.Outcome.FAILURE, f"node {pod.node} lost", pod.attempt
        )
    return _report(lc.Handler.NODE, rec, lc.Outcome.SUCCESS, "node ready", pod.attempt)


def _bind(rec: lc.Replica, pod: PodView) -> lc.Report:
    if pod.node is not None:
        return _report(
            lc.Handler.BIND, rec, lc.Outcome.SUCCESS, f"bound to {pod.node}", pod.attempt
        )
    if pod.unschedulable:
        return _report(lc.Handler.BIND, rec, lc.Outcome.FAILURE, pod.unschedulable, pod.attempt)
    return _report(
        lc.Handler.BIND, rec, lc.Outcome.SKIPPED, "waiting for kube-scheduler", pod.attempt
    )


def _start(rec: lc.Replica, pod: PodView) -> lc.Report:
    if pod.phase == "Running":
        return _report(lc.Handler.START, rec, lc.Outcome.SUCCESS, "pod running", pod.attempt)
    failing = sorted(
        f"{c.name}: {c.waiting_reason}"
        for c in pod.containers
        if c.waiting_reason in FAILING_WAIT_REASONS
    )
    if failing:
        return _report(lc.Handler.START, rec, lc.Outcome.FAILURE, ", ".join(failing), pod.attempt)
    return _report(lc.Handler.START, rec, lc.Outcome.SKIPPED, "containers starting", pod.attempt)


def _recover(rec: lc.Replica, pod: PodView, obs: Observed) -> lc.Report:
    if _node_ok(pod, obs.node_ready) is not False and pod.phase == "Running":
        return _report(lc.Handler.RECOVER, rec, lc.Outcome.SUCCESS, "node back", pod.attempt)
    return _report(
        lc.Handler.RECOVER, rec, lc.Outcome.SKIPPED, f"node {pod.node} still lost", pod.attempt
    )


def _request(inst: GpuInstance) -> Request:
    s = inst.spec
    return Request(
        count=s.gpus.count,
        strategy=s.placement.strategy,
        indices=tuple(s.gpus.indices) if s.gpus.indices is not None else None,
        target_node=s.placement.target_node,
        node_selector=dict(s.placement.node_selector),
        exclusive=s.gpus.exclusive,
    )


# ------------------------------------------------------------------ status


def _records(inst: GpuInstance, now: float) -> dict[int, lc.Replica]:
    out: dict[int, lc.Replica] = {}
    for r in inst.status.replicas:
        since = parse_rfc3339(r.phase_since)
        out[r.index] = lc.Replica(
            index=r.index,
            phase=r.phase,
            attempt=r.attempt,
            retries=r.retries,
            since=now if since is None else since,
            node=r.node,
        )
    return out


def _history_in(inst: GpuInstance) -> tuple[lc.HistoryEntry, ...]:
    out = []
    for h in inst.status.history:
        try:
            handler = lc.Handler(h.handler)
            verdict = lc.Verdict(h.result)
        except ValueError:
            continue
        out.append(
            lc.HistoryEntry(
                time=parse_rfc3339(h.time) or 0.0,
                replica=h.replica,
                attempt=h.attempt,
                handler=handler,
                verdict=verdict,
                event=None,
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
            handler=e.handler.value,
            result=e.verdict.value,
            message=e.message[:1024],
        )
        for e in entries
    ]


def _event_of(e: lc.HistoryEntry) -> EventSpec:
    warning = e.verdict in (lc.Verdict.NEED_RETRY, lc.Verdict.EXPIRED, lc.Verdict.GIVE_UP)
    arrow = f" -> {e.phase}" if e.event is not None else ""
    return EventSpec(
        type="Warning" if warning else "Normal",
        reason=(e.event.value if e.event is not None else e.verdict.value),
        message=(
            f"replica {e.replica} attempt {e.attempt}: {e.handler} {e.verdict}{arrow}: {e.message}"
        ),
    )


def _engine_summary(pod: PodView | None) -> tuple[str | None, EngineView | None]:
    if pod is None:
        return None, None
    for name, view in sorted(pod.engines.items()):
        if view.state is not None and view.state.lower() == "active":
            return name, view
    return None, None


def _engines_known(pod: PodView) -> bool:
    return any(v.state is not None for v in pod.engines.values())


def _any_engine_ready(inst: GpuInstance, pod: PodView) -> bool:
    want = set(render.engine_names(inst))
    return any(c.ready for c in pod.containers if c.name in want)


def _engines_ready(inst: GpuInstance, pod: PodView | None) -> bool:
    if pod is None:
        return False
    want = set(render.engine_names(inst))
    ready = {c.name for c in pod.containers if c.ready}
    return want <= ready


# -------------------------------------------------------------------- plan


def plan(
    inst: GpuInstance,
    observed: Observed,
    now: float,
    cfg: render.RenderConfig | None = None,
    policy: lc.Policy | None = None,
) -> Plan:
    cfg = cfg or render.RenderConfig()
    s = inst.spec
    policy = policy or lc.Policy(start_timeout=s.failover.startup_budget_seconds + 300.0)
    generation = inst.metadata.generation
    target = s.replicas.target
    want_hash = render.spec_hash(inst, cfg)
    records = _records(inst, now)
    old_status = {r.index: r for r in inst.status.replicas}
    entries: list[lc.HistoryEntry] = []
    deletes: list[Delete] = []
    creates: list[dict[str, Any]] = []
    labels: list[LabelPatch] = []
    events: list[EventSpec] = []
    new_generation = inst.status.observed_generation != generation

    for i in range(target):
        records.setdefault(i, lc.Replica(index=i, since=now))
    for i, rec in list(records.items()):
        if i >= target:
            records[i] = lc.delete(rec, now)
        elif new_generation:
            records[i] = lc.reset(rec, now)

    # Placement candidates see this instance's pods and this pass's placements.
    nodes = {n.name: n for n in observed.nodes}
    for seen in observed.pods.values():
        if seen.node in nodes and not seen.deleting:
            n = nodes[seen.node]
            nodes[n.name] = replace(n, ours=n.ours + 1)
    request = _request(inst)

    # Replace at most one outdated pod per pass, and only while the others run.
    outdated_budget = 1 if all(r.phase is P.RUNNING for r in records.values()) else 0

    for i in sorted(records):
        rec = records[i]
        name = render.pod_name(inst, i)
        pod = observed.pods.get(name)

        def feed(rec: lc.Replica, report: lc.Report) -> lc.Replica:
            new, entry = lc.judge(rec, report, policy, now)
            if entry is not None:
                entries.append(entry)
            return new

        if rec.phase is P.TERMINATING:
            if pod is None:
                del records[i]
                events.append(EventSpec("Normal", Reason.SCALED_DOWN, f"replica {i} removed"))
            elif not pod.deleting:
                deletes.append(Delete("Pod", name, f"replica {i} scaled down"))
            continue

        if rec.phase in HANDLED_WITH_POD:
            rec = feed(rec, _presence(rec, pod))
        if pod is not None and rec.phase in (P.STARTING, P.RUNNING):
            rec = feed(rec, _node(rec, pod, observed))
        if pod is not None and rec.phase is P.SCHEDULED:
            rec = feed(rec, _bind(rec, pod))
        if pod is not None and rec.phase is P.STARTING:
            rec = feed(rec, _start(rec, pod))
        if pod is not None and rec.phase is P.UNKNOWN:
            rec = feed(rec, _recover(rec, pod, observed))
        if rec.phase is P.FAILED:
            rec = feed(
                rec, _report(lc.Handler.RETRY_FAILED, rec, lc.Outcome.SKIPPED, "backing off")
            )
        if rec.phase is P.PENDING:
            if pod is not None and pod.attempt is not None and pod.attempt > rec.attempt:
                # A pod of a newer attempt than the record: this pass reads a status
                # older than the write that preceded the pod's creation. Never fence
                # it off; apply's resourceVersion precondition rejects this pass.
                rec = feed(
                    rec,
                    _report(
                        lc.Handler.SCHEDULE,
                        rec,
                        lc.Outcome.SKIPPED,
                        f"pod of newer attempt {pod.attempt}: status lags",
                    ),
                )
            elif pod is not None:
                # Fencing: the previous attempt's pod goes before a new attempt starts.
                if not pod.deleting:
                    lost = _node_ok(pod, observed.node_ready) is False
                    deletes.append(
                        Delete(
                            "Pod",
                            name,
                            f"replica {i}: stale attempt {pod.attempt}",
                            0 if lost else None,
                        )
                    )
                elif _node_ok(pod, observed.node_ready) is False:
                    deletes.append(Delete("Pod", name, f"replica {i}: force, node lost", 0))
                rec = feed(
                    rec,
                    _report(lc.Handler.SCHEDULE, rec, lc.Outcome.SKIPPED, "old pod terminating"),
                )
            else:
                placement = select(request, list(nodes.values()))
                if placement.feasible:
                    report = lc.Report(
                        lc.Handler.SCHEDULE,
                        i,
                        rec.attempt,
                        lc.Outcome.SUCCESS,
                        placement.reason,
                        placement.node,
                    )
                    rec = feed(rec, report)
                    if rec.phase is P.SCHEDULED:
                        creates.append(render.render_pod(inst, i, rec.attempt, rec.node, cfg))
                        if rec.node in nodes:
                            n = nodes[rec.node]
                            nodes[n.name] = replace(
                                n, ours=n.ours + 1, reserved=n.reserved + s.gpus.count
                            )
                else:
                    rec = feed(
                        rec, _report(lc.Handler.SCHEDULE, rec, lc.Outcome.FAILURE, placement.reason)
                    )
        elif (
            pod is not None
            and not pod.deleting
            and pod.attempt == rec.attempt
            and pod.spec_hash != want_hash
            and rec.phase is P.RUNNING
            and outdated_budget > 0
        ):
            outdated_budget -= 1
            deletes.append(Delete("Pod", name, f"replica {i}: spec changed"))
            events.append(EventSpec("Normal", Reason.SPEC_CHANGED, f"replacing pod {name}"))
        records[i] = rec

    # Pods that belong to no replica record (orphans of an older shape).
    known = {render.pod_name(inst, i) for i in records}
    for seen in observed.pods.values():
        if seen.name not in known and not seen.deleting:
            deletes.append(Delete("Pod", seen.name, "no replica for this pod"))

    # The routable label (docs/pod.md, the readiness trap).
    replica_status: list[ReplicaStatus] = []
    failovers = inst.status.failovers
    last_failover_time = inst.status.last_failover_time
    last_failover_duration = inst.status.last_failover_duration_seconds
    serving = 0
    armed = 0
    deleted = {d.name for d in deletes}
    for i in sorted(records):
        rec = records[i]
        name = render.pod_name(inst, i)
        pod = observed.pods.get(name)
        current = (
            pod is not None
            and pod.attempt == rec.attempt
            and not pod.deleting
            and name not in deleted
        )
        # Routable unless the pod has neither a front that can serve (an
        # Active engine, or a failover within its hold) nor a ready engine
        # container (Standby or Active): a restart of any one container —
        # the killed engine, or a sidecar — never takes the pod out of the
        # Service; only a pod with nothing left does.
        routable = bool(
            current
            and pod is not None
            and rec.phase is P.RUNNING
            and (pod.front_ready or _any_engine_ready(inst, pod))
        )
        if pod is not None and not pod.deleting:
            want = "true" if routable else "false"
            if pod.routable_label != want:
                labels.append(LabelPatch(name, render.LABEL_ROUTABLE, want))
                events.append(
                    EventSpec(
                        "Normal",
                        Reason.ROUTABLE if routable else Reason.NOT_ROUTABLE,
                        f"pod {name} routable={want}",
                    )
                )
        prev = old_status.get(i)
        active, view = _engine_summary(pod if current else None)
        epoch = prev.epoch if prev is not None else None
        replica_failovers = prev.failovers if prev is not None else 0
        if active is not None and view is not None and view.epoch is not None:
            prev_active = prev.active_engine if prev is not None else None
            if epoch is not None and view.epoch > epoch and prev_active not in (None, active):
                replica_failovers += 1
                failovers += 1
                last_failover_time = rfc3339(now)
                if view.active_at is not None and view.granted_at is not None:
                    last_failover_duration = max(0.0, view.active_at - view.granted_at)
                events.append(
                    EventSpec(
                        "Warning",
                        Reason.FAILOVER,
                        f"replica {i}: {prev_active} -> {active} (epoch {epoch} -> {view.epoch})",
                    )
                )
            epoch = view.epoch
        elif prev is not None and current and pod is not None and not _engines_known(pod):
            active = prev.active_engine  # unreachable /state: unknown, keep the last known
        standby_ready = bool(current and _engines_ready(inst, pod))
        serving += routable
        armed += standby_ready and i < target
        replica_status.append(
            ReplicaStatus(
                index=i,
                pod=name,
                phase=rec.phase,
                phase_since=rfc3339(rec.since),
                attempt=rec.attempt,
                retries=rec.retries,
                node=(pod.node if current and pod is not None and pod.node else rec.node),
                active_engine=active,
                epoch=epoch,
                routable=routable,
                standby_ready=standby_ready,
                failovers=replica_failovers,
            )
        )

    old_history = _history_in(inst)
    fresh = lc.accepted(old_history, entries)
    history = lc.append_history(old_history, entries)
    events.extend(_event_of(e) for e in fresh if e.verdict is not lc.Verdict.SKIPPED or e.event)

    conditions, cond_events = _conditions(inst, records, serving, armed, target, now, generation)
    events.extend(cond_events)
    phase = _phase(records, serving, s.replicas.ready_threshold)
    status = GpuInstanceStatus(
        phase=phase,
        observed_generation=generation,
        conditions=conditions,
        attempt=sum(r.attempt for r in records.values()),
        replicas=replica_status,
        ready_replicas=serving,
        active=f"{sum(1 for r in replica_status if r.active_engine)}/{target}",
        failovers=failovers,
        last_failover_time=last_failover_time,
        last_failover_duration_seconds=last_failover_duration,
        history=_history_out(history),
    )
    status_out = None
    if status != inst.status:
        status_out = status.model_dump(by_alias=True, mode="json", exclude_none=True)

    ensure: list[dict[str, Any]] = [render.render_claim(inst), render.render_service(inst)]
    want_claim = render.render_claim(inst)
    if observed.claim is not None and observed.claim.get("spec") != want_claim["spec"]:
        deletes.append(
            Delete(want_claim["kind"], want_claim["metadata"]["name"], "device request changed")
        )
    return Plan(
        ensure=tuple(ensure),
        create_pods=tuple(creates),
        deletes=tuple(deletes),
        labels=tuple(labels),
        status=status_out,
        events=tuple(events),
        requeue_after=_requeue(records, policy, now),
    )


HANDLED_WITH_POD = frozenset({P.SCHEDULED, P.STARTING, P.RUNNING, P.UNKNOWN})

_DEADLINES: Mapping[ReplicaPhase, str] = {
    P.SCHEDULED: "bind_timeout",
    P.STARTING: "start_timeout",
    P.UNKNOWN: "unknown_timeout",
    P.FAILED: "failed_backoff",
}


def _requeue(records: Mapping[int, lc.Replica], policy: lc.Policy, now: float) -> float | None:
    """Seconds until the earliest phase deadline (the shell bounds it below)."""
    waits = []
    for r in records.values():
        budget = policy.budget(_DEADLINES.get(r.phase))
        if budget is not None:
            waits.append(max(0.0, r.since + budget - now) + 1.0)
        if r.phase in (P.PENDING, P.TERMINATING):
            waits.append(1.0)
    return min(waits) if waits else None


def _phase(records: Mapping[int, lc.Replica], serving: int, threshold: int) -> Phase:
    phases = [r.phase for r in records.values() if r.phase is not P.TERMINATING]
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


def _conditions(
    inst: GpuInstance,
    records: Mapping[int, lc.Replica],
    serving: int,
    armed: int,
    target: int,
    now: float,
    generation: int,
) -> tuple[list[Condition], list[EventSpec]]:
    conds: list[Condition] = list(inst.status.conditions)
    events: list[EventSpec] = []
    threshold = inst.spec.replicas.ready_threshold
    live = [r for i, r in records.items() if i < target]

    def put(t: ConditionType, ok: bool | None, reason: Reason, msg: str) -> None:
        nonlocal conds
        status = ConditionStatus.UNKNOWN if ok is None else ConditionStatus(str(ok))
        before = next((c.status for c in conds if c.type == t), None)
        conds, _ = set_condition(conds, t, status, reason, msg, generation, now)
        if before != status:
            kind = (
                "Normal"
                if (status is ConditionStatus.TRUE) != (t is ConditionType.DEGRADED)
                else "Warning"
            )
            events.append(EventSpec(kind, reason, f"{t}={status}: {msg}"))

    ok = serving >= threshold
    put(
        ConditionType.READY,
        ok,
        Reason.REPLICAS_SERVING if ok else Reason.TOO_FEW_SERVING,
        f"{serving} of {threshold} required replica(s) serving",
    )
    bound = sum(1 for r in live if r.phase in (P.STARTING, P.RUNNING))
    gave_up = any(r.phase is P.FAILED for r in live)
    put(
        ConditionType.SCHEDULED,
        bound == len(live),
        Reason.ALL_BOUND
        if bound == len(live)
        else (Reason.NO_FEASIBLE_NODE if gave_up else Reason.WAITING_FOR_SCHEDULER),
        f"{bound} of {len(live)} replica pod(s) bound to a node",
    )
    if inst.spec.failover.enabled:
        put(
            ConditionType.STANDBY_READY,
            armed == len(live),
            Reason.STANDBY_ARMED if armed == len(live) else Reason.STANDBY_MISSING,
            f"{armed} of {len(live)} replica(s) have every engine Standby or Active",
        )
    else:
        put(
            ConditionType.STANDBY_READY,
            False,
            Reason.FAILOVER_DISABLED,
            "failover.enabled is false",
        )
    failed = [r.index for r in live if r.phase is P.FAILED]
    lost = [r.index for r in live if r.phase is P.UNKNOWN]
    if failed:
        put(ConditionType.DEGRADED, True, Reason.REPLICA_FAILED, f"replica(s) {failed} failed")
    elif lost:
        put(ConditionType.DEGRADED, True, Reason.NODE_LOST, f"replica(s) {lost} on a lost node")
    else:
        put(ConditionType.DEGRADED, False, Reason.AS_EXPECTED, "no replica failed or lost")
    return conds, events
