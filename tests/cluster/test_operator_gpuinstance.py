"""The operator against a real Kubernetes API server (hack/cluster).

* The CRD's schema and CEL rules are enforced by a real kube-apiserver: the
  invalid GpuInstances of tests/unit/operator/test_crd.py are rejected with
  their messages, and immutable fields cannot change.
* kopf runs out of cluster (a subprocess: `python -m understudy.operator.cli
  operator run`) with the cluster's kubeconfig: creating a GpuInstance yields
  the claim template, the Service and the pod, each owned by the instance,
  and status conditions reflecting what the API server and kubelet show;
  deleting it lets the garbage collector remove everything.

Engines need the image and the engine shim; until they exist, pods may not
become Ready, so these tests assert what the scheduler, DRA and kubelet show.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from procs import wait_settled

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this tier's helpers
import operator_proc
from crd_guard import this_crd


def _wait(what: str, fn: Callable[[], Any], timeout: float = 90) -> Any:
    return wait_settled(what, fn, timeout)


pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crd_installed(cluster: Any) -> Iterator[Any]:
    with this_crd(cluster):
        yield cluster


def _instance(name: str, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "manifests/samples/gpuinstance-reference.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"].update(spec)
    return doc


def _dry_run(cluster: Any, ns: str, doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "create", "-n", ns, "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False
    )


INVALID = {
    "indices count": ({"gpus": {"count": 2, "indices": [0]}}, "exactly gpus.count"),
    "indices repeat": ({"gpus": {"count": 2, "indices": [1, 1]}}, "must not repeat"),
    "max below min": ({"replicas": {"min": 3, "max": 2}}, "at least replicas.min"),
    "desired above max": ({"replicas": {"min": 1, "desired": 5, "max": 4}}, "at most replicas.max"),
    "port on status port": ({"servingPort": 8101}, "engine status port"),
    "bad adapter": ({"engine": {"adapter": "tgi"}}, "Unsupported value"),
    "zero gpus": ({"gpus": {"count": 0}}, "should be greater than or equal to 1"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_apiserver_rejects_invalid_instances(crd_installed: Any, namespace: str, case: str) -> None:
    change, message = INVALID[case]
    proc = _dry_run(crd_installed, namespace, _instance("bad", **change))
    assert proc.returncode != 0, f"{case} admitted"
    assert message in proc.stderr, proc.stderr


def test_apiserver_admits_the_samples(crd_installed: Any, namespace: str) -> None:
    for path in sorted((ROOT / "manifests/samples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        doc["metadata"].pop("namespace", None)
        proc = _dry_run(crd_installed, namespace, doc)
        assert proc.returncode == 0, proc.stderr


def test_apiserver_enforces_immutable_fields(crd_installed: Any, namespace: str) -> None:
    c = crd_installed
    c.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(_instance("imm")))
    proc = c.kubectl(
        "patch",
        "-n",
        namespace,
        "gpuinstance/imm",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"gpus": {"deviceClassName": "other"}}}),
        check=False,
    )
    assert proc.returncode != 0 and "gpus.deviceClassName is immutable" in proc.stderr
    c.kubectl("delete", "-n", namespace, "gpuinstance/imm", "--wait=false")


def _run_operator(cluster: Any, namespace: str, resync_s: float) -> Any:
    return operator_proc.operator(
        cluster, namespace, cluster.image or "localhost/understudy:dev", resync_s=resync_s
    )


@pytest.fixture
def operator(crd_installed: Any, namespace: str) -> Iterator[Path]:
    with _run_operator(crd_installed, namespace, resync_s=3) as log:
        yield log


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(o["uid"] == uid and o.get("controller") for o in obj["metadata"]["ownerReferences"])


def test_create_then_delete(crd_installed: Any, namespace: str, operator: Any) -> None:
    c = crd_installed
    c.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(_instance("demo")))
    inst = c.get_json("-n", namespace, "gpuinstance/demo")
    uid = inst["metadata"]["uid"]

    pod = _wait("pod demo-0", lambda: c.get_json("-n", namespace, "pod/demo-0"))
    svc = c.get_json("-n", namespace, "service/demo")
    rct = c.get_json("-n", namespace, "resourceclaimtemplate/demo-gpus")
    for obj in (pod, svc, rct):
        assert _owned_by(obj, uid), obj["metadata"]
    assert pod["metadata"]["annotations"]["understudy.dev/attempt"] == "1"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"]["understudy.dev/routable"] == "true"

    def scheduled() -> bool:
        st = c.get_json("-n", namespace, "gpuinstance/demo")["status"]
        conds = {x["type"]: x for x in st["conditions"]}
        assert set(conds) == {"Ready", "Scheduled", "StandbyReady", "Degraded"}
        assert all(x["observedGeneration"] == 1 for x in conds.values())
        return conds["Scheduled"]["status"] == "True"

    # kube-scheduler binds the pod once DRA allocates a fake GPU for its claim.
    _wait("Scheduled=True", scheduled, timeout=120)
    pod = c.get_json("-n", namespace, "pod/demo-0")
    assert pod["spec"]["nodeName"] == c.node_name
    claims = c.get_json("-n", namespace, "resourceclaims")["items"]
    assert any(cl["status"].get("allocation") for cl in claims)
    st = c.get_json("-n", namespace, "gpuinstance/demo")["status"]
    # The routable label mirrors the lock server sidecar's readiness.
    ls_ready = any(
        s["name"] == "lockserver" and s.get("ready")
        for s in pod["status"].get("initContainerStatuses", [])
    )
    assert pod["metadata"]["labels"]["understudy.dev/routable"] == str(ls_ready).lower()
    ready = next(x for x in st["conditions"] if x["type"] == "Ready")
    assert (ready["status"] == "True") == ls_ready
    # No churn: the first placement's pod is still the one (attempt fencing held).
    assert pod["metadata"]["annotations"]["understudy.dev/attempt"] == "1"
    assert st["replicas"][0]["attempt"] == 1 and st["attempt"] == 1
    events = c.get_json("-n", namespace, "events")["items"]
    assert any(e["reason"] == "Placed" and e["involvedObject"]["name"] == "demo" for e in events)

    c.kubectl("delete", "-n", namespace, "gpuinstance/demo", "--timeout=60s")

    def collected() -> bool:
        left = c.kubectl(
            "get",
            "-n",
            namespace,
            "pods,services,resourceclaimtemplates",
            "-l",
            "understudy.dev/instance=demo",
            "-o",
            "name",
        ).stdout.strip()
        return left == ""

    _wait("garbage collection", collected, timeout=120)


def test_deleted_while_its_resync_pass_runs_is_released_at_once(
    crd_installed: Any, namespace: str
) -> None:
    """kopf holds the finalizer until the resync timer's pass exits, then polls.

    Its default poll is 60 s: an instance deleted while a pass ran stayed for a
    minute (CI: `kubectl delete --timeout=60s` timed out). A resync of 50 ms keeps a
    pass running at nearly every deletion, so each of these would wait the poll.
    """
    c = crd_installed
    with _run_operator(c, namespace, resync_s=0.05):
        for i in range(8):
            name = f"del{i}"
            c.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(_instance(name)))
            _wait(f"pod {name}-0", lambda n=name: c.get_json("-n", namespace, f"pod/{n}-0"))
            # While the pod starts, the passes write: they last longest.
            t0 = time.monotonic()
            c.kubectl("delete", "-n", namespace, f"gpuinstance/{name}", "--timeout=20s")
            took = time.monotonic() - t0
            assert took < 10, f"{name}: the deletion took {took:.1f} s"
