"""The operator's own metrics (Prometheus naming: base units, ``_total`` counters)."""

from __future__ import annotations

import prometheus_client as prom

RECONCILE_DURATION = prom.Histogram(
    "understudy_operator_reconcile_duration_seconds",
    "Duration of one reconcile pass (observe, plan, apply) of a GpuInstance.",
    ["trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
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
