"""Membership and scheduling: how many replicas, which stay, where new ones go (pure).

* :func:`autoscale`: the replica count, the spec's or (``autoscaling.enabled``)
  the autoscaler core's decision from the fronts' pressure;
* :func:`membership`: ``rollout.moves`` adds and retires replicas (scale up
  and down, surge-first replacement of pods of an older spec); a serving
  replica leaves by draining (``lifecycle.retire``);
* :func:`place_and_leave`: Pending replicas are placed, a new attempt each,
  once any pod of an older attempt is fenced off; Terminating replicas have
  their pods deleted and go once the pods are gone; pods of no replica are
  deleted.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from understudy.operator import autoscaler as autoscale_core
from understudy.operator import lifecycle as lc
from understudy.operator import render, rollout
from understudy.operator.api import (
    AutoscalerStatus,
    GpuInstance,
    Recommendation,
    ReplicaPhase,
)
from understudy.operator.conditions import Reason, parse_rfc3339, rfc3339
from understudy.operator.scheduler import NodeInfo, Request, Toleration
from understudy.operator.view import Context, Delete, EventSpec, PodView

P = ReplicaPhase


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


def _overridden(ctx: Context, current: int) -> tuple[EventSpec, ...]:
    """Someone else wrote replicas.desired while the built-in autoscaler owns it."""
    prev = ctx.inst.status.autoscaler
    if prev is None or prev.desired_replicas == current:
        return ()
    return (
        EventSpec(
            "Warning",
            Reason.SCALE_OVERRIDDEN,
            f"replicas.desired is {current} but the built-in autoscaler set "
            f"{prev.desired_replicas}: while autoscaling.enabled it owns the field; "
            "point no HPA or KEDA at this instance",
        ),
    )


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
    state, decision = autoscale_core.decide(
        policy, _autoscaler_state(prev), pressures(ctx, records), current, ctx.now
    )
    events = _overridden(ctx, current)
    if decision.changed:
        events += (EventSpec("Normal", decision.reason, decision.message),)
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
    return Scale(decision.desired, status, decision, events)


# -------------------------------------------------------------- membership


def engines_ready(inst: GpuInstance, pod: PodView | None) -> bool:
    """Every engine container of the pod is ready (Standby or Active)."""
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
    listed = ctx.in_endpoints(pod)
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
) -> tuple[dict[int, lc.Replica], tuple[EventSpec, ...]]:
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
        out[i] = lc.Replica(index=i, since=ctx.now, policy=ctx.policy)
        events.append(EventSpec("Normal", Reason.SCALED_UP, f"replica {i} added"))
    return out, tuple(events)


# ---------------------------------------------------------------- schedule


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


def placement_view(ctx: Context) -> dict[str, NodeInfo]:
    """Placement candidates, counting this instance's pods on each node."""
    nodes = {n.name: n for n in ctx.observed.nodes}
    for seen in ctx.observed.pods.values():
        if seen.node in nodes and not seen.deleting:
            n = nodes[seen.node]
            nodes[n.name] = replace(n, ours=n.ours + 1)
    return nodes


def reserve(nodes: Mapping[str, NodeInfo], node: str | None, count: int) -> dict[str, NodeInfo]:
    """The candidates after a replica of ``count`` devices was placed on ``node``."""
    out = dict(nodes)
    if node in out:
        n = out[node]
        out[node] = replace(n, ours=n.ours + 1, reserved=n.reserved + count)
    return out


def fence(ctx: Context, index: int, pod: PodView) -> tuple[Delete, ...]:
    """Delete an older attempt's pod before a new attempt starts (force it off a lost node)."""
    name = render.pod_name(ctx.inst, index)
    lost = ctx.node_lost(pod)
    if not pod.deleting:
        reason = f"replica {index}: stale attempt {pod.attempt}"
        return (Delete("Pod", name, reason, 0 if lost else None),)
    if lost:
        return (Delete("Pod", name, f"replica {index}: force, node lost", 0),)
    return ()


@dataclass(frozen=True, slots=True)
class Scheduled:
    """A Pending replica after its turn: the record, what the lifecycle asked, what to delete."""

    record: lc.Replica
    actions: tuple[lc.Action, ...] = ()
    deletes: tuple[Delete, ...] = ()


