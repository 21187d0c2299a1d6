"""Scale, autoscale and roll out GpuInstances on the real cluster (operator out of cluster).

* ``kubectl scale`` moves ``spec.replicas.desired`` through the scale
  subresource; the operator adds pods, reports ``status.currentReplicas`` and
  the selector, and scales back down highest index first, draining.
* An HPA (autoscaling/v2) targeting a GpuInstance is admitted and can read
  its scale (``AbleToScale``); there is no metrics server here, so it never
  acts.
* The built-in autoscaler goes 1 -> N under request pressure reported by
  the fronts and back to min after the stabilisation window. It needs the
  front's ``/pressure`` (``understudy.front``) in the pod: without it the
  test skips, saying so.
* A spec change of a one-replica instance under a continuous request stream
  through the Service fails no request: the new pod serves before the old
  one is unrouted, and the old one is deleted only once out of the
  EndpointSlices.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from procs import wait_settled

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this tier's helpers
from crd_guard import this_crd
from operator_proc import operator

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FRONT_PORT = 8090


def _wait(what: str, fn: Callable[[], Any], timeout: float = 180) -> Any:
    return wait_settled(what, fn, timeout)


@pytest.fixture(scope="module")
def crd_installed(cluster: Any) -> Iterator[Any]:
    with this_crd(cluster):
        yield cluster


def synthetic(name: str, device_class: str, **spec: Any) -> dict[str, Any]:
    """A light instance: the synthetic engine, 1 MiB of weights, no shadow."""
    doc: dict[str, Any] = {
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "GpuInstance",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "1MiB"},
            "engine": {"adapter": "synthetic", "resources": {"requests": {"cpu": "50m"}}},
            "gpus": {"count": 1, "deviceClassName": device_class},
            "gms": {"backend": "host"},
            "failover": {"enabled": False, "startupBudgetSeconds": 120},
            "drain": {"settleSeconds": 1, "gracePeriodSeconds": 10},
        },
    }
    doc["spec"].update(spec)
    return doc


def reference(name: str, device_class: str, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "manifests/samples/gpuinstance-reference.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["gpus"]["deviceClassName"] = device_class
    doc["spec"].update(spec)
    return doc


class Inst:
    def __init__(self, cluster: Any, ns: str, doc: dict[str, Any]) -> None:
        self.c, self.ns, self.name = cluster, ns, doc["metadata"]["name"]
        cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(doc))

    def get(self) -> dict[str, Any]:
        return self.c.get_json("-n", self.ns, f"gpuinstance/{self.name}")

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = self.get().get("status") or {}
        return st

    def pods(self) -> dict[str, dict[str, Any]]:
        items = self.c.get_json("-n", self.ns, "pods", "-l", f"understudy.dev/instance={self.name}")
        return {p["metadata"]["name"]: p for p in items["items"]}

    def live_pods(self) -> set[str]:
        return {n for n, p in self.pods().items() if not p["metadata"].get("deletionTimestamp")}

    def serving(self) -> int:
        return int(self.status().get("readyReplicas", 0))

    def endpoints(self) -> set[str]:
        slices = self.c.get_json(
            "-n", self.ns, "endpointslices", "-l", f"kubernetes.io/service-name={self.name}"
        )
        return {
            ep["targetRef"]["name"]
            for sl in slices["items"]
            for ep in sl.get("endpoints") or []
            if (ep.get("targetRef") or {}).get("kind") == "Pod"
        }

    def url(self) -> str:
        svc = self.c.get_json("-n", self.ns, f"service/{self.name}")
        return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"

    def events(self, reason: str) -> list[dict[str, Any]]:
        items = self.c.get_json("-n", self.ns, "events")["items"]
        return [
            e for e in items if e["reason"] == reason and e["involvedObject"]["name"] == self.name
        ]


def test_kubectl_scale_up_and_down(crd_installed: Any, namespace: str, image: str) -> None:
    c = crd_installed
    with operator(c, namespace, image):
        inst = Inst(c, namespace, synthetic("sc", c.device_class, replicas={"min": 1, "max": 3}))
        _wait("one replica serving", lambda: inst.serving() == 1)
        st = inst.status()
        assert st["currentReplicas"] == 1 and st["selector"] == "understudy.dev/instance=sc"

        c.kubectl("scale", "-n", namespace, "gpuinstance/sc", "--replicas=3")
        assert inst.get()["spec"]["replicas"]["desired"] == 3
        _wait("three replicas serving", lambda: inst.serving() == 3)
        assert inst.live_pods() == {"sc-0", "sc-1", "sc-2"}
        scale = json.loads(
            c.kubectl(
                "get", "-n", namespace, "gpuinstance/sc", "--subresource=scale", "-o", "json"
            ).stdout
        )
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
        assert scale["status"] == {"replicas": 3, "selector": "understudy.dev/instance=sc"}

        c.kubectl("scale", "-n", namespace, "gpuinstance/sc", "--replicas=1")
        _wait("back to one replica", lambda: inst.live_pods() == {"sc-0"}, 120)
        _wait("status follows", lambda: inst.status()["currentReplicas"] == 1)
        assert inst.serving() == 1
        draining = [e["message"] for e in inst.events("ScaledDown")]
        assert any("replica 2 scaled down: draining" in m for m in draining), draining
        assert any("replica 1 scaled down: draining" in m for m in draining), draining

        # Above max (or above min on a fixed instance) the apiserver refuses.
        proc = c.kubectl("scale", "-n", namespace, "gpuinstance/sc", "--replicas=4", check=False)
        assert proc.returncode != 0 and "at most replicas.max" in proc.stderr


def test_an_hpa_targeting_a_gpuinstance_is_accepted_and_reads_its_scale(
    crd_installed: Any, namespace: str
) -> None:
    c = crd_installed
    doc = synthetic("hpa", c.device_class, replicas={"min": 1, "desired": 1, "max": 3})
    Inst(c, namespace, doc)  # no operator: the HPA reads the scale subresource only
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "hpa"},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "understudy.dev/v1alpha1",
                "kind": "GpuInstance",
                "name": "hpa",
            },
            "minReplicas": 1,
            "maxReplicas": 3,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": 80},
                    },
                }
            ],
        },
    }
    c.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(hpa))

    def able() -> bool:
        st = c.get_json("-n", namespace, "hpa/hpa").get("status") or {}
        conds = {x["type"]: x for x in st.get("conditions") or []}
        return conds.get("AbleToScale", {}).get("status") == "True"

    _wait("HPA AbleToScale", able, 90)
    st = c.get_json("-n", namespace, "hpa/hpa")["status"]
    conds = {x["type"]: x for x in st["conditions"]}
    assert conds["AbleToScale"]["reason"] == "SucceededGetScale"


# ------------------------------------------------------------ request stream


class Stream:
    """Clients sending requests through the Service back to back, counting failures."""

    def __init__(self, url: str, path: str, body: dict[str, Any], clients: int = 1) -> None:
        self.url, self.path, self.body = url, path, json.dumps(body).encode()
        self.ok = 0
        self.failed: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _one(self) -> None:
        req = urllib.request.Request(
            self.url + self.path,
            method="POST",
            data=self.body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._one()
            except (urllib.error.URLError, OSError, TimeoutError) as exc:
                with self._lock:
                    self.failed.append((time.time(), repr(exc)))
            else:
                with self._lock:
                    self.ok += 1

    def __enter__(self) -> Stream:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)


EMBED = ("/v1/embeddings", {"input": "a request during a rollout", "encoding_format": "base64"})


def answer(url: str) -> bool:
    req = urllib.request.Request(
        url + EMBED[0],
        method="POST",
        data=json.dumps(EMBED[1]).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.status == 200


@pytest.mark.timeout(900)
def test_spec_change_with_one_replica_under_load_fails_no_request(
    crd_installed: Any, namespace: str, image: str
) -> None:
    c = crd_installed
    doc = reference("roll", c.device_class, drain={"settleSeconds": 2, "gracePeriodSeconds": 60})
    with operator(c, namespace, image):
        inst = Inst(c, namespace, doc)
        _wait("serving", lambda: inst.serving() == 1 and inst.endpoints() == {"roll-0"}, 300)
        _wait("an answer through the Service", lambda: answer(inst.url()), 300)
        with Stream(inst.url(), *EMBED) as stream:
            _wait("requests flowing", lambda: stream.ok > 20, 60)
            before = stream.ok
            changed = time.time()
            patch = {"spec": {"engine": {"resources": {"requests": {"cpu": "240m"}}}}}
            c.kubectl(
                "patch",
                "-n",
                namespace,
                "gpuinstance/roll",
                "--type=merge",
                "-p",
                json.dumps(patch),
            )
            # Surge first: a second pod appears while the first still serves.
            _wait("replacement created", lambda: "roll-1" in inst.pods(), 60)
            seen_without_endpoint = []

            def rolled() -> bool:
                eps = inst.endpoints()
                if not eps:
                    seen_without_endpoint.append(time.time())
                return inst.live_pods() == {"roll-1"} and eps == {"roll-1"}

            _wait("rolled over to the new pod", rolled, 400)
            took = time.time() - changed
            time.sleep(3)  # a few more requests against the new pod alone
        print(
            f"\nrollout of one replica: {took:.1f} s, {stream.ok} requests ok "
            f"({stream.ok - before} during and after it), {len(stream.failed)} failed"
        )
        assert stream.failed == [], stream.failed[:5]
        assert stream.ok > before + 20
        assert not seen_without_endpoint
        st = inst.status()
        assert st["updatedReplicas"] == 1 and st["replicas"][0]["index"] == 1
        assert inst.events("SpecChanged"), "the old replica's drain was not reported"


# ------------------------------------------------------------ autoscaler


def _front_answers(pod: dict[str, Any]) -> bool:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return False
    try:
        with urllib.request.urlopen(f"http://{ip}:{FRONT_PORT}/pressure", timeout=2) as resp:
            data = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return isinstance(data, dict) and "inflight" in data and "held" in data


@pytest.mark.timeout(900)
def test_builtin_autoscaler_scales_up_under_pressure_and_back_to_min(
    crd_installed: Any, namespace: str, image: str
) -> None:
    c = crd_installed
    doc = reference(
        "auto",
        c.device_class,
        replicas={"min": 1, "max": 3},
        autoscaling={
            "enabled": True,
            "targetPressure": 2,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 30,
        },
    )
    with operator(c, namespace, image):
        inst = Inst(c, namespace, doc)
        _wait("serving", lambda: inst.serving() == 1, 300)
        _wait("an answer through the Service", lambda: answer(inst.url()), 300)
        # The built-in autoscaler reads pressure from the pod's front door.
        assert _front_answers(inst.pods()["auto-0"]), "no front in the pod (GET :8090/pressure)"
        with Stream(inst.url(), *EMBED, clients=12) as stream:
            loaded = time.time()
            _wait("scaled up", lambda: inst.get()["spec"]["replicas"]["desired"] > 1, 120)
            up_s = time.time() - loaded
            _wait("more replicas serving", lambda: inst.serving() > 1, 300)
            serving_s = time.time() - loaded
            peak = inst.get()["spec"]["replicas"]["desired"]
            auto = inst.status()["autoscaler"]
            assert auto["reason"] in ("ScaleUp", "Stable", "Stabilizing"), auto
        assert stream.failed == [], stream.failed[:5]
        stopped = time.time()
        _wait("back to min", lambda: inst.get()["spec"]["replicas"]["desired"] == 1, 180)
        waited = time.time() - stopped
        assert waited >= 25, f"scaled down {waited:.0f} s after the load stopped: window ignored"
        _wait("one pod left", lambda: inst.live_pods() == {"auto-0"}, 180)
        print(
            f"\nautoscaler: desired 1 -> {peak} {up_s:.1f} s after the load began "
            f"({serving_s:.1f} s to a second serving replica), back to 1 {waited:.1f} s after "
            f"it ended (window 30 s); {stream.ok} requests ok, {len(stream.failed)} failed; "
            f"last pressure {auto.get('pressure')} ({auto['message']})"
        )
        assert peak >= 2
        assert inst.events("Idle") or inst.events("ScaleDown")
