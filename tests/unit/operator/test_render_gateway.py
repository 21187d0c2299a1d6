"""The gateway's objects (an instance with a ``gateway`` section): each one
validates (Kubernetes 1.34+), the command is read back with the gateway's own
parser, and an instance without the section renders what it did before."""

from __future__ import annotations

from typing import Any

import instances
import kubernetes_validate
import pytest
from commands import parse

from understudy.operator import plan as planner
from understudy.operator import render
from understudy.operator.api import GpuInstance
from understudy.operator.view import Observed

CFG = render.RenderConfig(image="localhost/understudy:dev")
VERSIONS = ["1.34.0", "1.35.0", "1.36.0", "1.37.0"]


def make(**spec: Any) -> GpuInstance:
    return instances.make("builtin:tiny-llama", **spec)


KEYED = {"apiKeySecret": {"name": "demo-keys", "key": "keys.txt"}}


def by_kind(inst: GpuInstance) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render.render_all(inst, CFG)}


@pytest.mark.parametrize("gateway", [{}, KEYED, {"replicas": 1, "holdSeconds": 5}], ids=str)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_gateway_object_validates(gateway: dict[str, Any], version: str) -> None:
    inst = make(gateway=gateway, replicas={"min": 2})
    for obj in render.render_all(inst, CFG):
        kubernetes_validate.validate(obj, version, strict=True)


def test_without_the_section_nothing_of_the_gateway_is_rendered() -> None:
    plain = make()
    assert plain.spec.gateway is None
    assert render.render_gateway(plain, CFG) == []
    assert [o["kind"] for o in render.render_all(plain, CFG)] == [
        "ResourceClaimTemplate",
        "Service",
        "Pod",
    ]
    svc = render.render_service(plain)
    assert svc["spec"]["selector"] == {
        "understudy.dev/instance": "demo",
        "understudy.dev/routable": "true",
    }
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert render.endpoints_service_name(plain) == "demo"


def test_the_gateway_objects_and_their_owner() -> None:
    inst = make(gateway={})
    objs = by_kind(inst)
    assert set(objs) == {
        ("ResourceClaimTemplate", "demo-gpus"),
        ("Service", "demo"),
        ("Pod", "demo-0"),
        ("ServiceAccount", "demo-gateway"),
        ("Role", "demo-gateway"),
        ("RoleBinding", "demo-gateway"),
        ("Service", "demo-pods"),
        ("PodDisruptionBudget", "demo-gateway"),
        ("Deployment", "demo-gateway"),
    }
    for obj in objs.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"] == [render.owner_reference(inst)]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "understudy-operator"
    # What the plan deletes when the section goes is exactly what it renders.
    rendered = {
        (o["apiVersion"], o["kind"], o["metadata"]["name"])
        for o in render.render_gateway(inst, CFG)
    }
    assert set(render.gateway_objects(inst)) == rendered


def test_the_client_service_selects_the_gateway_and_the_headless_one_every_pod() -> None:
    inst = make(gateway={}, servingPort=8080)
    objs = by_kind(inst)
    client = objs[("Service", "demo")]["spec"]
    assert client["selector"] == {"understudy.dev/gateway": "demo"}
    assert client["ports"] == [
        {"name": "http", "port": 8080, "targetPort": 8080, "protocol": "TCP"}
    ]
    pods_svc = objs[("Service", "demo-pods")]["spec"]
    assert pods_svc["clusterIP"] == "None" and pods_svc["publishNotReadyAddresses"] is True
    # Every pod of the instance, ready or not, routable or not; no gateway pod.
    assert pods_svc["selector"] == {"understudy.dev/instance": "demo"}
    pod_labels = objs[("Pod", "demo-0")]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in pods_svc["selector"].items())
    gw_labels = objs[("Deployment", "demo-gateway")]["spec"]["template"]["metadata"]["labels"]
    assert "understudy.dev/instance" not in gw_labels  # not one of the instance's pods
    assert all(gw_labels.get(k) == v for k, v in client["selector"].items())
    # The headless Service's ports are the front container's, by name: the
    # gateway finds the serving and status ports by these names.
    front = objs[("Pod", "demo-0")]["spec"]["initContainers"][2]
    named = {p["name"]: p["containerPort"] for p in front["ports"]}
    assert {p["name"]: p["targetPort"] for p in pods_svc["ports"]} == {n: n for n in named}
    assert (
        {p["name"]: p["port"] for p in pods_svc["ports"]}
        == named
        == {
            "http": 8080,
            "front-status": 8090,
        }
    )
    assert render.endpoints_service_name(inst) == "demo-pods"