def _stepped(
    ctx: Context, rec: lc.Replica, event: lc.Event, deletes: tuple[Delete, ...] = ()
) -> Scheduled:
    new, actions = lc.step(rec, event, ctx.now)
    return Scheduled(new, tuple(actions), deletes)


def schedule(ctx: Context, rec: lc.Replica, nodes: Mapping[str, NodeInfo]) -> Scheduled:
    """A Pending replica: fence off an older attempt's pod, else place a new attempt."""
    pod = ctx.pod(rec.index)
    if pod is not None and pod.attempt is not None and pod.attempt > rec.attempt:
        # A pod of a newer attempt than the record: this pass reads a status
        # older than the write that preceded the pod's creation. Never fence
        # it off; apply's resourceVersion precondition rejects this pass.
        msg = f"pod of newer attempt {pod.attempt}: status lags"
        return _stepped(ctx, rec, lc.Fencing(rec.attempt, msg))
    if pod is not None:
        fenced = fence(ctx, rec.index, pod)
        return _stepped(ctx, rec, lc.Fencing(rec.attempt, "old pod terminating"), fenced)
    placement = ctx.placer(request_for(ctx.inst, ctx.cfg), list(nodes.values()))
    if not placement.feasible:
        return _stepped(ctx, rec, lc.Unplaceable(rec.attempt, placement.reason))
    return _stepped(ctx, rec, lc.Placed(rec.attempt, placement.reason, placement.node))


@dataclass(frozen=True, slots=True)
class Left:
    """A Terminating replica after its turn: gone (its pod is), or deletes to make it so."""

    gone: bool
    deletes: tuple[Delete, ...] = ()
    events: tuple[EventSpec, ...] = ()


def leave(ctx: Context, rec: lc.Replica) -> Left:
    """A Terminating replica: delete its pod gracefully; gone once the pod is."""
    i = rec.index
    pod = ctx.pod(i)
    if pod is None:
        return Left(True, events=(EventSpec("Normal", Reason.REMOVED, f"replica {i} removed"),))
    name = render.pod_name(ctx.inst, i)
    lost = ctx.node_lost(pod)
    if not pod.deleting:
        grace = 0 if lost else ctx.inst.spec.drain.grace_period_seconds
        return Left(False, (Delete("Pod", name, f"replica {i} leaves", grace),))
    if lost:
        return Left(False, (Delete("Pod", name, f"replica {i}: force, node lost", 0),))
    return Left(False)


def orphans(ctx: Context, records: Mapping[int, lc.Replica]) -> tuple[Delete, ...]:
    """Pods that belong to no replica record (orphans of an older shape)."""
    known = {render.pod_name(ctx.inst, i) for i in records}
    return tuple(
        Delete("Pod", seen.name, "no replica for this pod")
        for seen in ctx.observed.pods.values()
        if seen.name not in known and not seen.deleting
    )


@dataclass(frozen=True, slots=True)
class Turnover:
    """The replicas after placement and removal, and what that takes."""

    records: dict[int, lc.Replica]
    actions: tuple[lc.Action, ...]  # the lifecycle's: history records, pods to create
    deletes: tuple[Delete, ...]
    events: tuple[EventSpec, ...]


def place_and_leave(ctx: Context, records: Mapping[int, lc.Replica]) -> Turnover:
    """In index order: place each Pending replica, remove each Terminating one; then orphans.

    Each placement reserves its devices in the candidates the next one sees.
    """
    nodes = placement_view(ctx)
    out = dict(records)
    actions: list[lc.Action] = []
    deletes: list[Delete] = []
    events: list[EventSpec] = []
    for i in sorted(records):
        rec = records[i]
        if lc.observes(rec.phase, lc.Check.SCHEDULE):
            done = schedule(ctx, rec, nodes)
            out[i] = done.record
            actions += done.actions
            deletes += done.deletes
            for a in done.actions:
                if isinstance(a, lc.CreatePod):
                    nodes = reserve(nodes, a.node, ctx.inst.spec.gpus.count)
        elif rec.phase is P.TERMINATING:
            left = leave(ctx, rec)
            deletes += left.deletes
            events += left.events
            if left.gone:
                del out[i]
    return Turnover(out, tuple(actions), (*deletes, *orphans(ctx, out)), tuple(events))
