"""The checks: what a pass sees of each replica's pod, reported to the lifecycle (pure).

Each check looks at one replica's pod and returns a lifecycle event record
(``Bound``, ``Unbound``, ``PodLost``, ...) or None when it has nothing to
say. It runs only in the phases where the lifecycle table takes its events
(``lifecycle.observes``); the table's handlers decide what a report means.
Placement, the check that creates pods, lives with scheduling
(``membership.py``).

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from understudy.operator import lifecycle as lc
from understudy.operator.api import GpuInstance, ReplicaPhase
from understudy.operator.conditions import parse_rfc3339
from understudy.operator.view import Context, PodView

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


def policy_for(inst: GpuInstance) -> lc.Policy:
    s = inst.spec
    return lc.Policy(
        start_timeout=s.failover.startup_budget_seconds + 300.0,
        drain_timeout=float(s.drain.timeout_seconds + s.drain.settle_seconds),
    )


def load_records(inst: GpuInstance, policy: lc.Policy, now: float) -> dict[int, lc.Replica]:
    """The replica records from ``status.replicas``; a new generation resets Failed."""
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
            policy=policy,
        )
        out[r.index] = lc.reset(rec, now) if new_generation else rec
    return out


# ------------------------------------------------------------------ checks


def check_presence(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Event | None:
    a = rec.attempt
    if pod is None:
        return lc.PodLost(a, "pod is gone")
    if pod.attempt != rec.attempt:
        return lc.PodLost(a, f"pod is of attempt {pod.attempt}")
    if pod.deleting:
        return lc.PodLost(a, "pod is being deleted")
    if pod.phase in ("Failed", "Succeeded"):
        return lc.PodLost(a, f"pod {pod.phase}")
    return lc.PodPresent(a, "pod present")


def check_node(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Event | None:
    if pod is None or pod.attempt is None:  # no pod of any attempt: nothing to say
        return None
    a = pod.attempt
    if ctx.node_lost(pod):
        return lc.NodeLost(a, f"node {pod.node} lost")
    return lc.NodeReady(a, "node ready")


def check_bind(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Event | None:
    if pod is None or pod.attempt is None:  # no pod of any attempt: nothing to say
        return None
    a = pod.attempt
    if pod.node is not None:
        return lc.Bound(a, f"bound to {pod.node}")
    if pod.unschedulable:
        return lc.Unschedulable(a, pod.unschedulable)
    return lc.Unbound(a, "waiting for kube-scheduler")


def check_start(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Event | None:
    if pod is None or pod.attempt is None:  # no pod of any attempt: nothing to say
        return None
    a = pod.attempt
    if pod.phase == "Running":
        return lc.Started(a, "pod running")
    failing = sorted(
        f"{c.name}: {c.waiting_reason}"
        for c in pod.containers
        if c.waiting_reason in FAILING_WAIT_REASONS
    )
    if failing:
        return lc.StartFailed(a, ", ".join(failing))
    return lc.NotStarted(a, "containers starting")


def check_recover(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Event | None:
    if pod is None or pod.attempt is None:  # no pod of any attempt: nothing to say
        return None
    a = pod.attempt
    if not ctx.node_lost(pod) and pod.phase == "Running":
        return lc.NodeBack(a, "node back")
    return lc.StillLost(a, f"node {pod.node} still lost")


def check_retry_failed(ctx: Context, rec: lc.Replica, pod: PodView | None) -> lc.Event | None:
    return lc.BackingOff(rec.attempt, "backing off")


def unrouted_since(
    ctx: Context, rec: lc.Replica, pod: PodView | None, before: float | None
) -> float | None:
    """Draining: when the pod was first seen out of the endpoints (None: not yet)."""
    if rec.phase is not P.DRAINING or pod is None:
        return None
    if ctx.inst.spec.gateway is not None:
        # Nothing to wait for: the gateway lists every pod until it terminates
        # (the pods' headless Service), then sends it nothing new and lets its
        # requests finish there (docs/gateway.md, planned removal).
        return before if before is not None else ctx.now
    listed = ctx.in_endpoints(pod)
    if listed:
        return None
    if listed is None:  # endpoints unreadable: count from the unrouting itself
        return rec.since
    return before if before is not None else ctx.now


def check_drain(
    ctx: Context, rec: lc.Replica, pod: PodView | None, since: float | None
) -> lc.Event | None:
    if pod is None:
        return None
    a = rec.attempt
    if since is None:
        return lc.NotDrained(a, "still in the Service's endpoints")
    settle = ctx.inst.spec.drain.settle_seconds
    if ctx.inst.spec.gateway is not None:
        out = "left to the gateway (it drains a terminating pod)"
        if ctx.now - since < settle:
            return lc.NotDrained(a, f"{out}, settling {settle} s")
        return lc.Drained(a, out)
    if ctx.now - since < settle:
        return lc.NotDrained(a, f"out of the endpoints, settling {settle} s")
    return lc.Drained(a, "out of the Service's endpoints")


Check = Callable[[Context, lc.Replica, PodView | None], lc.Event | None]

# The checks in the order they run; each runs only in the phases where the
# lifecycle table takes its events. DRAIN runs last, apart, because it also
# needs the drain clock.
CHECKS: tuple[tuple[lc.Check, Check], ...] = (
    (lc.Check.PRESENCE, check_presence),
    (lc.Check.NODE, check_node),
    (lc.Check.BIND, check_bind),
    (lc.Check.START, check_start),
    (lc.Check.RECOVER, check_recover),
    (lc.Check.RETRY_FAILED, check_retry_failed),
)


def _fed(rec: lc.Replica, event: lc.Event | None, now: float) -> tuple[lc.Replica, list[lc.Action]]:
    return (rec, []) if event is None else lc.step(rec, event, now)


def check_replica(
    ctx: Context, rec: lc.Replica, drain_clock: float | None
) -> tuple[lc.Replica, list[lc.Action]]:
    """Run, in order, every check the replica's phase takes; step the lifecycle with each report.

    A report can move the replica, so each check asks about the phase the
    previous one left.
    """
    actions: list[lc.Action] = []
    pod = ctx.pod(rec.index)
    for check, run in CHECKS:
        if lc.observes(rec.phase, check):
            rec, more = _fed(rec, run(ctx, rec, pod), ctx.now)
            actions += more
    if lc.observes(rec.phase, lc.Check.DRAIN):
        rec, more = _fed(rec, check_drain(ctx, rec, pod, drain_clock), ctx.now)
        actions += more
    return rec, actions


@dataclass(frozen=True, slots=True)
class Checked:
    """Every replica after its checks, what the lifecycle asked for, and the drain clocks."""

    records: dict[int, lc.Replica]
    actions: tuple[lc.Action, ...]
    clocks: Mapping[int, float | None]


def check_all(ctx: Context, records: Mapping[int, lc.Replica]) -> Checked:
    """Check every replica, in index order.

    The drain clock (when a draining pod was first seen out of the endpoints)
    is carried in ``status.replicas[].unroutedSince``, so a drain survives an
    operator restart.
    """
    before = {
        r.index: parse_rfc3339(r.unrouted_since)
        for r in ctx.inst.status.replicas
        if r.unrouted_since
    }
    out: dict[int, lc.Replica] = {}
    clocks: dict[int, float | None] = {}
    actions: list[lc.Action] = []
    for i in sorted(records):
        rec = records[i]
        clocks[i] = unrouted_since(ctx, rec, ctx.pod(i), before.get(i))
        out[i], more = check_replica(ctx, rec, clocks[i])
        actions += more
    return Checked(out, tuple(actions), clocks)
