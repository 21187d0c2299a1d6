"""The planner over scenarios: create, bind, run, serve, node loss, fencing, scale, failover."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from understudy.operator import render
from understudy.operator.api import GpuInstance
from understudy.operator.plan import ContainerView, EngineView, Observed, Plan, PodView, plan
from understudy.operator.scheduler import NodeInfo

CFG = render.RenderConfig()


def body(status: dict[str, Any] | None = None, generation: int = 1, **spec: Any) -> dict[str, Any]:
    b: dict[str, Any] = {
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "GpuInstance",
        "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": generation},
        "spec": {"model": {"source": "builtin:x"}, "gms": {"backend": "host"}, **spec},
    }
    if status is not None:
        b["status"] = status
    return b


def after(p: Plan, prev: dict[str, Any]) -> dict[str, Any]:
    return {**prev, "status": p.status if p.status is not None else prev.get("status")}


def pod_from(p: Plan, **kw: Any) -> PodView:
    (obj,) = p.create_pods
    ann = obj["metadata"]["annotations"]
    base = PodView(
        name=obj["metadata"]["name"],
        index=int(obj["metadata"]["labels"][render.LABEL_REPLICA]),
        attempt=int(ann[render.ANNOTATION_ATTEMPT]),
        spec_hash=ann[render.ANNOTATION_SPEC_HASH],
        routable_label="false",
    )
    return replace(base, **kw)


ARMED = (ContainerView("engine-primary", ready=True), ContainerView("engine-shadow-1", ready=True))
NODES = (NodeInfo("n1", devices=frozenset({0, 1})), NodeInfo("n2", devices=frozenset({0, 1})))


def run_to_serving() -> tuple[dict[str, Any], PodView, Plan]:
    b = body()
    p1 = plan(GpuInstance.from_body(b), Observed(node_ready={"n1": True}, nodes=NODES), 100.0, CFG)
    assert len(p1.create_pods) == 1
    b = after(p1, b)
    pod = pod_from(
        p1,
        node="n1",
        phase="Running",
        front_ready=True,
        containers=ARMED,
        engines={"engine-primary": EngineView(state="Active", epoch=1)},
    )
    p2 = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 110.0, CFG)
    return after(p2, b), pod, p2


def cond(status: dict[str, Any], t: str) -> str:
    return next(c["status"] for c in status["conditions"] if c["type"] == t)


def test_create_places_one_pod_per_replica_with_attempt_one() -> None:
    b = body(replicas={"min": 2})
    p = plan(GpuInstance.from_body(b), Observed(node_ready={}, nodes=NODES), 100.0, CFG)
    names = sorted(o["metadata"]["name"] for o in p.create_pods)
    assert names == ["demo-0", "demo-1"]
    nodes = {
        o["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ][0]["matchFields"][0]["values"][0]
        for o in p.create_pods
    }
    assert nodes == {"n1", "n2"}  # spread
    assert {o["kind"] for o in p.ensure} == {"ResourceClaimTemplate", "Service"}
    assert p.status is not None and p.status["attempt"] == 2
    assert cond(p.status, "Ready") == "False"
    assert any(e.reason == "Placed" for e in p.events)


def test_serving_pod_becomes_routable_and_ready() -> None:
    b, _, p2 = run_to_serving()
    assert p2.labels[0].value == "true"
    st = b["status"]
    assert st["phase"] == "Running" and st["active"] == "1/1"
    assert cond(st, "Ready") == cond(st, "Scheduled") == cond(st, "StandbyReady") == "True"
    assert cond(st, "Degraded") == "False"
    assert st["replicas"][0]["activeEngine"] == "engine-primary" and st["replicas"][0]["epoch"] == 1


def test_steady_state_is_idempotent() -> None:
    b, pod, _ = run_to_serving()
    pod = replace(pod, routable_label="true")
    again = plan(
        GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 120.0, CFG
    )
    assert (again.create_pods, again.deletes, again.labels, again.status) == ((), (), (), None)
    assert again.events == ()


def test_failover_is_counted_once() -> None:
    b, pod, _ = run_to_serving()
    pod = replace(
        pod,
        routable_label="true",
        engines={
            "engine-shadow-1": EngineView(state="Active", epoch=2, granted_at=10.0, active_at=10.25)
        },
    )
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    assert p.status is not None and p.status["failovers"] == 1
    assert p.status["lastFailoverDurationSeconds"] == 0.25
    assert any(e.reason == "Failover" for e in p.events)
    b = after(p, b)
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 140.0, CFG)
    assert p.status is None


def test_unreachable_engines_are_unknown_not_a_failover() -> None:
    b, pod, _ = run_to_serving()
    pod = replace(pod, routable_label="true", engines={"engine-primary": EngineView()})
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    assert p.status is None  # keeps the last known active engine and epoch


def test_one_container_restarting_keeps_the_pod_routable() -> None:
    """The lock server sidecar restarting (not ready) while an engine is ready:
    still routable — a single container's restart never unroutes the pod."""
    b, pod, _ = run_to_serving()
    assert any(c.ready for c in pod.containers if c.name.startswith("engine-"))
    pod = replace(pod, routable_label="true", front_ready=False)
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    assert p.labels == ()


