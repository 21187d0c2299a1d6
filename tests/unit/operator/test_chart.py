"""The chart lints and renders offline and agrees with manifests/ (modulo Helm's labels)."""

from __future__ import annotations

import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helmchart import CHART, ROOT, find_helm

# Documented difference: Helm's own bookkeeping labels (docs/operator.md).
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance"}


HELM = find_helm()
pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary (hack/cluster/up builds one)")


def helm(*args: str) -> str:
    assert HELM is not None
    return subprocess.run(
        [HELM, *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def _objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _key(o: dict[str, Any]) -> tuple[str, str, str]:
    return (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])


def _strip(o: dict[str, Any]) -> dict[str, Any]:
    labels = o["metadata"].get("labels") or {}
    for k in HELM_LABELS:
        labels.pop(k, None)
    return o


def test_chart_lints() -> None:
    helm("lint", str(CHART), "--strict", "--kube-version", "1.34.0")


def test_chart_renders_the_manifests() -> None:
    out = helm(
        "template",
        "understudy",
        str(CHART),
        "--namespace",
        "understudy-system",
        "--include-crds",
        "--kube-version",
        "1.34.0",
    )
    chart = {_key(o): _strip(o) for o in _objects(out)}
    manifests: dict[tuple[str, str, str], dict[str, Any]] = {}
    for name in ("crd.yaml", "operator.yaml"):
        for o in _objects((ROOT / "manifests" / name).read_text()):
            manifests[_key(o)] = _strip(o)
    # The namespace is Helm's --namespace in the chart; manifests create it.
    manifests.pop(("Namespace", "", "understudy-system"))
    assert chart.keys() == manifests.keys()
    for key, obj in chart.items():
        assert obj == manifests[key], key
    for o in chart.values():
        kubernetes_validate.validate(o, "1.34.0", strict=True)


def test_chart_device_class_matches_the_manifest() -> None:
    out = helm(
        "template",
        "understudy",
        str(CHART),
        "--set",
        "deviceClass.create=true",
        "--kube-version",
        "1.34.0",
        "--show-only",
        "templates/deviceclass.yaml",
    )
    (dc,) = _objects(out)
    (want,) = _objects((ROOT / "manifests" / "deviceclass.yaml").read_text())
    dc["metadata"].pop("labels")
    assert dc == want


def test_values_schema_rejects_nonsense() -> None:
    assert HELM is not None
    proc = subprocess.run(
        [
            HELM,
            "template",
            "x",
            str(CHART),
            "--set",
            "image.pullPolicy=Sometimes",
            "--kube-version",
            "1.34.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0 and "pullPolicy" in proc.stderr
