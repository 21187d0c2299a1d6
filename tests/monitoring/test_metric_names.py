"""Metric names as Prometheus wants them (units, _total counters, help):
promtool's metric lint on the operator's exposition."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest

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
