"""The operator's own metrics (Prometheus naming: base units, ``_total`` counters)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import prometheus_client as prom

from understudy.operator.api import Phase
from understudy.operator.scheduler import NodeInfo, Placement, Request, select

RECONCILE_DURATION = prom.Histogram(
    "understudy_operator_reconcile_duration_seconds",
    "Duration of one reconcile pass (observe, plan, apply) of a GpuInstance.",
    ["trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
INSTANCES = prom.Gauge(
    "understudy_operator_instances",
    "GpuInstances in each phase, as the operator last reconciled them.",
    ["phase"],
)
RECONCILE_ERRORS = prom.Counter(
    "understudy_operator_reconcile_errors_total",
    "Reconcile passes that failed, by cause (conflict, api, unexpected).",
    ["cause"],
)
TRANSITIONS = prom.Counter(
    "understudy_operator_replica_transitions_total",
    "Replica lifecycle verdicts applied by the coordinator.",
    ["handler", "verdict"],
)
ACTIONS = prom.Counter(
    "understudy_operator_actions_total",
    "API writes made by the operator, by kind of action.",
    ["action"],
)
RESIZES = prom.Counter(
    "understudy_operator_resizes_total",
    "In-place resizes of a pod's engine containers after a failover, by result "
    "(done, refused: the pod keeps its old requests).",
    ["result"],
)
SCHEDULER_DECISION = prom.Histogram(
    "understudy_scheduler_decision_seconds",
    "Time to place one replica: filters and scorers over every candidate node.",
    ["strategy", "result"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
SCHEDULER_CANDIDATES = prom.Gauge(
    "understudy_scheduler_candidate_nodes",
    "Nodes the last placement decision looked at.",
)
AUTOSCALER_DESIRED = prom.Gauge(
    "understudy_autoscaler_desired_replicas",
    "Replica count the built-in autoscaler decided.",
    ["namespace", "instance"],
)
AUTOSCALER_PRESSURE = prom.Gauge(
    "understudy_autoscaler_pressure",
    "Requests in flight or held over every replica, as the fronts report them.",
    ["namespace", "instance"],
)
AUTOSCALER_DECISIONS = prom.Counter(
    "understudy_autoscaler_decisions_total",
    "Autoscaler decisions, by reason (ScaleUp, ScaleDown, Idle, Stabilizing, ...).",
    ["reason"],
)
CACHE_EVENTS = prom.Gauge(
    "understudy_operator_cache_events",
    "Watch events the scheduler's caches applied since start, by kind.",
    ["kind"],
)


class PhaseBook:
    """Each GpuInstance's last phase, counted into ``understudy_operator_instances``
    (every phase has a series, 0 included, so a panel shows a phase emptying)."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}
        self._publish()

    def record(self, key: tuple[str, str], phase: str) -> None:
        self._phases[key] = phase
        self._publish()

    def forget(self, key: tuple[str, str]) -> None:
        self._phases.pop(key, None)
        self._publish()

    def _publish(self) -> None:
        counts = dict.fromkeys([p.value for p in Phase], 0)
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            INSTANCES.labels(phase).set(n)


PHASES = PhaseBook()


def timed_select(req: Request, nodes: Sequence[NodeInfo]) -> Placement:
    """The scheduler's ``select``, observed into ``understudy_scheduler_decision_seconds``."""
    started = time.perf_counter()
    placement = select(req, nodes)
    elapsed = time.perf_counter() - started
    result = "feasible" if placement.feasible else "infeasible"
    SCHEDULER_DECISION.labels(str(req.strategy), result).observe(elapsed)
    SCHEDULER_CANDIDATES.set(len(nodes))
    return placement
