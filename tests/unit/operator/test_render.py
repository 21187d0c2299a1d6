"""Rendering follows docs/pod.md, and every rendered object validates (Kubernetes 1.34+)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import instances
import kubernetes_validate
import pytest
import yaml
from commands import parse

from understudy.operator import render
from understudy.operator.api import GpuInstance

ROOT = Path(__file__).resolve().parents[3]
CFG = render.RenderConfig(image="localhost/understudy:dev")
VERSIONS = ["1.34.0", "1.35.0", "1.36.0", "1.37.0"]


def make(**spec: Any) -> GpuInstance:
    return instances.make(**spec)


SHAPES = {
    "default": {},
    "no-failover": {"failover": {"enabled": False}},
    "three-shadows-4gpu": {"failover": {"shadows": 3}, "gpus": {"count": 4}},
    "shared-indices": {"gpus": {"count": 2, "exclusive": False, "indices": [2, 3]}},
    "vllm-path": {
        "engine": {"adapter": "vllm", "args": ["--x", "1"]},
        "model": {"source": "/m/a", "path": "/m"},
    },
    "selectors": {
        "gpus": {"selectors": [{"cel": 'device.attributes["gpu.understudy.dev"].index == 0'}]}
    },
    "placement": {
        "placement": {"nodeSelector": {"gpu": "yes"}, "targetNode": "n1"},
        "replicas": {"min": 2},
    },
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("version", VERSIONS)
def test_every_rendered_object_validates(shape: str, version: str) -> None:
    inst = make(**SHAPES[shape])
    for obj in render.render_all(inst, CFG):
        kubernetes_validate.validate(obj, version, strict=True)


def _pod(inst: GpuInstance, node: str | None = None) -> dict[str, Any]:
    return render.render_pod(inst, 0, 3, node, CFG)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "<ref>") for e in container["env"]}


def test_pod_layout_matches_the_contract() -> None:
    pod = _pod(make())
    spec = pod["spec"]
    init = spec["initContainers"]
    assert [c["name"] for c in init] == ["lockserver", "gms", "front"]
    assert all(c["restartPolicy"] == "Always" for c in init)  # native sidecars
    # The front may end a hung engine; no engine is PID 1 (signals work as on a crash).
    assert spec["shareProcessNamespace"] is True
    assert [c["name"] for c in spec["containers"]] == ["engine-primary", "engine-shadow-1"]
    assert pod["metadata"]["name"] == "demo-0"
    assert pod["metadata"]["annotations"]["understudy.dev/attempt"] == "3"
    assert pod["metadata"]["labels"]["understudy.dev/routable"] == "false"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert spec["volumes"][0] == {
        "name": "run",
        "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"},
    }
    for c in init + spec["containers"]:
        assert {"name": "run", "mountPath": "/run/understudy"} in c["volumeMounts"]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 65532


def _argv(container: dict[str, Any]) -> list[str]:
    return [*container["command"], *container["args"]]


def test_lockserver_sidecar() -> None:
    ls = _pod(make(failover={"lockReconnectWindowSeconds": 7}))["spec"]["initContainers"][0]
    assert ls["command"] == ["understudy"]
    # Under the respawner, without a spare: a lock server's start is quick.
    respawn, serve = parse(_argv(ls))
    assert respawn["command"] == "respawn" and not respawn["spare"] and respawn["listen"] == []
    assert (serve["command"], serve["lockserver_command"]) == ("lockserver", "serve")
    assert serve["socket"] == "/run/understudy/lock.sock"
    assert serve["state_file"] == "/run/understudy/lock.state"
    assert serve["reconnect_window"] == 7
    assert serve["metrics_port"] == 9101
    assert serve["serving_port"] == 8000  # it keeps the serving socket for the front
    assert serve["tcp"] is None  # a pod's lock is its Unix socket
    (status,) = parse(ls["startupProbe"]["exec"]["command"])
    assert (status["command"], status["lock_command"]) == ("lock", "status")
    assert status["socket"] == serve["socket"] and status["timeout"] == 1
    assert "readinessProbe" not in ls  # routing follows the front, not the lock server
    assert "claims" not in ls["resources"]


def test_front_sidecar_serves_the_port_under_the_respawner() -> None:
    inst = make(failover={"holdSeconds": 12, "migrationLimit": 2, "hangAfterSeconds": 1.5})
    front = _pod(inst)["spec"]["initContainers"][2]
    # A spare at once; the child is `python -m understudy.front`, without the
    # dispatcher's entry-point scan.
    child = front["args"][front["args"].index("--") + 1 :]
    assert child[:3] == ["python", "-m", "understudy.front"]
    respawn, serve = parse(_argv(front))
    assert respawn["spare"] and respawn["spare_after"] == 0
    # The status port is the respawner's: kubelet's probes outlive each front.
    # The serving port is the lock server's to hand over, never the respawner's.
    assert respawn["listen"] == ["status=0.0.0.0:8090"]
    assert (serve["command"], serve["front_command"]) == ("front", "serve")
    assert serve["run_dir"] == "/run/understudy"
    assert (serve["port"], serve["status_port"]) == (8000, 8090)
    assert (serve["hold"], serve["migration_limit"], serve["hang_after"]) == (12, 2, 1.5)
    assert serve["drain"] == 25
    assert {p["containerPort"] for p in front["ports"]} == {8000, 8090}
    rp = front["readinessProbe"]
    assert rp["httpGet"] == {"path": "/ready", "port": 8090, "scheme": "HTTP"}
    assert (rp["periodSeconds"], rp["failureThreshold"]) == (1, 3)
    svc = render.render_service(inst)
    assert svc["spec"]["ports"][0]["targetPort"] in (8000, "http")


def test_gms_sidecar() -> None:
    gms = _pod(make(gpus={"count": 3}))["spec"]["initContainers"][1]
    # A GMS that dies is back at once (docs/pod.md).
    respawn, serve = parse(_argv(gms))
    assert respawn["command"] == "respawn" and not respawn["spare"]
    assert (serve["command"], serve["gms_command"]) == ("gms", "serve")
    assert serve["socket_dir"] == "/run/understudy/gms"
    assert serve["devices"] == (0, 1, 2)
    assert serve["backend"] == "host"
    assert serve["metrics_port"] == 9102
    (ready,) = parse(gms["startupProbe"]["exec"]["command"])
    assert (ready["command"], ready["gms_command"]) == ("gms", "wait-ready")
    assert (ready["socket_dir"], ready["devices"]) == (serve["socket_dir"], serve["devices"])
    assert ready["timeout"] == 1
    assert gms["resources"]["claims"] == [{"name": "gpus"}]


def test_engine_containers_env_and_probes() -> None:
    inst = make(
        failover={"shadows": 2, "startupBudgetSeconds": 600, "lockReconnectWindowSeconds": 10}
    )
    engines = _pod(inst)["spec"]["containers"]
    assert [c["name"] for c in engines] == ["engine-primary", "engine-shadow-1", "engine-shadow-2"]
    for i, c in enumerate(engines):
        env = _env(c)
        assert env["ENGINE_ROLE"] == ("primary" if i == 0 else "shadow")
        assert env["UNDERSTUDY_ENGINE_NAME"] == c["name"]
        assert env["UNDERSTUDY_STATUS_PORT"] == str(8100 + i)
        assert "UNDERSTUDY_SERVE_PORT" not in env  # engines listen on a Unix socket
        assert env["UNDERSTUDY_DRAIN_S"] == "25"
        assert env["UNDERSTUDY_LOCK_SOCKET"] == "/run/understudy/lock.sock"
        assert env["UNDERSTUDY_GMS_SOCKET_DIR"] == "/run/understudy/gms"
        assert env["UNDERSTUDY_GMS_BACKEND"] == "host"
        assert env["UNDERSTUDY_DEVICES"] == "0"
        assert env["UNDERSTUDY_ENGINE_ADAPTER"] == "reference"
        assert env["UNDERSTUDY_MODEL"] == "builtin:all-MiniLM-L6-v2"
        assert json.loads(env["UNDERSTUDY_ENGINE_ARGS"]) == []
        assert env["UNDERSTUDY_STARTUP_BUDGET_S"] == "600"
        assert env["UNDERSTUDY_LOCK_RECONNECT_S"] == "15"
        assert env["POD_NAME"] == env["POD_NAMESPACE"] == "<ref>"
        port = 8100 + i
        # The respawner restarts the engine in place from a spare, and holds
        # its status port across the restarts (docs/pod.md).
        respawn, run = parse(_argv(c))
        assert respawn["spare"] and respawn["listen"] == [f"status=0.0.0.0:{port}"]
        assert (run["command"], run["engine_command"]) == ("engine", "run")
        assert run["engine"] is None  # the adapter comes from the environment
        sp = c["startupProbe"]
        assert sp["httpGet"]["path"] == "/startup" and sp["httpGet"]["port"] == port
        assert sp["failureThreshold"] * sp["periodSeconds"] == 600
        assert c["livenessProbe"]["httpGet"]["path"] == "/live"
        assert c["livenessProbe"]["terminationGracePeriodSeconds"] == 1
        assert env["OPENBLAS_NUM_THREADS"] == "1"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["resources"]["claims"] == [{"name": "gpus"}]
        # Nobody declares the serving port: only the Active engine binds it.
        assert [p["containerPort"] for p in c["ports"]] == [port]


def test_failover_disabled_renders_only_the_primary() -> None:
    assert [c["name"] for c in _pod(make(failover={"enabled": False}))["spec"]["containers"]] == [
        "engine-primary"
    ]


def test_claim_template_shared_by_gms_and_engines() -> None:
    inst = make(gpus={"count": 2, "selectors": [{"cel": "true"}]})
    claim = render.render_claim(inst)
    assert claim["kind"] == "ResourceClaimTemplate" and claim["apiVersion"] == "resource.k8s.io/v1"
    exactly = claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["deviceClassName"] == "gpu.understudy.dev" and exactly["count"] == 2
    assert exactly["selectors"] == [{"cel": {"expression": "true"}}]
    pod = _pod(inst)
    assert pod["spec"]["resourceClaims"] == [
        {"name": "gpus", "resourceClaimTemplateName": "demo-gpus"}
    ]


def test_shared_gpus_use_one_claim_and_indices_become_a_selector() -> None:
    inst = make(gpus={"count": 2, "exclusive": False, "indices": [1, 3]})
    claim = render.render_claim(inst)
    assert claim["kind"] == "ResourceClaim"
    sel = claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    assert sel == [
        {"cel": {"expression": 'device.attributes["gpu.understudy.dev"].index in [1, 3]'}}
    ]
    assert _pod(inst)["spec"]["resourceClaims"] == [
        {"name": "gpus", "resourceClaimName": "demo-gpus"}
    ]


def test_service_is_the_readiness_trap_service() -> None:
    svc = render.render_service(make(servingPort=8080))
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {
        "understudy.dev/instance": "demo",
        "understudy.dev/routable": "true",
    }
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": 8080, "protocol": "TCP"}
    ]


def test_placement_is_node_affinity_never_node_name() -> None:
    pod = _pod(make(placement={"nodeSelector": {"a": "b"}}), node="n7")
    assert "nodeName" not in pod["spec"]
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n7"]
    assert pod["spec"]["nodeSelector"] == {"a": "b"}


def test_spec_hash_ignores_placement_and_follows_the_spec() -> None:
    a = _pod(make(), node="n1")["metadata"]["annotations"]["understudy.dev/spec-hash"]
    b = _pod(make(), node=None)["metadata"]["annotations"]["understudy.dev/spec-hash"]
    c = _pod(make(gpus={"count": 2}))["metadata"]["annotations"]["understudy.dev/spec-hash"]
    assert a == b != c


def test_read_only_root_except_vllm() -> None:
    ro = [
        c["securityContext"]["readOnlyRootFilesystem"] for c in _pod(make())["spec"]["containers"]
    ]
    assert all(ro)
    vllm = _pod(make(engine={"adapter": "vllm"}))["spec"]["containers"]
    assert not any(c["securityContext"]["readOnlyRootFilesystem"] for c in vllm)


def test_render_cli_prints_a_yaml_stream() -> None:
    sample = ROOT / "manifests" / "samples" / "gpuinstance-reference.yaml"
    out = subprocess.run(
        [sys.executable, "-m", "understudy.operator.cli", "render", "-f", str(sample)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    docs = list(yaml.safe_load_all(out.stdout))
    assert [d["kind"] for d in docs] == ["ResourceClaimTemplate", "Service", "Pod"]
    for d in docs:
        kubernetes_validate.validate(d, "1.34.0", strict=True)


def test_tolerations_are_rendered_into_the_pod() -> None:
    inst = GpuInstance.from_body(
        {
            "metadata": {"name": "d", "uid": "u"},
            "spec": {
                "model": {"source": "x"},
                "placement": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
            },
        }
    )
    assert render.pod_spec(inst, render.RenderConfig())["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists"}
    ]
    plain = GpuInstance.from_body(
        {"metadata": {"name": "d", "uid": "u"}, "spec": {"model": {"source": "x"}}}
    )
    assert "tolerations" not in render.pod_spec(plain, render.RenderConfig())


def test_drain_grace_sets_the_pods_grace_and_the_drains_within_it() -> None:
    inst = make(drain={"gracePeriodSeconds": 300})
    spec = render.pod_spec(inst, render.RenderConfig())
    assert spec["terminationGracePeriodSeconds"] == 300
    front = next(c for c in spec["initContainers"] if c["name"] == "front")
    assert parse(_argv(front))[1]["drain"] == 295
    for c in spec["containers"]:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UNDERSTUDY_DRAIN_S"] == "295"
    # The default renders the pod contract's 30 s grace and 25 s drains.
    assert render.pod_spec(make(), render.RenderConfig())["terminationGracePeriodSeconds"] == 30
