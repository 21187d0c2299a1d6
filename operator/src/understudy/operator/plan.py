"""``plan(instance, observed, now) -> Plan``: the whole reconcile decision (pure).

The shell (``handlers.py``) gathers :class:`Observed` (``observe.py``), calls
:func:`plan`, and hands the :class:`Plan` to ``apply.py``. Nothing here
depends on which kopf event fired: create, update, resume, the timer and pod
events all run the same level-based pass: the outcome depends on what is
observed, not on which events arrived.

One pass, each step a small function of its own:

1. :func:`autoscale`: with ``autoscaling.enabled``, the autoscaler core
   turns the fronts' pressure into the replica count (and a write of
   ``replicas.desired``);
2. :func:`load_records`: the replica records come from ``status.replicas``;
   a new generation gives Failed replicas another chance;
3. :func:`check_replica`: per replica, the lifecycle handlers whose targets
   (``lifecycle.HANDLERS``) include the replica's phase look at its pod and
   *report*; ``lifecycle.judge`` applies the reports (attempt fencing, retry /
   expiry / give-up, the transition table);
4. :func:`membership`: ``rollout.moves`` decides which replicas start and
   which leave (scale up and down, surge-first replacement of pods of an
   older spec); a serving replica leaves by draining (``lifecycle.retire``);
5. :func:`schedule` places Pending replicas (a new attempt, a new pod) after
   fencing off any pod of an older attempt; :func:`leave` deletes the pods of
   replicas that drained;
6. :func:`replica_statuses`: the ``understudy.dev/routable`` label, the
   active engine / epoch / failovers from each engine's ``/state``;
7. conditions via ``set_condition``, the phase, Events and a requeue hint.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from understudy.operator import autoscaler as autoscale_core
from understudy.operator import lifecycle as lc
from understudy.operator import render, rollout
from understudy.operator.api import (
    AutoscalerStatus,
    Condition,
    ConditionStatus,
    GpuInstance,
    GpuInstanceStatus,
    HistoryEntry,
    Phase,
    Recommendation,
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
from understudy.operator.scheduler import NodeInfo, Placement, Request, Toleration, select

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

# How often an autoscaled instance is re-planned to read fresh pressure.
PRESSURE_PERIOD_S = 5.0
# How often a draining replica is re-checked (EndpointSlice changes fire no event here).
DRAIN_PERIOD_S = 0.5


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
    # When the previous holder let go of the lock (the lock server's word,
    # carried in the grant): the start of the failover, detection included.
    released_at: float | None = None


@dataclass(frozen=True, slots=True)
class Pressure:
    """The front's ``/pressure``: requests being served and requests held."""

    inflight: int = 0
    held: int = 0
    active: bool = False

    @property
    def total(self) -> int:
        return self.inflight + self.held


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
    ready: bool = False  # the pod's Ready condition: every container ready
    front_ready: bool = False
    containers: tuple[ContainerView, ...] = ()
    engines: Mapping[str, EngineView] = field(default_factory=dict)
    pressure: Pressure | None = None  # None: unknown (not read, or no answer)


@dataclass(frozen=True, slots=True)
class Observed:
    pods: Mapping[str, PodView] = field(default_factory=dict)
    # Node name -> Ready; None when nodes cannot be read (then never "lost").
    node_ready: Mapping[str, bool] | None = None
    nodes: tuple[NodeInfo, ...] = ()  # placement candidates (empty: kube-scheduler decides)
    claim: Mapping[str, Any] | None = None  # the existing claim (template), if any
    # Pods listed in the Service's EndpointSlices; None when they cannot be read.
    endpoints: frozenset[str] | None = None


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
    scale: int | None = None  # write spec.replicas.desired (the built-in autoscaler)
    autoscale: autoscale_core.Decision | None = None  # for the shell's metrics


Placer = Callable[[Request, Sequence[NodeInfo]], Placement]


