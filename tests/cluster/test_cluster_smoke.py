"""Smoke test of the local cluster: the Kubernetes features Understudy's pod relies on.

Each test checks what a real cluster did (object status, container logs,
bytes over a Service), not which calls were made.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .conftest import Cluster

# These check hack/cluster's own cluster (its node, base image and fake GPUs).
pytestmark = [pytest.mark.cluster, pytest.mark.harness]

PY = "python3"
SERVE = "http.server.ThreadingHTTPServer(({addr!r}, {port}), http.server.SimpleHTTPRequestHandler)"


def wait_pod_phase(
    cluster: Cluster, ns: str, name: str, phases: set[str], timeout: float = 90
) -> dict[str, Any]:
    """Poll until the pod reaches one of PHASES; fail with its status and events otherwise."""
    deadline = time.monotonic() + timeout
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pod = cluster.get_json("pod", "-n", ns, name)
        if pod.get("status", {}).get("phase") in phases:
            return pod
        if pod.get("status", {}).get("phase") == "Failed":
            break
        time.sleep(0.5)
    events = cluster.kubectl("get", "events", "-n", ns, "-o", "wide", check=False).stdout
    pytest.fail(
        f"pod {ns}/{name} not in {phases}:\n{json.dumps(pod.get('status'), indent=1)}\n{events}"
    )


def test_node_ready(cluster: Cluster) -> None:
    node = cluster.get_json("node", cluster.node_name)
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True"
    assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("v1.36.")


def test_native_sidecar_gates_main_container(cluster: Cluster, namespace: str) -> None:
    # The sidecar becomes "started" only when its startup probe passes (it
    # writes /shared/ready after 2 s and serves HTTP). The main container
    # checks at its start that the file exists and the sidecar answers, i.e.
    # that it was started after the sidecar, which still runs beside it.
    sidecar_cmd = (
        "import http.server, pathlib, time\n"
        "time.sleep(2)\n"
        "pathlib.Path('/shared/ready').write_text(str(time.time()))\n"
        + SERVE.format(addr="127.0.0.1", port=8081)
        + ".serve_forever()\n"
    )
    main_cmd = (
        "import os, time, urllib.request\n"
        "ready = os.path.exists('/shared/ready')\n"
        "ans = urllib.request.urlopen('http://127.0.0.1:8081/', timeout=5).status\n"
        "print(f'sidecar_ready_at_start={ready} sidecar_http={ans}', flush=True)\n"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sidecar"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "shared", "emptyDir": {}}],
            "initContainers": [
                {
                    "name": "sidecar",
                    "image": cluster.base_image,
                    "restartPolicy": "Always",
                    "command": [PY, "-c", sidecar_cmd],
                    "workingDir": "/shared",
                    "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
                    "startupProbe": {
                        "exec": {"command": ["test", "-f", "/shared/ready"]},
                        "periodSeconds": 1,
                        "failureThreshold": 30,
                    },
                }
            ],
            "containers": [
                {
                    "name": "main",
                    "image": cluster.base_image,
                    "command": [PY, "-c", main_cmd],
                    "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
                }
            ],
        },
    }
    cluster.apply(json.dumps(pod), namespace)
    done = wait_pod_phase(cluster, namespace, "sidecar", {"Succeeded"})
    logs = cluster.kubectl("logs", "-n", namespace, "sidecar", "-c", "main").stdout
    assert "sidecar_ready_at_start=True sidecar_http=200" in logs
    sidecar_status = done["status"]["initContainerStatuses"][0]
    main_status = done["status"]["containerStatuses"][0]
    sidecar_started = sidecar_status["state"].get(
        "running", sidecar_status["state"].get("terminated", {})
    )
    assert main_status["state"]["terminated"]["exitCode"] == 0
    assert main_status["state"]["terminated"]["startedAt"] >= sidecar_started["startedAt"]


def test_service_cluster_ip_routes_to_pod(cluster: Cluster, namespace: str) -> None:
    token = uuid.uuid4().hex
    serve = (
        "import http.server, os, pathlib\n"
        "os.chdir('/tmp')\n"
        f"pathlib.Path('token').write_text('{token}')\n"
        + SERVE.format(addr="0.0.0.0", port=8080)
        + ".serve_forever()\n"
    )
    manifest = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "web", "labels": {"app": "web"}},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "web",
                        "image": cluster.base_image,
                        "command": [PY, "-c", serve],
                        "ports": [{"containerPort": 8080}],
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                    }
                ],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    ]
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": manifest}), namespace)
    cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", "pod/web", "--timeout=90s", timeout=100
    )
    ip = cluster.get_json("service", "-n", namespace, "web")["spec"]["clusterIP"]
    assert ip.startswith("10.96."), ip  # our Service CIDR, routed only to our bridge
    # kube-proxy programs the rules asynchronously: retry for a bounded time.
    deadline = time.monotonic() + 30
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{ip}:80/token", timeout=2) as resp:
                assert resp.read().decode() == token
                return
        except OSError as e:  # connection refused/reset/timeout until rules land
            last = e
            time.sleep(0.5)
    pytest.fail(f"Service {ip}:80 never answered: {last!r}")


def test_dra_claim_template_shared_by_two_containers(cluster: Cluster, namespace: str) -> None:
    # One ResourceClaim (from a template) referenced by two containers, like
    # the gms sidecar and the two engines in Understudy's pod. The selector
    # uses the attributes the fake driver publishes.
    driver = cluster.dra_driver
    selector = (
        f'device.attributes["{driver}"].productName == "Fake-A100" && '
        f'device.capacity["{driver}"].memory.compareTo(quantity("40Gi")) >= 0'
    )
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": cluster.device_class,
                                "count": 1,
                                "selectors": [{"cel": {"expression": selector}}],
                            },
                        }
                    ]
                }
            }
        },
    }
    show_env = (
        "import os, time\n"
        "print('gpus=' + os.environ.get('UNDERSTUDY_GPU_UUIDS', ''), flush=True)\n"
        "time.sleep(3600)\n"
    )
    containers = [
        {
            "name": name,
            "image": cluster.base_image,
            "command": [PY, "-c", show_env],
            "resources": {"claims": [{"name": "gpu"}]},
        }
        for name in ("primary", "shadow")
    ]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "dra"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            "containers": containers,
        },
    }
    cluster.apply(json.dumps(template), namespace)
    cluster.apply(json.dumps(pod), namespace)
    running = wait_pod_phase(cluster, namespace, "dra", {"Running"})
    states = {s["name"]: s["state"] for s in running["status"]["containerStatuses"]}
    assert set(states) == {"primary", "shadow"}
    assert all("running" in st for st in states.values()), states

    claim_name = running["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = cluster.get_json("resourceclaim", "-n", namespace, claim_name)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 1
    assert results[0]["driver"] == driver
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["dra"]

    # The driver hands the device to both containers through CDI: each sees
    # the uuid the ResourceSlice publishes for the allocated device.
    slices = cluster.get_json("resourceslices")["items"]
    uuids = {
        d["name"]: d["attributes"]["uuid"]["string"]
        for sl in slices
        if sl["spec"]["driver"] == driver
        for d in sl["spec"]["devices"]
    }
    want = f"gpus={uuids[results[0]['device']]}"
    deadline = time.monotonic() + 30
    logs: dict[str, str] = {}
    while time.monotonic() < deadline:
        logs = {
            c: cluster.kubectl("logs", "-n", namespace, "dra", "-c", c).stdout
            for c in ("primary", "shadow")
        }
        if all(want in out for out in logs.values()):
            break
        time.sleep(0.5)
    assert all(want in out for out in logs.values()), (want, logs)
