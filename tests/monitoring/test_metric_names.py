"""Metric names as Prometheus wants them (units, _total counters, help):
promtool's metric lint on the operator's exposition; and the front's and the
gateway's names that the dashboards and rules query, against what they expose."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

import pytest
from monitoring_tools import DASHBOARDS, RULES

from understudy.front.gateway import GatewayMetrics
from understudy.front.metrics import FrontMetrics, Labelled

pytestmark = pytest.mark.timeout(900)  # the first tool use may install it


def test_operator_metrics_pass_promtools_lint(tool: Callable[[str], str]) -> None:
    """The operator's exposition (its process's default registry), through
    promtool check metrics; the pod's endpoints get the same check in
    tests/process/test_prometheus.py."""
    import prometheus_client as prom

    from understudy.operator import metrics

    metrics.RECONCILE_ERRORS.labels("api")  # labelled series present, as in a live operator
    proc = subprocess.run(
        [tool("promtool"), "check", "metrics"],
        input=prom.generate_latest(prom.REGISTRY),
        capture_output=True,
    )
    assert proc.returncode == 0 and not proc.stdout and not proc.stderr, proc.stdout + proc.stderr


def _exposed(metrics: FrontMetrics) -> set[str]:
    """Every sample name ``metrics`` exposes, each labelled family given one child."""
    import prometheus_client as prom
    from prometheus_client.parser import text_string_to_metric_families

    for value in vars(metrics).values():
        if isinstance(value, Labelled):
            value.labels(**{value.label: "x"}).inc()
    text = prom.generate_latest(metrics.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _queried() -> set[str]:
    """Every front and gateway metric a dashboard or an alert rule queries."""
    texts = [RULES.read_text()] + [p.read_text() for p in DASHBOARDS.glob("*.json")]
    return {m for t in texts for m in re.findall(r"\bunderstudy_(?:front|gateway)_\w+", t)}


def test_every_front_and_gateway_metric_queried_is_exposed() -> None:
    """A dashboard or rule that names a metric the front (or the gateway,
    which no process test scrapes into Prometheus) does not expose would
    show nothing, and say nothing: the names against the expositions."""
    queried = _queried()
    assert {"understudy_front_poison_total", "understudy_gateway_migrations_total"} <= queried
    missing = queried - _exposed(FrontMetrics()) - _exposed(GatewayMetrics())
    assert not missing, f"queried but never exposed: {sorted(missing)}"