@dataclass(frozen=True, slots=True)
class Context:
    """What every step of one pass reads."""

    inst: GpuInstance
    observed: Observed
    now: float
    cfg: render.RenderConfig
    policy: lc.Policy
    want_hash: str
    placer: Placer = select

    def pod(self, index: int) -> PodView | None:
        return self.observed.pods.get(render.pod_name(self.inst, index))

    def current_pod(self, rec: lc.Replica) -> PodView | None:
        """The replica's pod of its current attempt, unless it is being deleted."""
        pod = self.pod(rec.index)
        if pod is None or pod.attempt != rec.attempt or pod.deleting:
            return None
        return pod


def policy_for(inst: GpuInstance) -> lc.Policy:
    s = inst.spec
    return lc.Policy(
        start_timeout=s.failover.startup_budget_seconds + 300.0,
        drain_timeout=float(s.drain.timeout_seconds + s.drain.settle_seconds),
    )


def request_for(inst: GpuInstance, cfg: render.RenderConfig) -> Request:
    s = inst.spec
    return Request(
        count=s.gpus.count,
        strategy=s.placement.strategy,
        indices=tuple(s.gpus.indices) if s.gpus.indices is not None else None,
        target_node=s.placement.target_node,
        node_selector=dict(s.placement.node_selector),
        exclusive=s.gpus.exclusive,
        tolerations=tuple(
            Toleration(t.key, t.operator, t.value, t.effect) for t in s.placement.tolerations
        ),
        image=s.engine.image or cfg.image,
        preferred_labels=dict(s.placement.preferred_node_labels),
    )


# --------------------------------------------------------------- autoscale


@dataclass(frozen=True, slots=True)
class Scale:
    target: int
    status: AutoscalerStatus | None = None
    decision: autoscale_core.Decision | None = None
    events: tuple[EventSpec, ...] = ()


def _autoscaler_state(status: AutoscalerStatus | None) -> autoscale_core.State:
    if status is None:
        return autoscale_core.State()
    recs = tuple(
        autoscale_core.Recommendation(parse_rfc3339(r.time) or 0.0, r.low, r.high)
        for r in status.recommendations
    )
    return autoscale_core.State(recs, parse_rfc3339(status.last_scale_time))


def pressures(ctx: Context, records: Mapping[int, lc.Replica]) -> list[int | None]:
    """Per replica that stays (not leaving): its front's pressure, None when unknown."""
    out: list[int | None] = []
    for i in sorted(records):
        rec = records[i]
        if rec.phase in lc.LEAVING:
            continue
        pod = ctx.current_pod(rec)
        out.append(pod.pressure.total if pod is not None and pod.pressure is not None else None)
    return out


def autoscale(ctx: Context, records: Mapping[int, lc.Replica]) -> Scale:
    """The replica count: the spec's, or the built-in autoscaler's decision."""
    s = ctx.inst.spec
    current = s.replicas.target
    if not s.autoscaling.enabled:
        return Scale(current)
    a = s.autoscaling
    policy = autoscale_core.Policy(
        min_replicas=s.replicas.min,
        max_replicas=s.replicas.max if s.replicas.max is not None else s.replicas.min,
        target=a.target_pressure,
        up_window=float(a.scale_up_stabilization_seconds),
        down_window=float(a.scale_down_stabilization_seconds),
    )
    prev = ctx.inst.status.autoscaler
    events: list[EventSpec] = []
    if prev is not None and prev.desired_replicas != current:
        events.append(
            EventSpec(
                "Warning",
                Reason.SCALE_OVERRIDDEN,
                f"replicas.desired is {current} but the built-in autoscaler set "
                f"{prev.desired_replicas}: while autoscaling.enabled it owns the field; "
                "point no HPA or KEDA at this instance",
            )
        )
    state, decision = autoscale_core.decide(
        policy, _autoscaler_state(prev), pressures(ctx, records), current, ctx.now
    )
    if decision.changed:
        kind = "Normal"
        events.append(EventSpec(kind, decision.reason, decision.message))
    status = AutoscalerStatus(
        desired_replicas=decision.desired,
        pressure=decision.pressure,
        reason=decision.reason.value,
        message=decision.message[:1024],
        last_scale_time=rfc3339(state.last_scale) if state.last_scale is not None else None,
        recommendations=[
            Recommendation(time=rfc3339(r.time), low=r.low, high=r.high)
            for r in state.recommendations
        ],
    )
    return Scale(decision.desired, status, decision, tuple(events))


