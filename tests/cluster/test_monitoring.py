"""Monitoring on the real cluster (docs/monitoring-kubernetes.md).

The prometheus-operator CRDs (pinned, from its Go module) go into the real
apiserver, then the chart with every monitoring object on: the apiserver
admits the ServiceMonitor, PodMonitor, PrometheusRule and dashboard
ConfigMaps and keeps them as rendered. Then a real Prometheus runs on the node
(upstream's, built by hack/monitoring/prometheus: Debian's has no Kubernetes
discovery) with the scrape configuration of docs/monitoring-kubernetes.md:
Kubernetes service discovery through the apiserver, restricted to the test's
namespaces. It must find every metrics port of a GpuInstance pod, and what it
scrapes during ``understudy drill --kube`` must agree with the drill's JSON.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promcrds
import pytest
import yaml
from procs import Proc, wait_settled

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RELEASE, OPERATOR_NS = "understudy", "understudy-system"
CRDS = ("servicemonitors", "podmonitors", "prometheusrules")
PROM_PORT = int(os.environ.get("UNDERSTUDY_TEST_PROMETHEUS_PORT", "19290"))
KILLS = int(os.environ.get("UNDERSTUDY_MONITORING_KILLS", "5"))
SHADOWS = 2
# One engine status port per engine, and the sidecars' and front's ports.
POD_ENDPOINTS = {"lock-metrics", "gms-metrics", "front-status"} | {
    f"status-{i}" for i in range(SHADOWS + 1)
}
ALL_ON = [
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.podMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.dashboards.enabled=true",
    "monitoring.labels.release=kube-prometheus-stack",
]
SCRAPE_S = 1


def _contains(live: Any, want: Any, path: str = "") -> list[str]:
    """Where LIVE lacks or differs from WANT (LIVE may add defaults)."""
    if isinstance(want, dict):
        if not isinstance(live, dict):
            return [f"{path}: {live!r}"]
        return [d for k, v in want.items() for d in _contains(live.get(k), v, f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(live, list) or len(live) != len(want):
            return [f"{path}: {live!r}"]
        return [
            d
            for i, (a, b) in enumerate(zip(live, want, strict=True))
            for d in _contains(a, b, f"{path}[{i}]")
        ]
    return [] if live == want else [f"{path}: {live!r} != {want!r}"]


def _install_crds(cluster: Any, *plurals: str) -> None:
    """Apply the prometheus-operator's CRDs for PLURALS and wait until they serve."""
    for plural in plurals:
        # Server-side: the CRDs are too big for kubectl's last-applied annotation.
        cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(promcrds.crd_path(plural))
        )

    def established(plural: str) -> bool:
        crd = cluster.get_json("crd", f"{plural}.{promcrds.GROUP}")
        conditions = crd.get("status", {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    # Not `kubectl wait`: it fails at once while a new CRD has no status yet.
    for plural in plurals:
        wait_settled(f"CRD {plural} established", lambda p=plural: established(p), 60, 0.5)


@pytest.fixture(scope="module")
def crds(cluster: Any) -> None:
    """The prometheus-operator's CRDs for the three kinds the chart uses."""
    _install_crds(cluster, *CRDS)


@pytest.fixture(scope="module")
def installed(cluster: Any, image: str, crds: None) -> Iterator[tuple[Any, str]]:
    """The chart installed with monitoring on; a namespace for GpuInstances."""
    ns = f"mon-{int(time.time())}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("wait", "--for=create", "-n", ns, "serviceaccount/default", "--timeout=30s")
    repository, _, tag = image.rpartition(":")
    sets = [*ALL_ON, "operator.resyncSeconds=5", f"image.repository={repository}"]
    sets += [f"image.tag={tag}", f"monitoring.podMonitor.namespaces={{{ns}}}"]
    helm = subprocess.run(
        ["helm", "upgrade", "--install", RELEASE, str(ROOT / "charts/understudy")]
        + ["--namespace", OPERATOR_NS, "--create-namespace", "--wait", "--timeout", "5m"]
        + [a for s in sets for a in ("--set", s)],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert helm.returncode == 0, helm.stderr[-4000:]
    yield cluster, ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    subprocess.run(
        ["helm", "uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait"],
        env=cluster.env,
        capture_output=True,
        timeout=300,
    )


@pytest.mark.timeout(900)
def test_apiserver_admits_the_monitoring_objects_as_rendered(installed: tuple[Any, str]) -> None:
    cluster, _ = installed
    manifest = subprocess.run(
        ["helm", "get", "manifest", RELEASE, "--namespace", OPERATOR_NS],
        env=cluster.env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    sent = [o for o in yaml.safe_load_all(manifest) if o]
    kinds = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    monitoring = [o for o in sent if o["kind"] in kinds]
    dashboards = [o for o in sent if o["metadata"]["name"].startswith("understudy-dashboard-")]
    assert {o["kind"] for o in monitoring} == kinds
    assert len(dashboards) == len(list((ROOT / "charts/understudy/dashboards").glob("*.json")))
    for o in monitoring + dashboards:
        m = o["metadata"]
        live = cluster.get_json(o["kind"].lower(), m["name"], "-n", m["namespace"])
        # Admitted, and nothing pruned: what Helm sent is what is stored.
        body = {k: v for k, v in o.items() if k in ("spec", "data")}
        assert not _contains(live, body), (o["kind"], _contains(live, body))
        assert _contains(live["metadata"]["labels"], m["labels"]) == []
    # Grafana's sidecar finds the dashboards by their label.
    found = cluster.get_json("configmaps", "-A", "-l", "grafana_dashboard=1")["items"]
    assert {c["metadata"]["name"] for c in found} >= {d["metadata"]["name"] for d in dashboards}
    # The installed CRDs validate: the apiserver refuses what their schema forbids.
    (pm,) = (o for o in monitoring if o["metadata"]["name"] == "understudy-gpuinstances")
    bad = json.loads(json.dumps(pm))
    bad["metadata"]["name"] = "understudy-bad"
    bad["spec"]["podMetricsEndpoints"][0]["scheme"] = "ftp"
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=json.dumps(bad), check=False
    )
    assert proc.returncode != 0 and "scheme" in proc.stderr, proc.stderr


# --- a real Prometheus on the node --------------------------------------------


def documented_scrape_configs() -> list[dict[str, Any]]:
    """The scrape configuration block of docs/monitoring-kubernetes.md."""
    text = (ROOT / "docs/monitoring-kubernetes.md").read_text()
    _, _, rest = text.partition("<!-- scrape-config")
    block = rest.split("```yaml\n", 1)[1].split("```", 1)[0]
    jobs: list[dict[str, Any]] = yaml.safe_load(block)["scrape_configs"]
    return jobs


class Prometheus:
    def __init__(self, workdir: Path, config: dict[str, Any], port: int = PROM_PORT) -> None:
        binary = subprocess.run(
            [str(ROOT / "hack/monitoring/prometheus")],
            capture_output=True,
            text=True,
            check=True,
            timeout=1200,
        ).stdout.strip()
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "prometheus.log"
        self.proc = Proc(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            log=self.log,
        )
        wait_settled("Prometheus ready", self.ready, 60, 0.5)

    def ready(self) -> bool:
        assert self.proc.alive(), self.log.read_text()[-3000:]
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
            return r.status == 200

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def targets(self, job: str) -> list[dict[str, Any]]:
        active = self.api("targets", state="active")["activeTargets"]
        return [t for t in active if t["labels"]["job"] == job]

    def pool(self, prefix: str) -> list[dict[str, Any]]:
        """The active targets of every scrape pool (job_name) starting with PREFIX."""
        active = self.api("targets", state="active")["activeTargets"]
        return [t for t in active if t["scrapePool"].startswith(prefix)]

    def value(self, expr: str, at: float | None = None) -> float:
        """The one sample EXPR gives (at AT), as a number."""
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        result = self.api("query", **params)["result"]
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def stop(self) -> None:
        self.proc.stop()


def _sample(name: str, device_class: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "manifests/samples/gpuinstance-reference.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["gpus"]["deviceClassName"] = device_class
    doc["spec"]["failover"]["shadows"] = SHADOWS
    return doc


def _condition_true(cluster: Any, ns: str, name: str, kind: str) -> bool:
    obj = cluster.get_json("gpuinstance", name, "-n", ns)
    return any(
        c["type"] == kind and c["status"] == "True"
        for c in obj.get("status", {}).get("conditions", [])
    )


@pytest.fixture(scope="module")
def gpuinstance(installed: tuple[Any, str]) -> tuple[Any, str, str]:
    """A GpuInstance with two shadows in the test namespace, Ready and armed."""
    cluster, ns = installed
    name = "mon"
    cluster.apply(json.dumps(_sample(name, cluster.device_class)), namespace=ns)
    for kind in ("Ready", "StandbyReady"):
        wait_settled(
            f"GpuInstance {kind}", lambda k=kind: _condition_true(cluster, ns, name, k), 300
        )
    return cluster, ns, name


def _build(script: str) -> str:
    """A binary hack/monitoring/SCRIPT builds (once, into the cache) and prints."""
    out = subprocess.run(
        [str(ROOT / "hack/monitoring" / script)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _generated_config(cluster: Any, ns: str, workdir: Path) -> dict[str, Any]:
    """The configuration the prometheus-operator wrote for Prometheus "kps", made
    runnable on the node: its environment variables expanded, rule files from
    its ConfigMap, discovery through the admin kubeconfig instead of a pod's
    ServiceAccount."""
    secret = wait_settled(
        "the operator's generated configuration",
        lambda: cluster.get_json("secret", "prometheus-kps", "-n", ns)["data"][
            "prometheus.yaml.gz"
        ],
        120,
    )
    text = gzip.decompress(base64.b64decode(secret)).decode()
    # What prometheus-config-reloader does in the pod before Prometheus reads
    # the file: expand $(VAR) from the pod's environment (the shard number
    # keeps the targets of a hashmod shard; the pod name is a label).
    for var, value in {"SHARD": "0", "POD_NAME": "prometheus-kps-0"}.items():
        text = text.replace(f"$({var})", value)
    config: dict[str, Any] = yaml.safe_load(text)
    rules = workdir / "rules"
    rules.mkdir(parents=True)
    rulefiles = cluster.get_json("configmap", "prometheus-kps-rulefiles-0", "-n", ns)["data"]
    for fname, text in rulefiles.items():
        (rules / fname).write_text(text)
    config["rule_files"] = [str(rules / "*.yaml")]
    for job in config.get("scrape_configs", []):
        for sd in job.get("kubernetes_sd_configs", []):
            sd["kubeconfig_file"] = str(cluster.kubeconfig)
    return config


@pytest.mark.timeout(1800)
def test_the_prometheus_operator_turns_the_charts_monitors_into_live_targets(
    gpuinstance: tuple[Any, str, str], tmp_path: Path
) -> None:
    """The real prometheus-operator (run on the node) selects the chart's
    ServiceMonitor, PodMonitor and PrometheusRule by the release label, as
    kube-prometheus-stack's Prometheus does; the configuration it generates,
    run by a real Prometheus, scrapes every metrics port of the pod and the
    operator, and loads and evaluates every alert rule."""
    cluster, ns, name = gpuinstance
    if not cluster.ours:
        pytest.skip(
            "runs the prometheus-operator on hack/cluster's node with its admin certificate"
        )
    operator = _build("prometheus-operator")
    # Its Prometheus controller waits for a Probe informer too.
    _install_crds(cluster, "prometheuses", "probes")
    pki = cluster.cluster_dir / "pki"
    server = cluster.kubectl(
        "config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}"
    ).stdout
    op = Proc(
        [
            operator,
            f"--apiserver={server}",
            f"--ca-file={pki / 'ca.crt'}",
            f"--cert-file={pki / 'admin.crt'}",
            f"--key-file={pki / 'admin.key'}",
            f"--web.listen-address=127.0.0.1:{PROM_PORT + 2}",
            f"--prometheus-instance-namespaces={ns}",
        ],
        log=tmp_path / "operator.log",
    )
    prom: Prometheus | None = None
    try:
        selector = {"matchLabels": {"release": "kube-prometheus-stack"}}
        cluster.apply(
            json.dumps(
                {
                    "apiVersion": f"{promcrds.GROUP}/v1",
                    "kind": "Prometheus",
                    "metadata": {"name": "kps", "namespace": ns},
                    # No pods: the configuration is what this test takes, and
                    # the node cannot pull Prometheus's image anyway.
                    "spec": {
                        "replicas": 0,
                        "serviceMonitorSelector": selector,
                        "serviceMonitorNamespaceSelector": {},
                        "podMonitorSelector": selector,
                        "podMonitorNamespaceSelector": {},
                        "ruleSelector": selector,
                        "ruleNamespaceSelector": {},
                    },
                }
            ),
            namespace=ns,
        )
        config = _generated_config(cluster, ns, tmp_path / "kps")
        prom = Prometheus(tmp_path / "kps", config, port=PROM_PORT + 1)
        pods = f"podMonitor/{OPERATOR_NS}/understudy-gpuinstances/"

        def pod_targets() -> list[dict[str, Any]] | None:
            ts = [t for t in prom.pool(pods) if t["labels"].get("pod") == f"{name}-0"]
            return (
                ts
                if len(ts) == len(POD_ENDPOINTS) and all(t["health"] == "up" for t in ts)
                else None
            )

        ts = wait_settled("every metrics port through the PodMonitor, up", pod_targets, 120)
        assert {t["labels"]["endpoint"] for t in ts} == POD_ENDPOINTS
        for t in ts:
            assert t["labels"]["namespace"] == ns
            assert t["labels"]["understudy_dev_instance"] == name
            assert t["labels"]["understudy_dev_replica"] == "0"
        (svc,) = wait_settled(
            "the operator through the ServiceMonitor, up",
            lambda: [
                t
                for t in prom.pool(f"serviceMonitor/{OPERATOR_NS}/understudy-operator/")
                if t["health"] == "up"
            ],
            120,
        )
        assert svc["labels"]["namespace"] == OPERATOR_NS
        # Every alert of the rules file loaded and evaluated without error.
        want = yaml.safe_load((ROOT / "charts/understudy/rules/understudy.rules.yaml").read_text())
        names = {r.get("alert") or r.get("record") for g in want["groups"] for r in g["rules"]}

        def evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            return rules if all(r["health"] == "ok" for r in rules) and rules else None

        rules = wait_settled("every rule evaluated", evaluated, 120)
        assert {r["name"] for r in rules} == names, [r for r in rules if r["health"] != "ok"]
    finally:
        if prom is not None:
            prom.stop()
        op.stop()
        sys.stderr.write((tmp_path / "operator.log").read_text()[-3000:])


@pytest.mark.timeout(1800)
def test_prometheus_scrapes_the_pod_through_kubernetes_sd_during_a_drill(
    gpuinstance: tuple[Any, str, str], tmp_path: Path
) -> None:
    cluster, ns, name = gpuinstance
    # The documented jobs, told where the apiserver is and which namespaces to watch.
    jobs = documented_scrape_configs()
    for job in jobs:
        watch = OPERATOR_NS if job["job_name"] == "understudy-operator" else ns
        for sd in job["kubernetes_sd_configs"]:
            sd["kubeconfig_file"] = str(cluster.kubeconfig)
            sd["namespaces"] = {"names": [watch]}
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s"},
        "scrape_configs": jobs,
    }
    prom = Prometheus(tmp_path / "prometheus", config)
    try:
        _check_targets(prom, ns, f"{name}-0")
        _check_drill(prom, cluster, ns, name, tmp_path)
    finally:
        prom.stop()
        sys.stderr.write(prom.log.read_text()[-3000:])


def _check_targets(prom: Prometheus, ns: str, pod: str) -> None:
    def pod_targets() -> list[dict[str, Any]] | None:
        ts = prom.targets("understudy")
        up = [t for t in ts if t["health"] == "up"]
        return ts if len(up) == len(POD_ENDPOINTS) == len(ts) else None

    ts = wait_settled("every metrics port of the pod discovered and up", pod_targets, 90)
    assert {t["labels"]["endpoint"] for t in ts} == POD_ENDPOINTS
    assert {(t["labels"]["namespace"], t["labels"]["pod"]) for t in ts} == {(ns, pod)}
    assert {t["labels"]["understudy_dev_instance"] for t in ts} == {pod.rsplit("-", 1)[0]}
    # The annotations name one port per pod: the lock server's.
    (ann,) = wait_settled(
        "the annotated target up",
        lambda: [t for t in prom.targets("kubernetes-pods") if t["health"] == "up"],
        60,
    )
    assert ann["labels"]["pod"] == pod
    assert urllib.parse.urlparse(ann["scrapeUrl"]).port == 9101
    (op,) = wait_settled(
        "the operator's target up",
        lambda: [t for t in prom.targets("understudy-operator") if t["health"] == "up"],
        60,
    )
    assert op["labels"]["namespace"] == OPERATOR_NS
    reconciles = 'understudy_operator_reconcile_duration_seconds_count{job="understudy-operator"}'
    assert prom.value(f"count({reconciles})") >= 1


def _check_drill(prom: Prometheus, cluster: Any, ns: str, name: str, tmp_path: Path) -> None:
    sel = f'job="understudy",namespace="{ns}"'
    grants = f"sum(understudy_lock_grants_total{{{sel}}})"
    epoch = f"max(understudy_lock_epoch{{{sel}}})"
    front = f"sum(understudy_front_failovers_total{{{sel}}})"

    def scraped_since(t: float) -> bool:
        # Every pod target has a sample newer than T.
        result = prom.api("query", query=f"timestamp(up{{{sel}}})")["result"]
        return len(result) == len(POD_ENDPOINTS) and all(float(r["value"][1]) > t for r in result)

    t = time.time()
    wait_settled("a scrape after the pod settled", lambda: scraped_since(t), 30, 0.5)
    t0 = time.time()
    before = {q: prom.value(q, t0) for q in (grants, epoch, front)}

    out = tmp_path / "drill.json"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "understudy.cli", "drill", "--kube", f"{ns}/{name}"),
            *("--kubeconfig", str(cluster.kubeconfig), "--output", str(out), "--timeout", "120"),
            *("--kills", str(KILLS), "--signal", "KILL"),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-2000:])
    report = json.loads(out.read_text())
    s = report["summary"]
    assert proc.returncode == 0 and s["kills"] == KILLS and s["failovers_ok"] == KILLS, s
    # Nothing but engines restarted: the lock server's and front's counters
    # are one process's count from before the drill to after it.
    restarts = report["cluster"]["restarts"]
    assert all(v == 0 for k, v in restarts.items() if k.endswith(("/lockserver", "/front")))

    t = time.time()
    wait_settled("a scrape after the drill", lambda: scraped_since(t), 30, 0.5)
    t1 = time.time()
    after = {q: prom.value(q, t1) for q in (grants, epoch, front)}
    rounds = report["rounds"]
    # Every kill is one grant to the engine that took over, one epoch, one route change.
    assert after[grants] - before[grants] == KILLS, (before, after)
    assert before[epoch] == rounds[0]["killed_epoch"], (before, rounds[0])
    assert after[epoch] == rounds[-1]["new_epoch"], (after, rounds[-1])
    assert after[front] - before[front] == KILLS, (before, after)
    # The epoch, as Prometheus sampled it, only ever moved forward through the
    # drill's epochs. A gauge shows what a scrape found: an engine that was
    # Active for less than a scrape interval (a quick re-arm, then the next
    # kill) may never be sampled, which is why the counts above are the
    # counters', not the gauge's.
    seen = prom.api(
        "query_range", query=epoch, start=f"{t0:.3f}", end=f"{t1:.3f}", step=f"{SCRAPE_S / 2}"
    )["result"][0]["values"]
    sampled = [int(float(v)) for _, v in seen]
    drilled = {rounds[0]["killed_epoch"]} | {r["new_epoch"] for r in rounds}
    assert set(sampled) <= drilled, (sampled, rounds)
    assert sampled == sorted(sampled), sampled
    assert sampled[0] == rounds[0]["killed_epoch"] and sampled[-1] == rounds[-1]["new_epoch"]
    sys.stderr.write(
        json.dumps({"prometheus_before": before, "prometheus_after": after, "drill": s}) + "\n"
    )
