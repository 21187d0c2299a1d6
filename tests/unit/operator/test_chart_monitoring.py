"""The chart's monitoring objects: off by default, valid against the
prometheus-operator CRDs (pinned, hack/monitoring/crds) when on, in step with
the ports the operator renders, and mirrored in manifests/monitoring/."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jsonschema
import kubernetes_validate
import promcrds
import pytest
import yaml
from helmchart import CHART, ROOT, find_helm, template

from understudy.operator import api, render
from understudy.operator.api import GpuInstance

pytestmark = pytest.mark.skipif(
    find_helm() is None, reason="no helm binary (hack/cluster/up builds one)"
)

ALL_ON = [
    "--set",
    "monitoring.serviceMonitor.enabled=true",
    "--set",
    "monitoring.podMonitor.enabled=true",
    "--set",
    "monitoring.prometheusRule.enabled=true",
    "--set",
    "monitoring.dashboards.enabled=true",
]
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
RULES = CHART / "rules" / "understudy.rules.yaml"


def _by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def _pod_monitor(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (pm,) = [o for o in _by_kind(objs, "PodMonitor") if o["metadata"]["name"] == name]
    return pm


def _dashboard_maps(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        o
        for o in _by_kind(objs, "ConfigMap")
        if o["metadata"]["name"].startswith("understudy-dashboard-")
    ]


def _instance(shadows: int) -> GpuInstance:
    return GpuInstance.from_body(
        {
            "apiVersion": "understudy.dev/v1alpha1",
            "kind": "GpuInstance",
            "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {
                "model": {"source": "builtin:all-MiniLM-L6-v2"},
                "failover": {"shadows": shadows},
            },
        }
    )


def test_monitoring_is_off_by_default() -> None:
    objs = template()
    assert not [o for o in objs if o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert not _dashboard_maps(objs)
    # Only what plain Prometheus needs is always there: the operator's
    # metrics Service and the scrape annotations.
    (svc,) = _by_kind(objs, "Service")
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == "8080"


def test_every_monitoring_object_fits_its_crd_or_the_kubernetes_schema() -> None:
    objs = template(*ALL_ON, "--set", "monitoring.labels.release=kube-prometheus-stack")
    crd_kinds = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert crd_kinds <= {o["kind"] for o in objs}
    assert {
        (o["apiVersion"], o["kind"]) for o in objs if o["kind"] in crd_kinds
    } <= promcrds.kinds()
    for o in objs:
        if o["kind"] in crd_kinds:
            promcrds.validate(o)
            # kube-prometheus-stack's Prometheus selects its objects by this label.
            assert o["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        elif o["kind"] != "CustomResourceDefinition":
            kubernetes_validate.validate(o, "1.34.0", strict=True)


def test_the_crd_check_rejects_what_the_apiserver_would_drop_or_refuse() -> None:
    objs = template(*ALL_ON, "--show-only", "templates/podmonitor.yaml")
    assert sorted(o["metadata"]["name"] for o in objs) == [
        "understudy-gateways",
        "understudy-gpuinstances",
    ]
    pm = _pod_monitor(objs, "understudy-gpuinstances")
    promcrds.validate(pm)
    typo = json.loads(json.dumps(pm))
    typo["spec"]["podMetricEndpoints"] = typo["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        promcrds.validate(typo)
    wrong = json.loads(json.dumps(pm))
    wrong["spec"]["podMetricsEndpoints"][0]["scheme"] = "ftp"
    with pytest.raises(jsonschema.ValidationError):
        promcrds.validate(wrong)


def test_podmonitor_covers_every_metrics_port_the_operator_renders() -> None:
    pm = _pod_monitor(template(*ALL_ON), "understudy-gpuinstances")
    listed = [e["port"] for e in pm["spec"]["podMetricsEndpoints"]]
    assert len(listed) == len(set(listed))
    # The widest pod: the most shadows a GpuInstance may have.
    pod = render.render_pod(_instance(api.MAX_SHADOWS), 0, 1, None, render.RenderConfig())
    containers = pod["spec"]["initContainers"] + pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for c in containers for p in c["ports"]}
    # Every container port is named; all but the serving port serve /metrics.
    assert set(listed) == set(ports) - {"http"}
    assert set(render.METRICS_PORT_NAMES) <= set(listed)
    # It selects exactly the pods the operator renders.
    labels = pod["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert set(pm["spec"]["podTargetLabels"]) <= set(labels)
    # The one port of the prometheus.io/* convention is the lock server's.
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == ports["lock-metrics"]


def test_the_gateways_podmonitor_scrapes_the_rendered_gateway_as_its_instance() -> None:
    pm = _pod_monitor(template(*ALL_ON), "understudy-gateways")
    promcrds.validate(pm)
    inst = GpuInstance.from_body(
        {
            "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1"},
            "spec": {"model": {"source": "builtin:tiny-llama"}, "gateway": {}},
        }
    )
    dep = render.render_gateway_deployment(inst, render.RenderConfig())
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert set(ports) - {"http"} == {endpoint["port"]}
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == ports[endpoint["port"]]
    # The rules' and dashboards' understudy_dev_instance is the gateway's label.
    (relabel,) = endpoint["relabelings"]
    assert relabel["targetLabel"] == "understudy_dev_instance"
    (source,) = relabel["sourceLabels"]
    assert source == "__meta_kubernetes_pod_label_" + "understudy.dev/gateway".replace(
        ".", "_"
    ).replace("/", "_")
    assert labels["understudy.dev/gateway"] == "demo"
    # The instance's PodMonitor does not take the gateway's pods.
    engine = _pod_monitor(template(*ALL_ON), "understudy-gpuinstances")
    assert not engine["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_podmonitor_namespaces_follow_the_operator_unless_given() -> None:
    def spec(*args: str) -> dict[str, Any]:
        objs = template(*ALL_ON, *args, "--show-only", "templates/podmonitor.yaml")
        selectors = [pm["spec"]["namespaceSelector"] for pm in objs]
        assert all(s == selectors[0] for s in selectors)  # the gateways' too
        return selectors[0]

    assert spec() == {"any": True}
    assert spec("--set", "operator.watchNamespaces={a,b}") == {"matchNames": ["a", "b"]}
    assert spec(
        "--set", "operator.watchNamespaces={a,b}", "--set", "monitoring.podMonitor.namespaces={c}"
    ) == {"matchNames": ["c"]}


def test_servicemonitor_selects_the_operator_metrics_service() -> None:
    objs = template(*ALL_ON)
    (sm,) = _by_kind(objs, "ServiceMonitor")
    (svc,) = _by_kind(objs, "Service")
    (dep,) = _by_kind(objs, "Deployment")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [svc["metadata"]["namespace"]]}
    (port,) = svc["spec"]["ports"]
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [port["name"]]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}


def test_prometheusrule_is_the_rules_file() -> None:
    (rule,) = _by_kind(template(*ALL_ON), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_one_dashboard_configmap_per_json_with_the_sidecar_label() -> None:
    assert DASHBOARDS, "no dashboards in charts/understudy/dashboards"
    maps = _dashboard_maps(template(*ALL_ON))
    assert len(maps) == len(DASHBOARDS)
    for path, cm in zip(DASHBOARDS, sorted(maps, key=lambda m: m["metadata"]["name"]), strict=True):
        assert cm["metadata"]["name"] == f"understudy-dashboard-{path.stem}"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())
    custom = _dashboard_maps(
        template(
            *ALL_ON,
            "--set",
            "monitoring.dashboards.label=my_dashboards",
            "--set",
            "monitoring.dashboards.labelValue=yes",
            "--set",
            "monitoring.dashboards.namespace=grafana",
            "--set",
            "monitoring.dashboards.annotations.grafana_folder=Understudy",
        )
    )
    for cm in custom:
        assert cm["metadata"]["labels"]["my_dashboards"] == "yes"
        assert "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["namespace"] == "grafana"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Understudy"}


def test_values_schema_rejects_a_bad_monitoring_value() -> None:
    helm = find_helm()
    assert helm is not None
    for bad in ("monitoring.podMonitor.interval=soon", "monitoring.serviceMonitor.enabled=1x"):
        proc = subprocess.run(
            [helm, "template", "x", str(CHART), "--set", bad, "--kube-version", "1.34.0"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode != 0 and "monitoring" in proc.stderr, (bad, proc.stderr)


def test_manifests_monitoring_is_the_chart_rendered() -> None:
    script = ROOT / "hack" / "monitoring" / "manifests"
    proc = subprocess.run(
        [sys.executable, str(script), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"UNDERSTUDY_HELM": find_helm() or "", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in (ROOT / "manifests" / "monitoring").glob("*.yaml"))
    assert files == [
        "dashboards.yaml",
        "podmonitor.yaml",
        "prometheusrule.yaml",
        "servicemonitor.yaml",
    ]
    for path in (ROOT / "manifests" / "monitoring").glob("*.yaml"):
        for o in yaml.safe_load_all(path.read_text()):
            assert o["metadata"]["namespace"] == "understudy-system"
            assert not set(o["metadata"].get("labels", {})) & {
                "helm.sh/chart",
                "app.kubernetes.io/managed-by",
            }
