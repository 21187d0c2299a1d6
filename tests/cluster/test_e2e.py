"""End to end on the real cluster: the image built from our Dockerfile, the
chart installed with helm, the operator running in-cluster, a GpuInstance
applied with kubectl — then chaos: the active engine's process killed over
and over under a request stream through the Service.

The drill (``understudy drill --kube``) runs on the node as root: it finds
the engine containers' processes in /proc and kills them there, reads every
engine's /state at its pod IP, and watches the Service's EndpointSlices and
the pod's Ready condition while it works.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this tier's helpers, run alone too
from crd_guard import this_crd
from procs import wait_settled


def _wait(what: str, fn: Callable[[], Any], timeout: float = 180) -> Any:
    return wait_settled(what, fn, timeout)


pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RELEASE, OPERATOR_NS = "understudy", "understudy-system"
REPORTS = Path(os.environ.get("UNDERSTUDY_REPORT_DIR", ROOT / "bench" / "results"))
# CI runs this many kills, mixing the signals; hack/soak runs the long soak.
KILLS = int(os.environ.get("UNDERSTUDY_CHAOS_KILLS", "60"))
SIGNALS = os.environ.get("UNDERSTUDY_CHAOS_SIGNALS", "KILL,SEGV,STOP")
SCENARIO_ROUNDS = int(os.environ.get("UNDERSTUDY_CHAOS_SCENARIO_ROUNDS", "2"))


@pytest.fixture(scope="module")
def installed(cluster: Any, image: str) -> Iterator[Any]:
    """The image in the cluster, this tree's CRD, the chart helm-installed, the
    operator running. Helm creates a chart's CRDs but never updates one that
    exists, so on a cluster that has served another tree the CRD is applied
    (and the one found put back after: crd_guard)."""
    repository, _, tag = image.rpartition(":")
    with this_crd(cluster):
        helm = subprocess.run(
            [
                "helm",
                "upgrade",
                "--install",
                RELEASE,
                str(ROOT / "charts/understudy"),
                "--namespace",
                OPERATOR_NS,
                "--create-namespace",
                "--wait",
                "--timeout",
                "5m",
                "--set",
                "operator.resyncSeconds=5",
                "--set",
                f"image.repository={repository}",
                "--set",
                f"image.tag={tag}",
            ],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert helm.returncode == 0, helm.stderr[-4000:]
        yield cluster
        # Leave no in-cluster operator behind for other tests' out-of-cluster kopf.
        subprocess.run(
            ["helm", "uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait"],
            env=cluster.env,
            capture_output=True,
            timeout=300,
        )


def _sample(
    name: str, device_class: str, sample: str = "reference", model: str | None = None
) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / f"manifests/samples/gpuinstance-{sample}.yaml").read_text())
    doc["metadata"] = {"name": name}
    if model is not None:
        doc["spec"]["model"]["source"] = model
    doc["spec"]["gpus"]["deviceClassName"] = device_class
    # Two shadows: a takeover can itself be killed at once and still find a standby.
    doc["spec"]["failover"]["shadows"] = 2
    return doc


def _embed(url: str, text: str = "the same question through the Service") -> str:
    req = urllib.request.Request(
        f"{url}/v1/embeddings",
        method="POST",
        data=json.dumps({"input": text, "encoding_format": "base64"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())["data"][0]["embedding"]


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind)


class Instance:
    def __init__(
        self,
        cluster: Any,
        ns: str,
        name: str = "minilm",
        sample: str = "reference",
        model: str | None = None,
    ):
        self.cluster, self.ns, self.name = cluster, ns, name
        doc = _sample(name, cluster.device_class, sample, model)
        cluster.apply(json.dumps(doc), namespace=ns)

    def get(self) -> dict[str, Any]:
        return self.cluster.get_json("gpuinstance", self.name, "-n", self.ns)

    def pod(self) -> dict[str, Any]:
        return self.cluster.get_json("pod", f"{self.name}-0", "-n", self.ns)

    def address(self) -> tuple[str, int]:
        """The Service's ClusterIP and port."""
        svc = self.cluster.get_json("service", self.name, "-n", self.ns)
        return svc["spec"]["clusterIP"], int(svc["spec"]["ports"][0]["port"])

    def url(self) -> str:
        host, port = self.address()
        return f"http://{host}:{port}"

    def wait_ready(self, timeout: float = 300) -> None:
        try:
            _wait(
                "GpuInstance Ready",
                lambda: _condition(self.get(), "Ready")["status"] == "True",
                timeout,
            )
            _wait(
                "GpuInstance StandbyReady",
                lambda: _condition(self.get(), "StandbyReady")["status"] == "True",
                timeout,
            )
        except AssertionError as e:
            # A pod that never gets Ready says nothing in the assertion; what
            # it was doing is in its status, the namespace's events and its
            # containers' last lines (a CI run waited 20 min on one blind).
            raise AssertionError(f"{e}\n{self.diagnose()}") from None
        # Ready is the operator's verdict, patched as the pod's routable label in
        # the same pass; the EndpointSlice and kube-proxy's rules follow it within
        # about a second, and a connection in that second is refused (a CI run
        # met it: docs/operator.md, honest readiness). A user waits for the
        # endpoint too; the first request itself is still asserted by the caller.
        _wait("the Service accepting connections", self._accepts, 60)

    def diagnose(self) -> str:
        """The instance's conditions, the pod's container states, the
        namespace's events, each container's last lines, and the operator's
        pod and last lines (the wait's "last: None" is an instance that no
        status pass reached, or one that kubectl could not read: the first
        command's output tells which)."""
        pod = self.cluster.kubectl(
            "get", "pod", f"{self.name}-0", "-n", self.ns, "-o", "json", check=False
        )
        doc = json.loads(pod.stdout) if pod.returncode == 0 else {}
        names = [c["name"] for c in doc.get("spec", {}).get("containers", [])]
        operator = ("-n", OPERATOR_NS, "deployment/understudy-operator")
        commands = [
            ("get", "gpuinstance", self.name, "-n", self.ns, "-o", "jsonpath={.status}"),
            ("get", "pod", "-n", self.ns, "-o", "wide"),
            ("get", "events", "-n", self.ns, "--sort-by=.lastTimestamp"),
            *(("logs", "-n", self.ns, f"pod/{self.name}-0", "-c", n, "--tail=25") for n in names),
            ("get", "pods", "-n", OPERATOR_NS, "-o", "wide"),
            ("logs", *operator, "--tail=40"),
            ("logs", *operator, "--previous", "--tail=20"),
        ]
        out = [f"--- the pod's containers ---\n{doc.get('status', {}).get('containerStatuses')}"]
        for args in commands:
            proc = self.cluster.kubectl(*args, check=False)
            out.append(
                f"--- kubectl {' '.join(args)} ---\n{proc.stdout[-6000:]}{proc.stderr[-300:]}"
            )
        return "\n".join(out)

    def _accepts(self) -> bool:
        with socket.create_connection(self.address(), timeout=5):
            return True

    def logs(self, container: str, *words: str, last: int = 60) -> str:
        """The container's log lines that hold any of ``words``, the last
        ``last`` of them, for a failure's message (the respawner restarts a
        sidecar in place, so the lines of every process it ran are there)."""
        proc = self.cluster.kubectl(
            "logs", "-n", self.ns, f"pod/{self.name}-0", "-c", container, "--tail=20000",
            check=False,
        )  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if any(w in line for w in words)]
        return f"--- {container}: {len(lines)} lines, the last {last} ---\n" + "\n".join(
            lines[-last:] or [proc.stderr.strip()]
        )

    def drill(self, *args: str, timeout: float = 1800) -> dict[str, Any]:
        what = "-".join(a.strip("-") for a in args[:2])
        out = REPORTS / f"drill-{self.name}-{what}-{int(time.time())}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "understudy.cli",
                "drill",
                "--kube",
                f"{self.ns}/{self.name}",
                "--kubeconfig",
                str(self.cluster.kubeconfig),
                "--output",
                str(out),
                "--timeout",
                "120",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-3000:])
        report = json.loads(out.read_text())
        report["exit_code"] = proc.returncode
        report["path"] = str(out)
        return report


