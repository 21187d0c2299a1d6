#!/usr/bin/env python3
"""Understudy's Grafana dashboards, as code (grafana-foundation-sdk).

    hack/monitoring/dashboards.py          # write charts/understudy/dashboards/*.json
    hack/monitoring/dashboards.py --check  # exit 1 if a committed file differs

The chart ships the JSON files as ConfigMaps for Grafana's dashboard sidecar
(and they import as plain files). A unit test runs ``--check``, the dashboard
linter runs on every file, and a process test evaluates every panel query
against a real Prometheus that scraped a local pod during a drill
(docs/monitoring.md).

Label contract (docs/monitoring.md): every series of a pod carries the
target labels ``namespace``, ``pod`` and ``understudy_dev_instance`` (the
GpuInstance: the chart's PodMonitor copies the pod label
``understudy.dev/instance``), plus Prometheus's own ``job`` and
``instance`` (the scrape target). The dashboard linter reserves the variable
names ``job`` and ``instance`` for those two, so the GpuInstance variable is
``gpuinstance``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus as prom_model

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "charts" / "understudy" / "dashboards"

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="$datasource")
# Every selector of the pod dashboard; the linter wants job and instance in each.
POD = (
    'namespace=~"$namespace", understudy_dev_instance=~"$gpuinstance", pod=~"$pod", '
    'job=~"$job", instance=~"$instance"'
)
# The operator is one Deployment: no pod labels of a GpuInstance.
OPERATOR = 'job=~"$job", instance=~"$instance"'
QUANTILES = (0.5, 0.95, 0.99)


# ------------------------------------------------------------- variables --


def _datasource_variable() -> dash.DatasourceVariable:
    return dash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def _query_variable(name: str, label: str, query: str) -> dash.QueryVariable:
    return (
        dash.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DATASOURCE)
        .multi(True)
        .include_all(True)
        .all_value(".+")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .current(model.VariableOption(selected=True, text="All", value="$__all"))
    )


def _pod_variables(
    # one series per pod, from a sidecar that outlives engines
    anchor: str = "understudy_front_routing",
) -> list[dash.DatasourceVariable | dash.QueryVariable]:
    return [
        _datasource_variable(),
        _query_variable("namespace", "Namespace", f"label_values({anchor}, namespace)"),
        _query_variable(
            "gpuinstance",
            "GpuInstance",
            f'label_values({anchor}{{namespace=~"$namespace"}}, understudy_dev_instance)',
        ),
        _query_variable(
            "pod",
            "Pod",
            f'label_values({anchor}{{namespace=~"$namespace", '
            f'understudy_dev_instance=~"$gpuinstance"}}, pod)',
        ),
        _query_variable(
            "job",
            "Job",
            'label_values({__name__=~"understudy_.+", namespace=~"$namespace", pod=~"$pod"}, job)',
        ),
        _query_variable(
            "instance",
            "Instance",
            'label_values({__name__=~"understudy_.+", namespace=~"$namespace", pod=~"$pod", '
            'job=~"$job"}, instance)',
        ),
    ]


def _operator_variables() -> list[dash.DatasourceVariable | dash.QueryVariable]:
    anchor = "understudy_operator_reconcile_duration_seconds_count"
    return [
        _datasource_variable(),
        _query_variable("job", "Job", f"label_values({anchor}, job)"),
        _query_variable("instance", "Instance", f'label_values({anchor}{{job=~"$job"}}, instance)'),
    ]


# ---------------------------------------------------------------- queries --


def _target(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()


def _refs(n: int) -> list[str]:
    return [chr(ord("A") + i) for i in range(n)]


def _quantiles(metric: str, selector: str, window: str, by: str = "") -> list[tuple[str, str]]:
    """histogram_quantile of ``metric`` at each of QUANTILES: (expr, legend)."""
    keep = f"{by}, le" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        (
            f"histogram_quantile({q:g}, sum by ({keep}) "
            f"(rate({metric}_bucket{{{selector}}}[{window}])))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in QUANTILES
    ]


# ----------------------------------------------------------------- panels --


def _series(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    *,
    width: int = 12,
    height: int = 8,
    min_value: float | None = 0,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
    )
    if min_value is not None:
        panel = panel.min(min_value)
    for (expr, legend), ref in zip(queries, _refs(len(queries)), strict=True):
        panel = panel.with_target(_target(expr, legend, ref))
    return panel


def _steps(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps([model.Threshold(value=v, color=c) for v, c in steps])
    )


def _stat(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    thresholds: dash.ThresholdsConfig,
    *,
    width: int = 6,
    instant: bool = False,
) -> stat.Panel:
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(5)
        .thresholds(thresholds)
        .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.THRESHOLDS))
    )
    for (expr, legend), ref in zip(queries, _refs(len(queries)), strict=True):
        target = _target(expr, legend, ref)
        panel = panel.with_target(target.instant() if instant else target)
    return panel


def _heatmap(title: str, description: str, metric: str, selector: str) -> heatmap.Panel:
    expr = f"sum by (le) (increase({metric}_bucket{{{selector}}}[$__rate_interval]))"
    return (
        heatmap.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(12)
        .height(8)
        .calculate(False)
        .with_target(
            prometheus.Dataquery()
            .expr(expr)
            .legend_format("{{le}}")
            .ref_id("A")
            .format(prom_model.PromQueryFormat.HEATMAP)
            .range()
        )
    )


# The engine states (engine_shim/fsm.py State) as numbers for a state
# timeline, with the colour each shows in.
STATES = (
    ("Init", "blue"),
    ("Standby", "yellow"),
    ("Waking", "orange"),
    ("Active", "green"),
    ("Draining", "purple"),
    ("Dead", "red"),
)


def _state_timeline(selector: str) -> statetimeline.Panel:
    """One row per engine: its state over time (a killed engine's row breaks
    off, its restart starts in Init)."""
    codes = " or ".join(
        f'understudy_engine_state{{state="{name}", {selector}}} * {i}'
        for i, (name, _) in enumerate(STATES, start=1)
    )
    expr = f"max by (namespace, pod, engine) ({codes})"
    mapping = model.ValueMap(
        options={
            str(i): model.ValueMappingResult(text=name, color=color, index=i - 1)
            for i, (name, color) in enumerate(STATES, start=1)
        }
    )
    return (
        statetimeline.Panel()
        .title("Engine state timeline")
        .description(
            "Each engine's state over time: Init, Standby, Waking, Active (green), "
            "Draining, Dead. A failover shows as one engine's Active ending and the "
            "standby's Waking then Active; the killed engine comes back in Init."
        )
        .datasource(DATASOURCE)
        .unit("none")
        .span(24)
        .height(8)
        .mappings([mapping])
        .with_target(_target(expr, "{{pod}} {{engine}}", "A"))
    )


# ------------------------------------------------------------ dashboards --


def failover() -> dash.Dashboard:
    """One pod's (or a fleet's) failover story: is it serving, how long the
    gaps are, what the lock did, what clients felt, what GMS holds."""
    sel = POD
    # Red for an outage (0) and for split brain (> 1): one Active engine is the only good value.
    one_active = _steps((None, "red"), (1, "green"), (2, "red"))
    armed = _steps((None, "red"), (1, "green"))
    gap = "understudy_front_failover_gap_seconds"
    board = (
        dash.Dashboard("Understudy failover")
        .uid("understudy-failover")
        .description(
            "Failover of Understudy pods: Active and standby engines, the client-visible "
            "gap, detection, wake and re-arm times, the lock, held and migrated requests, "
            "poison isolation, GMS."
        )
        .tags(["understudy", "failover"])
        .readonly()
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .variables(list(_pod_variables()))
        .with_row(dash.Row("Is it serving?"))
        .with_panel(
            _stat(
                "Active engines per pod",
                "Engines in state Active in each pod. Exactly 1 is healthy: 0 is an outage "
                "(requests are held, then answered 503), more than 1 is split brain.",
                "none",
                [
                    (
                        "sum by (namespace, pod) "
                        f'(understudy_engine_state{{state="Active", {sel}}})',
                        "{{pod}}",
                    )
                ],
                one_active,
                width=6,
                instant=True,
            )
        )
        .with_panel(
            _stat(
                "Standbys ready per GpuInstance",
                "Engines asleep in Standby, ready to take over, summed per GpuInstance. "
                "0 means the next engine death is a cold restart.",
                "none",
                [
                    (
                        "sum by (namespace, understudy_dev_instance) "
                        f'(understudy_engine_state{{state="Standby", {sel}}})',
                        "{{understudy_dev_instance}}",
                    )
                ],
                armed,
                width=6,
                instant=True,
            )
        )
        .with_panel(
            _stat(
                "Time without a standby",
                "Seconds of the dashboard's time range in which a GpuInstance had no "
                "engine in Standby (sampled every 10 s): while a killed engine restarts, "
                "the next death would find no shadow. A vLLM engine takes a minute or two "
                "to start again (its imports), so a vLLM GpuInstance wants two shadows.",
                "s",
                [
                    (
                        "sum_over_time(((sum by (namespace, understudy_dev_instance) "
                        f'(understudy_engine_state{{state="Standby", {sel}}})) == bool 0)'
                        "[$__range:10s]) * 10",
                        "{{understudy_dev_instance}}",
                    )
                ],
                _steps((None, "green"), (1, "yellow"), (60, "red")),
                width=6,
                instant=True,
            )
        )
        .with_panel(
            _stat(
                "Front has a route",
                "1 while the pod's front door has an Active engine to route to, per pod. "
                "The front outlives the engines, so this is the outage signal alerts use.",
                "none",
                [(f"min by (namespace, pod) (understudy_front_routing{{{sel}}})", "{{pod}}")],
                armed,
                width=6,
                instant=True,
            )
        )
        .with_panel(
            _series(
                "Engines per state",
                "How many engines are in each state (Init, Standby, Waking, Active, "
                "Draining, Dead) over time.",
                "none",
                [(f"sum by (state) (understudy_engine_state{{{sel}}})", "{{state}}")],
            )
        )
        .with_panel(
            _series(
                "Active engines per pod over time",
                "Active engines per pod: 1 is healthy, 0 an outage, more than 1 split brain. "
                "A killed engine's last sample lingers until the next failed scrape.",
                "none",
                [
                    (
                        "sum by (namespace, pod) "
                        f'(understudy_engine_state{{state="Active", {sel}}})',
                        "{{pod}}",
                    )
                ],
            )
        )
        .with_panel(_state_timeline(sel))
        .with_row(dash.Row("Failover latency"))
        .with_panel(
            _stat(
                "Client-visible gap over the time range",
                "Percentiles of the failover gap clients saw (the front: route lost to the "
                "first answer of the next engine), over the dashboard's time range.",
                "s",
                [
                    (
                        f"histogram_quantile({q:g}, sum by (le) "
                        f"(increase({gap}_bucket{{{sel}}}[$__range])))",
                        f"p{round(q * 100)}",
                    )
                    for q in QUANTILES
                ],
                _steps((None, "green"), (1, "red")),
                width=12,
                instant=True,
            )
        )
        .with_panel(
            _stat(
                "Failovers over the time range",
                "Handovers the lock server granted (a new engine after the holder died). "
                "Counted durably: the count survives the lock server's restart.",
                "none",
                [
                    (
                        f"sum (increase(understudy_lock_handovers_total{{{sel}}}[$__range]))",
                        "failovers",
                    )
                ],
                _steps((None, "green"), (3, "orange")),
                width=12,
                instant=True,
            )
        )
        .with_panel(
            _series(
                "Client-visible failover gap",
                "p50 / p95 / p99 of the gap clients see in a failover (front: route lost "
                "to the first answer of the next engine).",
                "s",
                _quantiles(gap, sel, "$__rate_interval"),
            )
        )
        .with_panel(
            _heatmap(
                "Failover gap distribution",
                "Heatmap of the client-visible failover gap buckets.",
                gap,
                sel,
            )
        )
        .with_panel(
            _series(
                "Detection: kill to grant",
                "Front: route lost (the holder's release, or a hung engine's last heartbeat) "
                "to the next grant. Lock server: the holder's connection closing to the "
                "next grant (durable across lock server restarts).",
                "s",
                [
                    (e, f"front {lg}")
                    for e, lg in _quantiles(
                        "understudy_front_detection_seconds", sel, "$__rate_interval"
                    )
                ]
                + [
                    (e, f"lock {lg}")
                    for e, lg in _quantiles(
                        "understudy_lock_handover_seconds", sel, "$__rate_interval"
                    )
                ],
            )
        )
        .with_panel(
            _series(
                "Grant to Active",
                "From the lock grant to serving, seen by the new Active engine, and its "
                "wake phase (remap the weights, allocate the KV cache).",
                "s",
                _quantiles(
                    "understudy_failover_duration_seconds",
                    f'phase="grant_to_active", {sel}',
                    "$__rate_interval",
                )
                + [
                    (e, f"wake {lg}")
                    for e, lg in _quantiles(
                        "understudy_failover_duration_seconds",
                        f'phase="wake", {sel}',
                        "$__rate_interval",
                    )
                ],
            )
        )
        .with_panel(
            _series(
                "Re-arm: failover to a standby again",
                "Lock server: a handover (the old engine's death) to the next engine queueing "
                "for the lock, the pod armed again (durable), p50 / p95 / p99. Engine: a "
                "restarted engine's own start to Standby with the weights imported from GMS, p99.",
                "s",
                [
                    *_quantiles("understudy_lock_rearm_seconds", sel, "$__rate_interval"),
                    (
                        "histogram_quantile(0.99, sum by (le) (rate("
                        "understudy_engine_init_duration_seconds_bucket"
                        f'{{weights="imported", {sel}}}[$__rate_interval])))',
                        "engine start to Standby p99",
                    ),
                ],
            )
        )
        .with_panel(
            _series(
                "Failover phases seen by the new engine (p99)",
                "p99 of each phase the new Active engine measured: detect (the old holder's "
                "release to our grant), wake, serve (bind the serving socket), grant_to_active.",
                "s",
                [
                    (
                        "histogram_quantile(0.99, sum by (phase, le) "
                        "(rate(understudy_failover_duration_seconds_bucket"
                        f"{{{sel}}}[$__rate_interval])))",
                        "{{phase}}",
                    )
                ],
            )
        )
        .with_row(dash.Row("Lock"))
        .with_panel(
            _series(
                "Lock epoch",
                "The fencing token: the highest epoch granted per pod. Every failover raises it.",
                "none",
                [(f"max by (namespace, pod) (understudy_lock_epoch{{{sel}}})", "{{pod}}")],
                width=8,
                min_value=None,
            )
        )
        .with_panel(
            _series(
                "Grants, handovers and reissues",
                "Lock grants (resumed: the same holder back after a lock server restart), "
                "handovers to a new engine, and resumes reissued under a new epoch. Durable "
                "counters kept in the lock's state file.",
                "none",
                [
                    (
                        "sum by (resumed) (increase(understudy_lock_grants_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "grants resumed={{resumed}}",
                    ),
                    (
                        "sum (increase(understudy_lock_handovers_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "handovers",
                    ),
                    (
                        "sum (increase(understudy_lock_reissues_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "reissues",
                    ),
                ],
                width=8,
            )
        )
        .with_panel(
            _series(
                "Reconnect window and waiters",
                "1 while a restarted lock server waits for its persisted holder; waiters are "
                "standbys blocked in acquire; closed windows by reason.",
                "none",
                [
                    (
                        f"max by (namespace, pod) (understudy_lock_window_open{{{sel}}})",
                        "window open {{pod}}",
                    ),
                    (
                        f"sum by (namespace, pod) (understudy_lock_waiters{{{sel}}})",
                        "waiters {{pod}}",
                    ),
                    (
                        "sum by (reason) (increase(understudy_lock_window_closed_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "closed {{reason}}",
                    ),
                ],
                width=8,
            )
        )
        .with_row(dash.Row("Requests"))
        .with_panel(
            _series(
                "Held requests",
                "Requests the front is holding while no engine is Active, and how many "
                "per second had to wait.",
                "none",
                [
                    (
                        f"sum by (namespace, pod) (understudy_front_requests_held{{{sel}}})",
                        "held now {{pod}}",
                    ),
                    (
                        "sum (rate(understudy_front_held_requests_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "held per second",
                    ),
                ],
                width=8,
            )
        )
        .with_panel(
            _series(
                "Migrated requests",
                "Requests moved to the next Active engine per second: new (replayed whole) "
                "and ongoing (a stream continued token-exact); failed migrations by reason.",
                "reqps",
                [
                    (
                        "sum by (kind) (rate(understudy_front_migrations_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "{{kind}}",
                    ),
                    (
                        "sum by (reason) (rate(understudy_front_migrations_failed_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "failed {{reason}}",
                    ),
                ],
                width=8,
            )
        )
        .with_panel(
            _series(
                "Requests by status",
                "Answers of the front per second by HTTP status class, and holds that "
                "expired (503 after the hold).",
                "reqps",
                [
                    (
                        "sum by (code) (rate(understudy_front_requests_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "{{code}}",
                    ),
                    (
                        "sum (rate(understudy_front_hold_expired_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "hold expired",
                    ),
                ],
                width=8,
            )
        )
        .with_panel(
            _series(
                "Hold time",
                "How long held requests waited for an Active engine, p50 / p95 / p99.",
                "s",
                _quantiles("understudy_front_hold_seconds", sel, "$__rate_interval"),
            )
        )
        .with_panel(
            _series(
                "Request duration",
                "Time from a request's arrival at the front to the end of its answer.",
                "s",
                _quantiles("understudy_front_request_duration_seconds", sel, "$__rate_interval"),
            )
        )
        .with_row(dash.Row("Poison isolation"))
        .with_panel(
            _stat(
                "Poison requests over the time range",
                "Requests the front named the poison, per pod: each killed the engine that "
                "ran it alone, after two engine deaths beside other requests, and was "
                "answered 422 (docs/poison.md; alert UnderstudyPoisonRequest).",
                "none",
                [
                    (
                        "sum by (namespace, pod) "
                        f"(increase(understudy_front_poison_total{{{sel}}}[$__range]))",
                        "{{pod}}",
                    )
                ],
                _steps((None, "green"), (0.5, "red")),
                width=6,
                instant=True,
            )
        )
        .with_panel(
            _series(
                "Suspects run alone and poisons",
                "Turns alone: requests that were in flight at two engine deaths, run with "
                "nothing beside them (the pod serves one request at a time meanwhile); "
                "poison: one of them killed the engine it ran alone on.",
                "none",
                [
                    (
                        "sum by (namespace, pod) (increase(understudy_front_isolated_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "run alone {{pod}}",
                    ),
                    (
                        "sum by (namespace, pod) (increase(understudy_front_poison_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "poison {{pod}}",
                    ),
                ],
                width=18,
            )
        )
        .with_row(dash.Row("GPU Memory Service"))
        .with_panel(
            _series(
                "GMS memory",
                "Weight memory GMS holds per pod and device (both engines map the same bytes).",
                "bytes",
                [
                    (
                        "sum by (namespace, pod, device) "
                        f"(understudy_gms_allocated_bytes{{{sel}}})",
                        "{{pod}} device {{device}}",
                    )
                ],
            )
        )
        .with_panel(
            _series(
                "GMS sessions",
                "Granted GMS sessions by mode (RW: the loader, RO: engines mapping the "
                "weights) and sessions waiting for the lock.",
                "none",
                [
                    (
                        f"sum by (namespace, pod, mode) (understudy_gms_sessions{{{sel}}})",
                        "{{pod}} {{mode}}",
                    ),
                    (
                        f"sum by (namespace, pod) (understudy_gms_waiting_sessions{{{sel}}})",
                        "{{pod}} waiting",
                    ),
                ],
            )
        )
    )
    return board


def fleet() -> dash.Dashboard:
    """The operator: reconcile latency and errors, GpuInstances by phase, placement."""
    sel = OPERATOR
    return (
        dash.Dashboard("Understudy operator")
        .uid("understudy-fleet")
        .description(
            "The Understudy operator: GpuInstances by phase, reconcile latency and errors, "
            "scheduler decisions and the built-in autoscaler."
        )
        .tags(["understudy", "operator"])
        .readonly()
        .time("now-6h", "now")
        .refresh("1m")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .variables(list(_operator_variables()))
        .with_row(dash.Row("GpuInstances"))
        .with_panel(
            _series(
                "GpuInstances by phase",
                "How many GpuInstances are in each phase (Pending, Scheduling, Running, "
                "Degraded, Failed, ...), as the operator last reconciled them.",
                "none",
                [(f"sum by (phase) (understudy_operator_instances{{{sel}}})", "{{phase}}")],
            )
        )
        .with_panel(
            _series(
                "Replica lifecycle verdicts",
                "Verdicts the lifecycle coordinator applied to replicas per second, by handler "
                "and verdict.",
                "ops",
                [
                    (
                        "sum by (handler, verdict) (rate("
                        f"understudy_operator_replica_transitions_total{{{sel}}}[$__rate_interval]))",
                        "{{handler}} {{verdict}}",
                    )
                ],
            )
        )
        .with_row(dash.Row("Reconcile"))
        .with_panel(
            _series(
                "Reconcile latency",
                "Duration of one reconcile pass (observe, plan, apply), p50 / p95 / p99.",
                "s",
                _quantiles(
                    "understudy_operator_reconcile_duration_seconds", sel, "$__rate_interval"
                ),
            )
        )
        .with_panel(
            _series(
                "Reconcile errors",
                "Failed reconcile passes per second by cause (conflict, api, unexpected), "
                "and reconciles per second.",
                "ops",
                [
                    (
                        "sum by (cause) (rate(understudy_operator_reconcile_errors_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "errors {{cause}}",
                    ),
                    (
                        "sum (rate(understudy_operator_reconcile_duration_seconds_count"
                        f"{{{sel}}}[$__rate_interval]))",
                        "reconciles",
                    ),
                ],
            )
        )
        .with_row(dash.Row("Placement and scale"))
        .with_panel(
            _series(
                "Scheduler decision time",
                "Time to place one replica (filters and scorers over every candidate node), "
                "p99 by result.",
                "s",
                [
                    (
                        "histogram_quantile(0.99, sum by (result, le) (rate("
                        f"understudy_scheduler_decision_seconds_bucket{{{sel}}}[$__rate_interval])))",
                        "p99 {{result}}",
                    )
                ],
            )
        )
        .with_panel(
            _series(
                "API writes",
                "API writes the operator made per second, by kind of action.",
                "ops",
                [
                    (
                        "sum by (action) (rate(understudy_operator_actions_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "{{action}}",
                    )
                ],
            )
        )
    )


def gateway() -> dash.Dashboard:
    """The fleet gateway (docs/gateway.md): the pods it can route to, the
    requests it moved off dead pods, and what its clients felt. Its series
    carry the gateway's own pod, not the pods behind it."""
    sel = POD
    return (
        dash.Dashboard("Understudy gateway")
        .uid("understudy-gateway")
        .description(
            "The fleet gateway in front of a GpuInstance's pods: pods routable, requests "
            "moved off dead pods by how each was found dead, held and answered requests."
        )
        .tags(["understudy", "gateway"])
        .readonly()
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .variables(list(_pod_variables("understudy_gateway_pods_routable")))
        .with_row(dash.Row("Pods"))
        .with_panel(
            _stat(
                "Pods routable",
                "Pods each gateway replica can send requests to now (their fronts answer "
                "/ready). 0 is an outage (requests are held, then answered 503); 1 leaves "
                "nowhere to move a stream if that pod dies.",
                "none",
                [
                    (
                        f"min by (namespace, pod) (understudy_gateway_pods_routable{{{sel}}})",
                        "{{pod}}",
                    )
                ],
                _steps((None, "red"), (1, "orange"), (2, "green")),
                width=8,
                instant=True,
            )
        )
        .with_panel(
            _stat(
                "Requests moved off dead pods over the time range",
                "Requests the gateway moved to another pod because theirs died, by how it "
                "was found dead: reset, refused, silent (past --silence), removed (left the "
                "endpoint list). Alert UnderstudyGatewayPodDied.",
                "none",
                [
                    (
                        "sum by (reason) (increase(understudy_gateway_migrations_total"
                        f"{{{sel}}}[$__range]))",
                        "{{reason}}",
                    )
                ],
                _steps((None, "green"), (0.5, "orange")),
                width=8,
                instant=True,
            )
        )
        .with_panel(
            _stat(
                "Poison requests over the time range",
                "Requests the gateway named the poison: each killed a pod that ran it alone, "
                "after two pod deaths beside other requests, and was answered 422.",
                "none",
                [
                    (
                        f"sum (increase(understudy_gateway_poison_total{{{sel}}}[$__range]))",
                        "poison",
                    )
                ],
                _steps((None, "green"), (0.5, "red")),
                width=8,
                instant=True,
            )
        )
        .with_panel(
            _series(
                "Pods routable over time",
                "Pods each gateway replica can route to. A dead pod drops out at once; it "
                "comes back only when it answers a probe sent after its death.",
                "none",
                [
                    (
                        f"min by (namespace, pod) (understudy_gateway_pods_routable{{{sel}}})",
                        "{{pod}}",
                    )
                ],
            )
        )
        .with_panel(
            _series(
                "Requests moved off dead pods",
                "Requests moved to another pod (a stream continued where it stopped, a plain "
                "request replayed), by how their pod was found dead; and requests that could "
                "not be moved, by reason.",
                "none",
                [
                    (
                        "sum by (reason) (increase(understudy_gateway_migrations_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "{{reason}}",
                    ),
                    (
                        "sum by (reason) (increase(understudy_gateway_migrations_failed_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "failed {{reason}}",
                    ),
                ],
            )
        )
        .with_row(dash.Row("Requests"))
        .with_panel(
            _series(
                "Held and in-flight requests",
                "Requests in flight to a pod and requests held while no pod is routable, "
                "per gateway replica; how many per second had to wait.",
                "none",
                [
                    (
                        f"sum by (namespace, pod) (understudy_gateway_requests_inflight{{{sel}}})",
                        "in flight {{pod}}",
                    ),
                    (
                        f"sum by (namespace, pod) (understudy_gateway_requests_held{{{sel}}})",
                        "held now {{pod}}",
                    ),
                    (
                        "sum (rate(understudy_gateway_held_requests_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "held per second",
                    ),
                ],
                width=8,
            )
        )
        .with_panel(
            _series(
                "Requests by status",
                "Answers of the gateway per second by HTTP status class, and holds that "
                "expired (503 after the hold).",
                "reqps",
                [
                    (
                        "sum by (code) (rate(understudy_gateway_requests_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "{{code}}",
                    ),
                    (
                        "sum (rate(understudy_gateway_hold_expired_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "hold expired",
                    ),
                ],
                width=8,
            )
        )
        .with_panel(
            _series(
                "Suspects run alone and poisons",
                "Requests in flight at two pod deaths, run with nothing beside them; "
                "poison: one of them killed the pod it ran alone on.",
                "none",
                [
                    (
                        "sum (increase(understudy_gateway_isolated_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "run alone",
                    ),
                    (
                        "sum (increase(understudy_gateway_poison_total"
                        f"{{{sel}}}[$__rate_interval]))",
                        "poison",
                    ),
                ],
                width=8,
            )
        )
        .with_panel(
            _series(
                "Hold time",
                "How long held requests waited for a routable pod, p50 / p95 / p99.",
                "s",
                _quantiles("understudy_gateway_hold_seconds", sel, "$__rate_interval"),
            )
        )
        .with_panel(
            _series(
                "Request duration",
                "Time from a request's arrival at the gateway to the end of its answer, "
                "moves to other pods included.",
                "s",
                _quantiles("understudy_gateway_request_duration_seconds", sel, "$__rate_interval"),
            )
        )
    )


DASHBOARDS = {"failover": failover, "fleet": fleet, "gateway": gateway}


def render(build: dash.Dashboard) -> str:
    return json.dumps(build.build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed file differs")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    stale = []
    for name, make in DASHBOARDS.items():
        path = args.out / f"{name}.json"
        text = render(make())
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    if stale:
        print(
            "stale dashboards (run hack/monitoring/dashboards.py): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