def test_the_gateway_deployment() -> None:
    inst = make(gateway={"replicas": 3, "holdSeconds": 12}, drain={"gracePeriodSeconds": 40})
    dep = by_kind(inst)[("Deployment", "demo-gateway")]
    spec = dep["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert spec["selector"]["matchLabels"] == {"understudy.dev/gateway": "demo"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-gateway"
    assert pod["automountServiceAccountToken"] is True
    assert pod["terminationGracePeriodSeconds"] == 40
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["image"] == CFG.image  # the pod's front's image
    engine_pod = by_kind(inst)[("Pod", "demo-0")]
    assert c["securityContext"] == engine_pod["spec"]["initContainers"][2]["securityContext"]
    # Under the respawner, which binds both ports and keeps a spare: a
    # gateway that dies restarts in place, its connections queued meanwhile.
    keeper, args = parse(["understudy", *c["args"]])
    assert keeper["spare"] is True
    assert sorted(keeper["listen"]) == ["serving=0.0.0.0:8000", "status=0.0.0.0:8091"]
    assert args["command"] == "gateway"
    assert args["endpointslices"] == "ns/demo-pods"
    assert (args["port"], args["metrics_port"]) == (8000, 8091)
    assert (args["hold"], args["migration_limit"]) == (12, 8)
    # Terminating pods' requests move inside the front's drain (35 s), which
    # ends inside the pod's grace (40 s). A gateway replica keeps accepting
    # for 5 s after it is told to stop (kube-proxy drops it late), then
    # drains, and exits 5 s inside its grace: 40 - 5 - 5.
    assert (args["grace"], args["drain"]) == (30, 30)
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert args["pod"] is None and args["pods_file"] is None and args["api_key_file"] is None
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "gateway-status": 8091}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/live", "port": "gateway-status", "scheme": "HTTP"}
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}


def test_the_api_key_secret_is_a_mounted_file() -> None:
    inst = make(gateway={**KEYED, "resources": {"limits": {"memory": "128Mi"}}})
    pod = by_kind(inst)[("Deployment", "demo-gateway")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    _, args = parse(["understudy", *c["args"]])
    assert args["api_key_file"] == "/etc/understudy/api-keys/keys"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/understudy/api-keys", "readOnly": True}
    assert "subPath" not in mount  # a subPath never sees the Secret's rotation
    vol = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert vol["secret"]["secretName"] == "demo-keys"
    assert vol["secret"]["items"] == [{"key": "keys.txt", "path": "keys"}]
    assert c["resources"]["limits"] == {"memory": "128Mi"}


def test_the_disruption_budget_and_the_role() -> None:
    objs = by_kind(make(gateway={"replicas": 1}))
    pdb = objs[("PodDisruptionBudget", "demo-gateway")]["spec"]
    assert pdb == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"understudy.dev/gateway": "demo"}},
    }
    role = objs[("Role", "demo-gateway")]
    assert role["metadata"]["namespace"] == "ns"
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = objs[("RoleBinding", "demo-gateway")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "demo-gateway",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-gateway", "namespace": "ns"}
    ]


def test_the_spec_hash_of_the_pods_ignores_the_gateway() -> None:
    """Adding or tuning the gateway replaces no pod."""
    assert render.spec_hash(make(), CFG) == render.spec_hash(make(gateway={"replicas": 4}), CFG)


# -------------------------------------------------------------- the plan


def test_the_plan_ensures_the_gateway_objects() -> None:
    inst = make(gateway={})
    p = planner.plan(inst, Observed(), 100.0, CFG)
    kinds = [o["kind"] for o in p.ensure]
    assert kinds == [
        "ResourceClaimTemplate",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    ]
    assert not any(d.reason == "gateway section removed" for d in p.deletes)


def test_a_removed_section_deletes_the_gateway_once_it_is_seen() -> None:
    inst = make()
    p = planner.plan(inst, Observed(gateway=True), 100.0, CFG)
    gone = [
        (d.api_version, d.kind, d.name) for d in p.deletes if d.reason == "gateway section removed"
    ]
    assert gone == render.gateway_objects(inst)
    assert [o["kind"] for o in p.ensure] == ["ResourceClaimTemplate", "Service"]
    for observed in (Observed(gateway=False), Observed(gateway=None), Observed()):
        p = planner.plan(inst, observed, 100.0, CFG)
        assert not any(d.reason == "gateway section removed" for d in p.deletes)