# ----------------------------------------------------------------- records


def load_records(inst: GpuInstance, now: float) -> dict[int, lc.Replica]:
    """The coordinator's records from ``status.replicas``; a new generation resets Failed."""
    new_generation = inst.status.observed_generation != inst.metadata.generation
    out: dict[int, lc.Replica] = {}
    for r in inst.status.replicas:
        since = parse_rfc3339(r.phase_since)
        rec = lc.Replica(
            index=r.index,
            phase=r.phase,
            attempt=r.attempt,
            retries=r.retries,
            since=now if since is None else since,
            node=r.node,
        )
        out[r.index] = lc.reset(rec, now) if new_generation else rec
    return out


# ------------------------------------------------------------------ checks


def _report(
    h: lc.Handler, rec: lc.Replica, outcome: lc.Outcome, msg: str, attempt: int | None = None
) -> lc.Report:
    return lc.Report(h, rec.index, rec.attempt if attempt is None else attempt, outcome, msg)


def _node_ok(pod: PodView, node_ready: Mapping[str, bool] | None) -> bool | None:
    if node_ready is None or pod.node is None:
        return None
    return node_ready.get(pod.node, False)


def in_endpoints(ctx: Context, pod: PodView) -> bool | None:
    """Whether the Service's EndpointSlices list the pod; None when unknown."""
    if ctx.observed.endpoints is None:
        return None
    return pod.name in ctx.observed.endpoints