def test_nothing_serving_and_no_ready_engine_drops_routable() -> None:
    b, pod, _ = run_to_serving()
    pod = replace(
        pod,
        routable_label="true",
        front_ready=False,
        containers=tuple(
            replace(c, ready=False) if c.name.startswith("engine-") else c for c in pod.containers
        ),
    )
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    assert [(lp.pod, lp.value) for lp in p.labels] == [("demo-0", "false")]
    assert p.status is not None and cond(p.status, "Ready") == "False"


def test_lost_node_goes_unknown_then_replaced_with_a_new_attempt() -> None:
    b, pod, _ = run_to_serving()
    pod = replace(pod, routable_label="true")
    lost = Observed({pod.name: pod}, {"n1": False}, (replace(NODES[0], ready=False), NODES[1]))
    p = plan(GpuInstance.from_body(b), lost, 130.0, CFG)
    assert p.status is not None and p.status["replicas"][0]["phase"] == "Unknown"
    assert cond(p.status, "Degraded") == "True"
    b = after(p, b)
    # Within the budget: still Unknown, nothing deleted.
    p = plan(GpuInstance.from_body(b), lost, 150.0, CFG)
    assert p.deletes == ()
    b = after(p, b)
    # Past it: back to Pending, the old pod force-deleted (fencing) before a new attempt.
    p = plan(GpuInstance.from_body(b), lost, 200.0, CFG)
    assert p.status is not None and p.status["replicas"][0]["phase"] == "Pending"
    assert [(d.name, d.grace_seconds) for d in p.deletes] == [("demo-0", 0)]
    assert p.create_pods == ()
    b = after(p, b)
    p = plan(GpuInstance.from_body(b), Observed({}, {"n1": False}, lost.nodes), 201.0, CFG)
    (new,) = p.create_pods
    assert new["metadata"]["annotations"][render.ANNOTATION_ATTEMPT] == "2"
    assert "n2" in str(new["spec"]["affinity"])


def test_reports_from_a_stale_pod_are_ignored() -> None:
    b, pod, _ = run_to_serving()
    st = b["status"]
    st["replicas"][0].update(phase="Scheduled", attempt=5)
    # The pod claims attempt 1 and is bound; the record waits for attempt 5.
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    assert p.status is not None and p.status["replicas"][0]["phase"] == "Pending"
    assert [d.name for d in p.deletes] == ["demo-0"]  # the stale pod is fenced off


def test_scale_down_terminates_the_highest_replica() -> None:
    b = body(replicas={"min": 2})
    p = plan(GpuInstance.from_body(b), Observed(node_ready={}, nodes=NODES), 100.0, CFG)
    b = after(p, b)
    b["spec"]["replicas"] = {"min": 1}
    pods = {o["metadata"]["name"]: pod_from(Plan(create_pods=(o,))) for o in p.create_pods}
    p = plan(GpuInstance.from_body(b), Observed(pods, {}, NODES), 110.0, CFG)
    assert [d.name for d in p.deletes] == ["demo-1"]
    b = after(p, b)
    p = plan(GpuInstance.from_body(b), Observed({"demo-0": pods["demo-0"]}, {}, NODES), 120.0, CFG)
    assert p.status is not None and [r["index"] for r in p.status["replicas"]] == [0]


def test_spec_change_replaces_a_running_pod() -> None:
    b, pod, _ = run_to_serving()
    pod = replace(pod, routable_label="true")
    b["spec"]["engine"] = {"args": ["--new"]}
    b["metadata"]["generation"] = 2
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    assert [d.reason for d in p.deletes] == ["replica 0: spec changed"]


def test_no_feasible_node_is_reported() -> None:
    b = body(placement={"targetNode": "nowhere"})
    p = plan(GpuInstance.from_body(b), Observed(node_ready={}, nodes=NODES), 100.0, CFG)
    assert p.create_pods == ()
    assert p.status is not None and "no feasible node" in p.status["history"][0]["message"]


def test_a_pod_newer_than_the_status_is_never_fenced_off() -> None:
    """A pass planning from a status older than its own last write keeps the pod."""
    b = body()
    p1 = plan(GpuInstance.from_body(b), Observed(node_ready={}, nodes=NODES), 100.0, CFG)
    pod = pod_from(p1)  # attempt 1, while b still has no status (attempt 0)
    p2 = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {}, NODES), 100.5, CFG)
    assert p2.deletes == () and p2.create_pods == ()