@pytest.fixture(scope="module")
def instance(installed: Any) -> Iterator[Instance]:
    ns = f"e2e-{int(time.time())}"
    installed.kubectl("create", "namespace", ns)
    installed.kubectl("wait", "--for=create", "-n", ns, "serviceaccount/default", "--timeout=30s")
    inst = Instance(installed, ns)
    yield inst
    installed.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_apply_gives_a_serving_pod_with_claim_and_ready_status(instance: Instance) -> None:
    instance.wait_ready()
    pod = instance.pod()
    assert pod["status"]["phase"] == "Running"
    statuses = pod["status"]["containerStatuses"] + pod["status"]["initContainerStatuses"]
    names = {s["name"] for s in statuses}
    assert {"lockserver", "gms", "front", "engine-primary", "engine-shadow-1"} <= names
    assert all(s.get("started") for s in statuses), statuses
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = instance.cluster.get_json("resourceclaim", claim_name, "-n", instance.ns)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert results and results[0]["driver"] == instance.cluster.dra_driver
    assert pod["metadata"]["labels"]["understudy.dev/routable"] == "true"
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("GpuInstance", instance.name)
    vec = _embed(instance.url())
    assert len(vec) > 1000  # 384 float32, base64


@pytest.mark.timeout(1800)
def test_chaos_kill_active_engine_through_the_service(instance: Instance) -> None:
    instance.wait_ready()
    before = _embed(instance.url())
    report = instance.drill("--kills", str(KILLS), "--signal", SIGNALS)
    s = report["summary"]
    assert s["kills"] == KILLS and s["failovers_ok"] == KILLS, s
    # Zero loss is the bar: through the Service, every request answered, and right.
    assert s["failed_requests"] == 0, report.get("errors")
    assert s["wrong_answers"] == 0 and s["split_brain"] == 0 and s["epoch_regressions"] == 0
    # A SIGSTOPped engine is found hung by its heartbeat (1 s); the others fail
    # over at once: the lock server sees the connection close and grants.
    by_signal: dict[str, list[float]] = {}
    for r in report["rounds"]:
        by_signal.setdefault(r["signal"], []).append(r["gap_s"])
        if r["signal"] != "STOP":
            assert r["kill_to_grant_s"] < 0.5, r
    # The client's bound is looser than the grant's: the gap also holds the
    # requests retried onto the engine that just woke, 16 clients' worth on two
    # cores. A CI run at load 4-6 read one of 40 such gaps at 0.59 s (the rest
    # 0.05-0.21 s); a heartbeat-found death would still read over a second.
    for name, gaps in by_signal.items():
        bound = 2.0 if name == "STOP" else 1.0
        assert max(gaps) < bound, (name, sorted(gaps)[-5:])
    assert report["exit_code"] == 0
    cluster = report["cluster"]
    assert {r["signal"] for r in report["rounds"]} == set(SIGNALS.split(","))
    # The kubelet runs its default CrashLoopBackOff (10 s doubling to 5 min):
    # every killed engine was restarted in place by its container's respawner,
    # so no container restarted at all, and every re-arm took a process start,
    # not the back-off that a container restart would have met from the second
    # kill on (docs/pod.md, re-arm on a stock kubelet).
    restarts = cluster["restarts"]
    assert all(v == 0 for v in restarts.values()), restarts
    assert s["rearm_s"]["n"] == KILLS and s["rearm_s"]["max"] < 10.0, s["rearm_s"]
    assert not cluster["left_endpoints"], cluster["seconds_not_an_endpoint"]
    assert _embed(instance.url()) == before


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("scenario", ["takeover-kill", "lockserver", "gms"])
def test_chaos_second_fault_inside_a_failover(instance: Instance, scenario: str) -> None:
    """The engine that took over killed at once; the lock server killed during
    the failover; GMS killed while the next engine wakes: still no failed
    request, no wrong answer, never two Active engines."""
    instance.wait_ready()
    report = instance.drill(
        "--kills", str(SCENARIO_ROUNDS), "--signal", SIGNALS, "--scenario", scenario
    )
    s = report["summary"]
    assert s["failovers_ok"] == SCENARIO_ROUNDS, report["rounds"]
    assert s["failed_requests"] == 0, report.get("errors")
    assert s["wrong_answers"] == 0 and s["split_brain"] == 0 and s["epoch_regressions"] == 0
    # Bounds on the gap, generous for a loaded two-core machine (measured
    # there: 2.6 s, 7.8 s and 10.7 s at load average 6-12): a second engine
    # death is one more failover; a lock server killed mid-failover costs its
    # restart and the holder-gone check; GMS killed during a wake, before the
    # waking engine's remap has mapped, makes every engine reload the weights,
    # the slowest path the pod has (after it, that engine gives them back).
    bound = {"takeover-kill": 5.0, "lockserver": 15.0, "gms": 30.0}[scenario]
    assert s["gap_s"]["max"] < bound, (scenario, s["gap_s"])
    assert report["exit_code"] == 0
    instance.wait_ready(300)