def check_presence(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Report | None:
    h = lc.Handler.PRESENCE
    if pod is None:
        return _report(h, rec, lc.Outcome.FAILURE, "pod is gone")
    if pod.attempt != rec.attempt:
        return _report(h, rec, lc.Outcome.FAILURE, f"pod is of attempt {pod.attempt}")
    if pod.deleting:
        return _report(h, rec, lc.Outcome.FAILURE, "pod is being deleted")
    if pod.phase in ("Failed", "Succeeded"):
        return _report(h, rec, lc.Outcome.FAILURE, f"pod {pod.phase}")
    return _report(h, rec, lc.Outcome.SUCCESS, "pod present")


def check_node(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Report | None:
    if pod is None:
        return None
    if _node_ok(pod, ctx.observed.node_ready) is False:
        msg = f"node {pod.node} lost"
        return _report(lc.Handler.NODE, rec, lc.Outcome.FAILURE, msg, pod.attempt)
    return _report(lc.Handler.NODE, rec, lc.Outcome.SUCCESS, "node ready", pod.attempt)


def check_bind(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Report | None:
    h = lc.Handler.BIND
    if pod is None:
        return None
    if pod.node is not None:
        return _report(h, rec, lc.Outcome.SUCCESS, f"bound to {pod.node}", pod.attempt)
    if pod.unschedulable:
        return _report(h, rec, lc.Outcome.FAILURE, pod.unschedulable, pod.attempt)
    return _report(h, rec, lc.Outcome.SKIPPED, "waiting for kube-scheduler", pod.attempt)


def check_start(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Report | None:
    h = lc.Handler.START
    if pod is None:
        return None
    if pod.phase == "Running":
        return _report(h, rec, lc.Outcome.SUCCESS, "pod running", pod.attempt)
    failing = sorted(
        f"{c.name}: {c.waiting_reason}"
        for c in pod.containers
        if c.waiting_reason in FAILING_WAIT_REASONS
    )
    if failing:
        return _report(h, rec, lc.Outcome.FAILURE, ", ".join(failing), pod.attempt)
    return _report(h, rec, lc.Outcome.SKIPPED, "containers starting", pod.attempt)


def check_recover(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Report | None:
    h = lc.Handler.RECOVER
    if pod is None:
        return None
    if _node_ok(pod, ctx.observed.node_ready) is not False and pod.phase == "Running":
        return _report(h, rec, lc.Outcome.SUCCESS, "node back", pod.attempt)
    return _report(h, rec, lc.Outcome.SKIPPED, f"node {pod.node} still lost", pod.attempt)


def check_retry_failed(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Report | None:
    return _report(lc.Handler.RETRY_FAILED, rec, lc.Outcome.SKIPPED, "backing off")


def unrouted_since(
    ctx: Context, rec: lc.Replica, pod: PodView | None, before: float | None
) -> float | None:
    """Draining: when the pod was first seen out of the endpoints (None: not yet)."""
    if rec.phase is not P.DRAINING or pod is None:
        return None
    listed = in_endpoints(ctx, pod)
    if listed:
        return None
    if listed is None:  # endpoints unreadable: count from the unrouting itself
        return rec.since
    return before if before is not None else ctx.now


def check_drain(
    ctx: Context, rec: lc.Replica, pod: PodView | None, since: float | None
) -> lc.Report | None:
    h = lc.Handler.DRAIN
    if pod is None:
        return None
    if since is None:
        return _report(h, rec, lc.Outcome.SKIPPED, "still in the Service's endpoints")
    settle = ctx.inst.spec.drain.settle_seconds
    if ctx.now - since < settle:
        return _report(h, rec, lc.Outcome.SKIPPED, f"out of the endpoints, settling {settle} s")
    return _report(h, rec, lc.Outcome.SUCCESS, "out of the Service's endpoints")


Check = Callable[[Context, lc.Replica, PodView | None], lc.Report | None]

# The observation handlers in the order they run; each runs only for the
# phases lifecycle.HANDLERS declares as its targets. SCHEDULE (placement,
# which creates pods) and DRAIN (which needs the drain clock) run apart.
CHECKS: tuple[tuple[lc.Handler, Check], ...] = (
    (lc.Handler.PRESENCE, check_presence),
    (lc.Handler.NODE, check_node),
    (lc.Handler.BIND, check_bind),
    (lc.Handler.START, check_start),
    (lc.Handler.RECOVER, check_recover),
    (lc.Handler.RETRY_FAILED, check_retry_failed),
)


def targets(handler: lc.Handler, rec: lc.Replica) -> bool:
    return rec.phase in lc.HANDLERS[handler].targets


def check_replica(
    ctx: Context, rec: lc.Replica, drain_clock: float | None
) -> tuple[lc.Replica, list[lc.HistoryEntry]]:
    """Run every check that targets the replica's phase; judge each report."""
    entries: list[lc.HistoryEntry] = []

    def feed(rec: lc.Replica, report: lc.Report | None) -> lc.Replica:
        if report is None:
            return rec
        new, entry = lc.judge(rec, report, ctx.policy, ctx.now)
        if entry is not None:
            entries.append(entry)
        return new

    pod = ctx.pod(rec.index)
    for handler, check in CHECKS:
        if targets(handler, rec):
            rec = feed(rec, check(ctx, rec, pod))
    if targets(lc.Handler.DRAIN, rec):
        rec = feed(rec, check_drain(ctx, rec, pod, drain_clock))
    return rec, entries


# -------------------------------------------------------------- membership


def _engines_ready(inst: GpuInstance, pod: PodView | None) -> bool:
    if pod is None:
        return False
    want = set(render.engine_names(inst))
    ready = {c.name for c in pod.containers if c.ready}
    return want <= ready


def _any_engine_ready(inst: GpuInstance, pod: PodView) -> bool:
    want = set(render.engine_names(inst))
    return any(c.ready for c in pod.containers if c.name in want)


def routable(ctx: Context, rec: lc.Replica) -> bool:
    """The readiness trap (docs/pod.md): routable unless nothing in the pod serves.

    Unless the pod has neither a front that can serve (an Active engine, or
    a failover within its hold) nor a ready engine container (Standby or
    Active), it stays routable: a restart of any one container — the killed
    engine, or a sidecar — never takes the pod out of the Service. A replica
    that is not Running (e.g. draining) is never routable.
    """
    pod = ctx.current_pod(rec)
    return bool(
        pod is not None
        and rec.phase is P.RUNNING
        and (pod.front_ready or _any_engine_ready(ctx.inst, pod))
    )


def updated(ctx: Context, rec: lc.Replica) -> bool:
    """The replica's pod has the current spec; one without a pod will get it."""
    pod = ctx.current_pod(rec)
    return pod is None or pod.spec_hash == ctx.want_hash


def available(ctx: Context, rec: lc.Replica) -> bool:
    """Ready (an engine serves, every engine armed) and in the Service: what a rollout waits for.

    Routable alone is not enough: a pod is routable as soon as one engine
    is Standby, before any engine serves. The pod's Ready condition includes
    the front's readiness (it can serve) and every engine's.
    """
    pod = ctx.current_pod(rec)
    if pod is None or not pod.ready or not routable(ctx, rec):
        return False
    listed = in_endpoints(ctx, pod)
    return listed if listed is not None else pod.routable_label == "true"


def member(ctx: Context, rec: lc.Replica) -> rollout.Member:
    return rollout.Member(
        index=rec.index,
        updated=updated(ctx, rec),
        available=available(ctx, rec),
        leaving=rec.phase in lc.LEAVING,
    )


def membership(
    ctx: Context, records: Mapping[int, lc.Replica], count: int
) -> tuple[dict[int, lc.Replica], list[EventSpec]]:
    """Add and retire replicas (scale, surge-first rollout) by ``rollout.moves``."""
    s = ctx.inst.spec
    members = {i: member(ctx, r) for i, r in records.items()}
    budget = rollout.Budget(count, s.rollout.max_surge, s.rollout.max_unavailable)
    moves = rollout.moves(list(members.values()), budget)
    out = dict(records)
    events: list[EventSpec] = []
    for i in moves.retire:
        why = "scaled down" if members[i].updated else "replaced by a pod of the current spec"
        out[i] = lc.retire(records[i], ctx.now)
        verb = "draining" if out[i].phase is P.DRAINING else "removing"
        reason = Reason.SCALED_DOWN if members[i].updated else Reason.SPEC_CHANGED
        events.append(EventSpec("Normal", reason, f"replica {i} {why}: {verb}"))
    for i in moves.add:
        out[i] = lc.Replica(index=i, since=ctx.now)
        events.append(EventSpec("Normal", Reason.SCALED_UP, f"replica {i} added"))
    return out, events


# ---------------------------------------------------------------- schedule


@dataclass(slots=True)
class Actions:
    """What one pass accumulates for the apply step."""

    creates: list[dict[str, Any]] = field(default_factory=list)
    deletes: list[Delete] = field(default_factory=list)
    events: list[EventSpec] = field(default_factory=list)
    entries: list[lc.HistoryEntry] = field(default_factory=list)


def placement_view(ctx: Context) -> dict[str, NodeInfo]:
    """Placement candidates, counting this instance's pods on each node."""
    nodes = {n.name: n for n in ctx.observed.nodes}
    for seen in ctx.observed.pods.values():
        if seen.node in nodes and not seen.deleting:
            n = nodes[seen.node]
            nodes[n.name] = replace(n, ours=n.ours + 1)
    return nodes


def schedule(
    ctx: Context, rec: lc.Replica, nodes: dict[str, NodeInfo], acts: Actions
) -> lc.Replica:
    """A Pending replica: fence off an older attempt's pod, else place a new attempt."""

    def feed(report: lc.Report) -> lc.Replica:
        new, entry = lc.judge(rec, report, ctx.policy, ctx.now)
        if entry is not None:
            acts.entries.append(entry)
        return new

    h, i = lc.Handler.SCHEDULE, rec.index
    name = render.pod_name(ctx.inst, i)
    pod = ctx.pod(i)
    if pod is not None and pod.attempt is not None and pod.attempt > rec.attempt:
        # A pod of a newer attempt than the record: this pass reads a status
        # older than the write that preceded the pod's creation. Never fence
        # it off; apply's resourceVersion precondition rejects this pass.
        msg = f"pod of newer attempt {pod.attempt}: status lags"
        return feed(_report(h, rec, lc.Outcome.SKIPPED, msg))
    if pod is not None:
        # Fencing: the previous attempt's pod goes before a new attempt starts.
        lost = _node_ok(pod, ctx.observed.node_ready) is False
        if not pod.deleting:
            reason = f"replica {i}: stale attempt {pod.attempt}"
            acts.deletes.append(Delete("Pod", name, reason, 0 if lost else None))
        elif lost:
            acts.deletes.append(Delete("Pod", name, f"replica {i}: force, node lost", 0))
        return feed(_report(h, rec, lc.Outcome.SKIPPED, "old pod terminating"))
    request = request_for(ctx.inst, ctx.cfg)
    placement = ctx.placer(request, list(nodes.values()))
    if not placement.feasible:
        return feed(_report(h, rec, lc.Outcome.FAILURE, placement.reason))
    rec = feed(lc.Report(h, i, rec.attempt, lc.Outcome.SUCCESS, placement.reason, placement.node))
    if rec.phase is P.SCHEDULED:
        acts.creates.append(render.render_pod(ctx.inst, i, rec.attempt, rec.node, ctx.cfg))
        if rec.node in nodes:
            n = nodes[rec.node]
            count = ctx.inst.spec.gpus.count
            nodes[n.name] = replace(n, ours=n.ours + 1, reserved=n.reserved + count)
    return rec


def leave(ctx: Context, rec: lc.Replica, acts: Actions) -> bool:
    """A Terminating replica: delete its pod gracefully; True once it is gone."""
    i = rec.index
    pod = ctx.pod(i)
    if pod is None:
        acts.events.append(EventSpec("Normal", Reason.REMOVED, f"replica {i} removed"))
        return True
    name = render.pod_name(ctx.inst, i)
    lost = _node_ok(pod, ctx.observed.node_ready) is False
    if not pod.deleting:
        grace = 0 if lost else ctx.inst.spec.drain.grace_period_seconds
        acts.deletes.append(Delete("Pod", name, f"replica {i} leaves", grace))
    elif lost:
        acts.deletes.append(Delete("Pod", name, f"replica {i}: force, node lost", 0))
    return False


def orphans(ctx: Context, records: Mapping[int, lc.Replica]) -> list[Delete]:
    """Pods that belong to no replica record (orphans of an older shape)."""
    known = {render.pod_name(ctx.inst, i) for i in records}
    return [
        Delete("Pod", seen.name, "no replica for this pod")
        for seen in ctx.observed.pods.values()
        if seen.name not in known and not seen.deleting
    ]


# ------------------------------------------------------------------ status


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


@dataclass(slots=True)
class Failovers:
    """The instance-wide failover tally, carried from replica to replica."""

    count: int
    last_time: str | None
    last_duration: float | None


def replica_status(
    ctx: Context,
    rec: lc.Replica,
    deleted: set[str],
    tally: Failovers,
    drain_clock: float | None,
    events: list[EventSpec],
) -> tuple[ReplicaStatus, LabelPatch | None]:
    """One replica's status entry and its routable label (a patch when it differs)."""
    i = rec.index
    name = render.pod_name(ctx.inst, i)
    pod = ctx.pod(i)
    current = ctx.current_pod(rec) if name not in deleted else None
    is_routable = current is not None and routable(ctx, rec)
    patch = None
    if pod is not None and not pod.deleting:
        want = "true" if is_routable else "false"
        if pod.routable_label != want:
            patch = LabelPatch(name, render.LABEL_ROUTABLE, want)
            reason = Reason.ROUTABLE if is_routable else Reason.NOT_ROUTABLE
            events.append(EventSpec("Normal", reason, f"pod {name} routable={want}"))
    prev = next((r for r in ctx.inst.status.replicas if r.index == i), None)
    active, view = _engine_summary(current)
    epoch = prev.epoch if prev is not None else None
    replica_failovers = prev.failovers if prev is not None else 0
    if active is not None and view is not None and view.epoch is not None:
        prev_active = prev.active_engine if prev is not None else None
        if epoch is not None and view.epoch > epoch and prev_active not in (None, active):
            replica_failovers += 1
            tally.count += 1
            tally.last_time = rfc3339(ctx.now)
            # Kill → Active: from the old holder's release when the lock
            # server told the engine, else (an older engine) from the grant.
            start = view.released_at if view.released_at is not None else view.granted_at
            if view.active_at is not None and start is not None:
                tally.last_duration = max(0.0, view.active_at - start)
            events.append(
                EventSpec(
                    "Warning",
                    Reason.FAILOVER,
                    f"replica {i}: {prev_active} -> {active} (epoch {epoch} -> {view.epoch})",
                )
            )
        epoch = view.epoch
    elif prev is not None and current is not None and not _engines_known(current):
        active = prev.active_engine  # unreachable /state: unknown, keep the last known
    status = ReplicaStatus(
        index=i,
        pod=name,
        phase=rec.phase,
        phase_since=rfc3339(rec.since),
        attempt=rec.attempt,
        retries=rec.retries,
        node=(current.node if current is not None and current.node else rec.node),
        active_engine=active,
        epoch=epoch,
        routable=is_routable,
        standby_ready=current is not None and _engines_ready(ctx.inst, current),
        failovers=replica_failovers,
        updated=updated(ctx, rec),
        pressure=(
            current.pressure.total if current is not None and current.pressure is not None else None
        ),
        unrouted_since=rfc3339(drain_clock) if drain_clock is not None else None,
    )
    return status, patch


# -------------------------------------------------------------------- plan


def plan(
    inst: GpuInstance,
    observed: Observed,
    now: float,
    cfg: render.RenderConfig | None = None,
    policy: lc.Policy | None = None,
    placer: Placer = select,
) -> Plan:
    cfg = cfg or render.RenderConfig()
    ctx = Context(
        inst=inst,
        observed=observed,
        now=now,
        cfg=cfg,
        policy=policy or policy_for(inst),
        want_hash=render.spec_hash(inst, cfg),
        placer=placer,
    )
    acts = Actions()
    records = load_records(inst, now)
    scale = autoscale(ctx, records)
    acts.events.extend(scale.events)

    # Observe: every check that targets a replica's phase reports; the drain
    # clock (first seen out of the endpoints) is carried in the status.
    before = {
        r.index: parse_rfc3339(r.unrouted_since) for r in inst.status.replicas if r.unrouted_since
    }
    clocks: dict[int, float | None] = {}
    for i in sorted(records):
        rec = records[i]
        clocks[i] = unrouted_since(ctx, rec, ctx.pod(i), before.get(i))
        records[i], entries = check_replica(ctx, rec, clocks[i])
        acts.entries.extend(entries)

    records, moved = membership(ctx, records, scale.target)
    acts.events.extend(moved)

    nodes = placement_view(ctx)
    for i in sorted(records):
        rec = records[i]
        if targets(lc.Handler.SCHEDULE, rec):
            records[i] = schedule(ctx, rec, nodes, acts)
        elif rec.phase is P.TERMINATING and leave(ctx, rec, acts):
            del records[i]
    acts.deletes.extend(orphans(ctx, records))

    deleted = {d.name for d in acts.deletes}
    tally = Failovers(
        inst.status.failovers,
        inst.status.last_failover_time,
        inst.status.last_failover_duration_seconds,
    )
    statuses: list[ReplicaStatus] = []
    labels: list[LabelPatch] = []
    for i in sorted(records):
        clock = clocks.get(i) if records[i].phase is P.DRAINING else None
        st, patch = replica_status(ctx, records[i], deleted, tally, clock, acts.events)
        statuses.append(st)
        if patch is not None:
            labels.append(patch)

    old_history = _history_in(inst)
    fresh = lc.accepted(old_history, acts.entries)
    history = lc.append_history(old_history, acts.entries)
    acts.events.extend(
        _event_of(e) for e in fresh if e.verdict is not lc.Verdict.SKIPPED or e.event
    )

    staying = [st for st in statuses if st.phase not in lc.LEAVING]
    serving = sum(1 for st in statuses if st.routable)
    armed = sum(1 for st in staying if st.standby_ready)
    conditions, cond_events = _conditions(ctx, records, serving, armed)
    acts.events.extend(cond_events)
    status = GpuInstanceStatus(
        phase=_phase(records, serving, inst.spec.replicas.ready_threshold),
        observed_generation=inst.metadata.generation,
        conditions=conditions,
        attempt=sum(r.attempt for r in records.values()),
        replicas=statuses,
        ready_replicas=serving,
        current_replicas=len(staying),
        updated_replicas=sum(1 for st in staying if st.updated),
        selector=f"{render.LABEL_INSTANCE}={inst.metadata.name}",
        autoscaler=scale.status,
        active=f"{sum(1 for r in statuses if r.active_engine)}/{scale.target}",
        failovers=tally.count,
        last_failover_time=tally.last_time,
        last_failover_duration_seconds=tally.last_duration,
        history=_history_out(history),
    )
    status_out = None
    if status != inst.status:
        status_out = status.model_dump(by_alias=True, mode="json", exclude_none=True)

    want_claim = render.render_claim(inst)
    if observed.claim is not None and observed.claim.get("spec") != want_claim["spec"]:
        name = want_claim["metadata"]["name"]
        acts.deletes.append(Delete(want_claim["kind"], name, "device request changed"))
    return Plan(
        ensure=(want_claim, render.render_service(inst)),
        create_pods=tuple(acts.creates),
        deletes=tuple(acts.deletes),
        labels=tuple(labels),
        status=status_out,
        events=tuple(acts.events),
        requeue_after=_requeue(inst, records, ctx.policy, now),
        scale=scale.target if scale.target != inst.spec.replicas.target else None,
        autoscale=scale.decision,
    )


_DEADLINES: Mapping[ReplicaPhase, str] = {
    P.SCHEDULED: "bind_timeout",
    P.STARTING: "start_timeout",
    P.UNKNOWN: "unknown_timeout",
    P.FAILED: "failed_backoff",
    P.DRAINING: "drain_timeout",
}


def _requeue(
    inst: GpuInstance, records: Mapping[int, lc.Replica], policy: lc.Policy, now: float
) -> float | None:
    """Seconds until this instance needs a pass that no watch event would trigger.

    Phase deadlines (expiry is judged when a pass runs), a draining replica
    (EndpointSlices are not watched), and fresh pressure for the autoscaler.
    """
    waits = []
    for r in records.values():
        budget = policy.budget(_DEADLINES.get(r.phase))
        if budget is not None:
            waits.append(max(0.0, r.since + budget - now) + 1.0)
        if r.phase is P.DRAINING:
            waits.append(DRAIN_PERIOD_S)
    if inst.spec.autoscaling.enabled:
        waits.append(PRESSURE_PERIOD_S)
    return min(waits) if waits else None


def _phase(records: Mapping[int, lc.Replica], serving: int, threshold: int) -> Phase:
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


def _conditions(
    ctx: Context,
    records: Mapping[int, lc.Replica],
    serving: int,
    armed: int,
) -> tuple[list[Condition], list[EventSpec]]:
    inst, now, generation = ctx.inst, ctx.now, ctx.inst.metadata.generation
    conds: list[Condition] = list(inst.status.conditions)
    events: list[EventSpec] = []
    threshold = inst.spec.replicas.ready_threshold
    live = [r for r in records.values() if r.phase not in lc.LEAVING]

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
    failed = sorted(r.index for r in live if r.phase is P.FAILED)
    lost = sorted(r.index for r in live if r.phase is P.UNKNOWN)
    if failed:
        put(ConditionType.DEGRADED, True, Reason.REPLICA_FAILED, f"replica(s) {failed} failed")
    elif lost:
        put(ConditionType.DEGRADED, True, Reason.NODE_LOST, f"replica(s) {lost} on a lost node")
    else:
        put(ConditionType.DEGRADED, False, Reason.AS_EXPECTED, "no replica failed or lost")
    return conds, events
