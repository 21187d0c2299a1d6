"""``plan(instance, observed, now) -> Plan``: the whole reconcile decision (pure).

The shell (``handlers.py``) gathers :class:`~understudy.operator.view.Observed`
(``observe.py``), calls :func:`plan`, and hands the
:class:`~understudy.operator.view.Plan` to ``apply.py``. Nothing here depends
on which kopf event fired: create, update, resume, the timer and pod events
all run the same level-based pass, whose outcome depends on what is observed,
not on which events arrived.

One pass, each step a function of its own module:

1. ``checks.load_records``: the replica records from ``status.replicas``; a
   new generation gives Failed replicas another chance;
2. ``membership.autoscale``: the replica count (with ``autoscaling.enabled``
   the autoscaler core's, written back to ``replicas.desired``);
3. ``checks.check_all``: every check the lifecycle table takes in a replica's
   phase reports on its pod, and ``lifecycle.step`` judges each report;
4. ``membership.membership``: ``rollout.moves`` adds and retires replicas;
5. ``membership.place_and_leave``: Pending replicas are placed (after
   fencing), Terminating ones deleted, orphan pods removed;
6. the lifecycle's actions are carried out here (:func:`carry_out`): its
   records become the history, its ``CreatePod`` the pods;
7. ``status``: every replica's status and routable label, the history, the
   conditions and the instance's phase;
8. ``resize.resizes``: engine containers whose requests no longer match their
   role since a failover are resized in place;
9. :func:`requeue`: when the next pass is due if no watch event comes first.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, assert_never

from understudy.operator import lifecycle as lc
from understudy.operator import render, resize
from understudy.operator.api import GpuInstance, ReplicaPhase
from understudy.operator.checks import check_all, load_records, policy_for
from understudy.operator.membership import autoscale, membership, place_and_leave
from understudy.operator.scheduler import select
from understudy.operator.status import instance_status, replica_statuses
from understudy.operator.view import Context, Delete, Observed, Placer, Plan

P = ReplicaPhase

# How often an autoscaled instance is re-planned to read fresh pressure.
PRESSURE_PERIOD_S = 5.0
# How often a draining replica is re-checked (EndpointSlice changes fire no event here).
DRAIN_PERIOD_S = 0.5


def plan(
    inst: GpuInstance,
    observed: Observed,
    now: float,
    cfg: render.RenderConfig | None = None,
    policy: lc.Policy | None = None,
    placer: Placer = select,
) -> Plan:
    cfg = cfg or render.RenderConfig()
    policy = policy or policy_for(inst)
    ctx = Context(inst, observed, now, cfg, policy, render.spec_hash(inst, cfg), placer)
    records = load_records(inst, policy, now)
    scale = autoscale(ctx, records)
    checked = check_all(ctx, records)
    members, moved = membership(ctx, checked.records, scale.target)
    turnover = place_and_leave(ctx, members)
    entries, pods = carry_out(ctx, (*checked.actions, *turnover.actions))
    deleted = frozenset(d.name for d in turnover.deletes)
    replicas = replica_statuses(ctx, turnover.records, deleted, checked.clocks)
    built = instance_status(ctx, turnover.records, replicas, entries, scale.target, scale.status)
    status_out = None
    if built.status != inst.status:
        status_out = built.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    want_claim = render.render_claim(inst)
    return Plan(
        ensure=(want_claim, render.render_service(inst), *render.render_gateway(inst, cfg)),
        create_pods=pods,
        deletes=(
            *turnover.deletes,
            *claim_changed(observed, want_claim),
            *gateway_removed(inst, observed),
        ),
        labels=built.labels,
        status=status_out,
        events=(*scale.events, *moved, *turnover.events, *built.events),
        requeue_after=requeue(inst, turnover.records.values(), now),
        scale=scale.target if scale.target != inst.spec.replicas.target else None,
        autoscale=scale.decision,
        resizes=resize.resizes(ctx, replicas.statuses),
    )


def carry_out(
    ctx: Context, actions: Sequence[lc.Action]
) -> tuple[tuple[lc.HistoryEntry, ...], tuple[dict[str, Any], ...]]:
    """The lifecycle's actions: the history entries to keep, and the pods to create."""
    entries: list[lc.HistoryEntry] = []
    pods: list[dict[str, Any]] = []
    for action in actions:
        match action:
            case lc.Record(entry):
                entries.append(entry)
            case lc.CreatePod(index, attempt, node):
                pods.append(render.render_pod(ctx.inst, index, attempt, node, ctx.cfg))
            case _:
                assert_never(action)
    return tuple(entries), tuple(pods)


def claim_changed(observed: Observed, want: Mapping[str, Any]) -> tuple[Delete, ...]:
    """The claim (template) is immutable: a changed device request replaces it."""
    if observed.claim is None or observed.claim.get("spec") == want["spec"]:
        return ()
    return (Delete(want["kind"], want["metadata"]["name"], "device request changed"),)


def gateway_removed(inst: GpuInstance, observed: Observed) -> tuple[Delete, ...]:
    """A gateway whose section is gone goes whole (its Service back to the pods:
    ``render_service``); the garbage collector would only take it with the instance."""
    if inst.spec.gateway is not None or not observed.gateway:
        return ()
    return tuple(
        Delete(kind, name, "gateway section removed", api_version=version)
        for version, kind, name in render.gateway_objects(inst)
    )


def requeue(inst: GpuInstance, records: Iterable[lc.Replica], now: float) -> float | None:
    """Seconds until this instance needs a pass that no watch event would trigger.

    Phase deadlines (``lifecycle.deadline``: expiry is judged when a pass
    runs), a draining replica (EndpointSlices are not watched), and fresh
    pressure for the autoscaler.
    """
    waits = []
    for r in records:
        due = lc.deadline(r)
        if due is not None:
            waits.append(max(0.0, due - now) + 1.0)
        if r.phase is P.DRAINING:
            waits.append(DRAIN_PERIOD_S)
    if inst.spec.autoscaling.enabled:
        waits.append(PRESSURE_PERIOD_S)
    return min(waits) if waits else None