@pytest.mark.timeout(1800)
def test_llama_streams_through_the_service_survive_engine_deaths(installed: Any) -> None:
    """The generative engine on the cluster: 16 clients streaming and not
    through the Service while its Active engines are killed (KILL, SEGV, STOP):
    streams continue on the next engine, and every answer is the same."""
    ns = f"llama-{int(time.time())}"
    installed.kubectl("create", "namespace", ns)
    installed.kubectl("wait", "--for=create", "-n", ns, "serviceaccount/default", "--timeout=30s")
    try:
        # The sample serves SmolLM2-135M; a kill drill under 16 clients wants
        # the 4-layer random-weight Llama, ~10x faster per token.
        tiny = "builtin:tiny-llama"
        inst = Instance(installed, ns, name="tiny-llama", sample="llama", model=tiny)
        inst.wait_ready(600)
        kills = max(6, KILLS // 6)
        report = inst.drill("--kills", str(kills), "--signal", SIGNALS)
        s = report["summary"]
        assert s["failovers_ok"] == kills, report["rounds"]
        assert s["failed_requests"] == 0, report.get("errors")
        assert s["wrong_answers"] == 0 and s["split_brain"] == 0
        assert {"chat-stream", "completion"} <= set(s["requests_by_kind"])
        assert report["exit_code"] == 0
    finally:
        installed.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _conntrack_invalid() -> int | None:
    """Packets conntrack found invalid since boot, every CPU's (None: not
    readable here). kube-proxy's nftables mode no longer drops them, and one
    that is a client's packet to a ClusterIP skips the DNAT and meets the
    "invalid ports of ClusterIPs" reject: a reset our pod never sent."""
    try:
        lines = Path("/proc/net/stat/nf_conntrack").read_text().split("\n")
    except OSError:
        return None
    column = lines[0].split().index("invalid")
    return sum(int(line.split()[column], 16) for line in lines[1:] if line.strip())


def _front_failure(instance: Instance, report: dict[str, Any], invalid: int | None) -> str:
    """What a failed front drill tells, the most telling first (CI shows the
    head of a long message): the log lines that name a failed request's
    client port (an adopted connection names its peer), the kernel's count
    of invalid packets over the drill, the warnings and errors, then every
    connection event of the fronts, their respawner and the keeper."""
    failures = [f for r in report["rounds"] for f in r["failures"]]
    ports = sorted(set(re.findall(r"port (\d+)", " ".join(failures))) - {"0"})
    now = _conntrack_invalid()
    words = (
        "conns_", "adopt", "took_over", "connections_unkept", "lost", "accepting",
        "listening", "child_", "spare", "restart", "promoted", "turn", "witness",
        "connlog_failed",  # a connection served but not kept (its record failed)
        "request_refused",  # a 400 after a kill: what the next front could not parse
    )  # fmt: skip
    parts = [
        f"failures: {failures}",
        instance.logs("front", *(f":{p}" for p in ports)) if ports else "no client port named",
        "conntrack invalid packets during the drill: "
        + (f"{now - invalid}" if now is not None and invalid is not None else "not readable"),
        instance.logs("front", "WARNING", "ERROR", last=80),
        instance.logs("lockserver", "WARNING", "ERROR", last=40),
        instance.logs("front", *words, last=400),
        instance.logs("lockserver", "conns_", "child_", "restart", last=200),
        json.dumps({k: v for k, v in report.items() if k != "rounds"}),
    ]
    return "\n".join(parts)


def _restarts(pod: dict[str, Any], name: str) -> int:
    statuses = pod["status"]["containerStatuses"] + pod["status"]["initContainerStatuses"]
    return next(s["restartCount"] for s in statuses if s["name"] == name)


def _lockserver_started(pod: dict[str, Any]) -> float | None:
    """The lock server process's start time, from its /metrics (prometheus-client's
    process collector), or None while it does not answer."""
    url = f"http://{pod['status']['podIP']}:9101/metrics"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    found = re.search(r"^process_start_time_seconds (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


@pytest.mark.timeout(600)
def test_lockserver_sidecar_killed_no_failover(instance: Instance) -> None:
    """The lock server's process dies: its respawner starts it again in place
    (no container restart, so no kubelet back-off), and the Active engine
    resumes its grant within the reconnect window."""
    instance.wait_ready()
    started = _lockserver_started(instance.pod())
    assert started is not None
    before = _restarts(instance.pod(), "lockserver")
    report = instance.drill("--sidecar", "lockserver")
    now = _wait("the lock server back", lambda: _lockserver_started(instance.pod()), 30)
    assert now > started  # it really died, and a new process serves
    assert _restarts(instance.pod(), "lockserver") == before  # in place
    # the holder resumed its grant: same engine process, same epoch
    assert not report["failover"], report
    assert report["active_after"] == report["active_before"]
    assert report["failed_after_kill"] == 0 and report["distinct_answers"] == 1
    assert not report["cluster"]["left_endpoints"]


@pytest.mark.timeout(900)
def test_gms_sidecar_killed_the_active_engine_gives_the_weights_back(instance: Instance) -> None:
    """GMS killed under load, three times: the Active engine serves on from its
    mappings and gives them back to the restarted GMS (re-adoption): no engine
    restarts, nothing is read from the checkpoint, no request fails, and the
    clients' gap stays that of a request (docs/pod.md, GMS re-adoption)."""
    instance.wait_ready()
    before_vec = _embed(instance.url())
    report = instance.drill("--sidecar", "gms", "--sidecar-clients", "16", "--sidecar-kills", "3")
    assert report["kills"] == 3, report
    assert report["failed_after_kill"] == 0, report
    assert not report["failover"] and report["split_brain"] == 0, report
    assert report["engine_restarts"] == 0 and report["checkpoint_reads"] == 0, report
    assert report["readoptions"] == 3, report
    assert report["distinct_answers"] == 1
    # GMS came back in place (its respawner), so no container restarted either.
    assert all(v == 0 for v in report["cluster"]["restarts"].values()), report["cluster"]
    # A bound for a loaded two-core machine; the measured figures are in
    # docs/failover-report.md with their load average.
    assert report["gap_s"]["max"] < 2.0, report["gap_s"]
    assert _embed(instance.url()) == before_vec


@pytest.mark.timeout(900)
def test_front_killed_ten_times_fails_nothing(instance: Instance) -> None:
    """The front's process dies ten times under 16 request streams: the lock
    server keeps the serving socket and a copy of every client connection,
    the respawner starts the front again in place (kubelet sees no container
    restart, so no CrashLoopBackOff), and the next front finishes every
    connection the dead one had: nothing is refused, nothing fails."""
    instance.wait_ready()
    before = _restarts(instance.pod(), "front")
    invalid = _conntrack_invalid()
    report = instance.drill("--sidecar", "front", "--kills", "10")
    if report["exit_code"] or report["refused"] or report["failed"]:
        pytest.fail(_front_failure(instance, report, invalid))
    assert report["reported_in_flight"] + report["reported_idle"] == 0, report
    assert all(r["back"] for r in report["rounds"]), report
    assert _restarts(instance.pod(), "front") == before  # restarted in place
    assert not report["cluster"]["left_endpoints"]


def test_delete_collects_everything(instance: Instance) -> None:
    c, ns = instance.cluster, instance.ns
    # kubectl's own wait (120 s) bounds it, not the wrapper's default 60 s: the
    # operator drains the pod first (unlisted, then its 30 s grace), and on a
    # loaded node after the kill tests that took more than 60 s once in CI.
    c.kubectl(
        "delete", "gpuinstance", instance.name, "-n", ns, "--wait=true", "--timeout=120s",
        timeout=150,
    )  # fmt: skip
    for kind in ("pods", "services", "resourceclaims", "resourceclaimtemplates"):
        _wait(
            f"{kind} collected",
            lambda k=kind: (
                not c.get_json(k, "-n", ns, "-l", f"understudy.dev/instance={instance.name}")[
                    "items"
                ]
            ),
            120,
        )
