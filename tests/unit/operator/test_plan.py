"""The planner over scenarios: create, bind, run, serve, node loss, fencing, scale, failover."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from understudy.operator import checks, render, resources
from understudy.operator import lifecycle as lc
from understudy.operator.api import GpuInstance, ReplicaPhase
from understudy.operator.checks import policy_for
from understudy.operator.plan import plan
from understudy.operator.scheduler import NodeInfo
from understudy.operator.view import (
    ContainerView,
    Context,
    EngineView,
    Observed,
    Plan,
    PodView,
    Pressure,
)

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


def test_failover_duration_includes_detection() -> None:
    """lastFailoverDurationSeconds runs from the old holder's release (the
    lock server's time, in the new engine's /state), not from the grant."""
    b, pod, _ = run_to_serving()
    view = EngineView(state="Active", epoch=2, released_at=9.9, granted_at=10.0, active_at=10.25)
    pod = replace(pod, routable_label="true", engines={"engine-shadow-1": view})
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    assert p.status is not None
    assert p.status["lastFailoverDurationSeconds"] == pytest.approx(0.35)


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


# ------------------------------------------------- a small world to step through


class World:
    """Pods as the API server would hold them after each plan is applied.

    Endpoints follow the routable label only when ``sync()`` is called, as
    the EndpointSlice controller does some time after a label change.
    """

    def __init__(self, b: dict[str, Any], nodes: tuple[NodeInfo, ...] = NODES) -> None:
        self.body, self.nodes = b, nodes
        self.pods: dict[str, PodView] = {}
        self.endpoints: set[str] = set()

    def step(self, now: float) -> Plan:
        obs = Observed(
            dict(self.pods),
            {"n1": True, "n2": True},
            self.nodes,
            endpoints=frozenset(self.endpoints),
        )
        p = plan(GpuInstance.from_body(self.body), obs, now, CFG)
        self.body = after(p, self.body)
        for obj in p.create_pods:
            view = pod_from(Plan(create_pods=(obj,)))
            self.pods[view.name] = view
        for d in p.deletes:
            if d.kind == "Pod" and d.name in self.pods:
                self.pods[d.name] = replace(self.pods[d.name], deleting=True)
        for lp in p.labels:
            self.pods[lp.pod] = replace(self.pods[lp.pod], routable_label=lp.value)
        if p.scale is not None:
            self.set_desired(p.scale)
        return p

    def set_desired(self, n: int) -> None:
        self.body["spec"]["replicas"] = {**self.body["spec"].get("replicas", {}), "desired": n}
        self.body["metadata"]["generation"] += 1

    def serve(self, name: str, node: str = "n1", pressure: Pressure | None = None) -> None:
        self.pods[name] = replace(
            self.pods[name],
            node=node,
            phase="Running",
            ready=True,
            front_ready=True,
            containers=ARMED,
            engines={"engine-primary": EngineView(state="Active", epoch=1)},
            pressure=pressure,
        )

    def load(self, name: str, inflight: int, held: int) -> None:
        self.pods[name] = replace(self.pods[name], pressure=Pressure(inflight, held, True))

    def sync(self) -> None:
        self.endpoints = {
            n for n, p in self.pods.items() if p.routable_label == "true" and not p.deleting
        }

    def gone(self, name: str) -> None:
        del self.pods[name]
        self.endpoints.discard(name)

    def phases(self) -> dict[int, str]:
        return {r["index"]: r["phase"] for r in self.body["status"]["replicas"]}


def serving_world(**spec: Any) -> tuple[World, float]:
    """Every replica of the spec serving and in the endpoints."""
    w = World(body(**spec))
    t = 100.0
    w.step(t)
    for name in list(w.pods):
        w.serve(name)
    for _ in range(3):
        t += 1
        w.step(t)
        w.sync()
    assert set(w.phases().values()) == {"Running"}
    return w, t


def test_spec_change_surges_then_drains_the_old_pod() -> None:
    w, t = serving_world()
    w.body["spec"]["engine"] = {"args": ["--new"]}
    w.body["metadata"]["generation"] += 1
    p = w.step(t := t + 1)
    # Surge first: the replacement is created, nothing is deleted or unrouted.
    assert [o["metadata"]["name"] for o in p.create_pods] == ["demo-1"]
    assert p.deletes == () and p.labels == ()
    assert w.phases() == {0: "Running", 1: "Scheduled"}
    p = w.step(t := t + 1)
    assert p.deletes == ()
    # Running with one engine Standby: routable, in the endpoints, but nothing
    # serves yet (the pod is not Ready): the old pod must stay.
    w.pods["demo-1"] = replace(
        w.pods["demo-1"],
        node="n2",
        phase="Running",
        containers=(ContainerView("engine-primary", ready=True),),
    )
    p = w.step(t := t + 1)
    assert [(lp.pod, lp.value) for lp in p.labels] == [("demo-1", "true")]
    w.sync()
    p = w.step(t := t + 1)
    assert w.phases() == {0: "Running", 1: "Running"} and p.labels == ()
    # Ready and in the endpoints: now the old pod is unrouted.
    w.serve("demo-1", node="n2")
    p = w.step(t := t + 1)
    assert w.phases()[0] == "Draining"
    assert [(lp.pod, lp.value) for lp in p.labels] == [("demo-0", "false")]
    assert p.deletes == () and p.requeue_after == 0.5
    assert any("replaced by a pod of the current spec" in e.message for e in p.events)
    # Still listed: no delete.
    p = w.step(t := t + 1)
    assert p.deletes == ()
    w.sync()  # the EndpointSlice controller drops it
    p = w.step(t := t + 1)
    assert p.deletes == () and w.body["status"]["replicas"][0]["unroutedSince"]
    p = w.step(t := t + 2.5)  # settled: a graceful delete
    assert [(d.name, d.grace_seconds) for d in p.deletes] == [("demo-0", 30)]
    assert w.phases()[0] == "Terminating"
    w.gone("demo-0")
    p = w.step(t := t + 1)
    assert w.phases() == {1: "Running"}
    assert w.body["status"]["currentReplicas"] == 1 == w.body["status"]["updatedReplicas"]
    assert w.endpoints == {"demo-1"}


def test_spec_change_never_leaves_the_service_without_an_endpoint() -> None:
    w, t = serving_world(replicas={"min": 2})
    w.body["spec"]["engine"] = {"args": ["--new"]}
    w.body["metadata"]["generation"] += 1
    for _ in range(40):
        w.step(t := t + 1.5)
        for name, pod in list(w.pods.items()):
            if pod.deleting:
                w.gone(name)
            elif pod.phase != "Running":
                w.serve(name, node="n2")
        w.sync()
        assert len(w.endpoints) >= 2, w.phases()  # maxUnavailable 0
    assert set(w.phases()) == {2, 3} and w.body["status"]["updatedReplicas"] == 2


def test_drain_gives_up_waiting_for_the_endpoints_after_its_timeout() -> None:
    w, t = serving_world(replicas={"min": 1, "desired": 2, "max": 2})
    w.set_desired(1)
    w.step(t := t + 1)
    assert w.phases()[1] == "Draining"
    t0 = t
    p = w.step(t := t + 10)  # never synced: still an endpoint
    assert p.deletes == ()
    p = w.step(t := t0 + 33)  # past timeoutSeconds + settleSeconds
    assert [d.name for d in p.deletes] == ["demo-1"] and w.phases()[1] == "Terminating"
    assert any(e.reason == "Expired" for e in p.events)


def test_with_a_gateway_a_drain_waits_for_no_endpoint_and_deletes_after_the_settle() -> None:
    """The headless Service lists a pod until it is gone: the gateway, not the
    endpoints, drains it (``terminating``: nothing new, its requests finish)."""
    w, t = serving_world(replicas={"min": 1, "desired": 2, "max": 2}, gateway={})
    w.endpoints = set(w.pods)  # every pod, routable or not
    w.set_desired(1)
    p = w.step(t := t + 1)
    assert w.phases()[1] == "Draining"
    assert p.deletes == ()
    p = w.step(t := t + 1)  # out at once: settling
    assert p.deletes == () and w.body["status"]["replicas"][1]["unroutedSince"]
    assert "demo-1" in w.endpoints
    p = w.step(t := t + 2.5)  # settled, still listed: a graceful delete all the same
    assert [(d.name, d.grace_seconds) for d in p.deletes] == [("demo-1", 30)]
    assert w.phases()[1] == "Terminating"


def test_scale_down_drains_the_highest_indices_first() -> None:
    w, t = serving_world(replicas={"min": 1, "desired": 3, "max": 3})
    w.set_desired(1)
    p = w.step(t := t + 1)
    assert w.phases() == {0: "Running", 1: "Draining", 2: "Draining"}
    assert sorted((lp.pod, lp.value) for lp in p.labels) == [
        ("demo-1", "false"),
        ("demo-2", "false"),
    ]
    assert w.body["status"]["currentReplicas"] == 1


def test_scale_up_through_desired_adds_the_lowest_free_indices() -> None:
    w, t = serving_world(replicas={"min": 1, "max": 4})
    w.set_desired(3)
    p = w.step(t := t + 1)
    assert sorted(o["metadata"]["name"] for o in p.create_pods) == ["demo-1", "demo-2"]
    st = w.body["status"]
    assert st["currentReplicas"] == 3 and st["selector"] == "understudy.dev/instance=demo"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"  # a scale-up never makes a serving instance un-Ready


def test_autoscaler_scales_up_under_pressure_and_back_to_min_when_idle() -> None:
    w, t = serving_world(
        replicas={"min": 1, "max": 4},
        autoscaling={"enabled": True, "targetPressure": 2, "scaleDownStabilizationSeconds": 60},
    )
    w.load("demo-0", inflight=1, held=6)  # 7 requests: ceil(7 / 2) = 4
    p = w.step(t := t + 1)
    assert p.scale == 4 and p.autoscale is not None and p.autoscale.reason == "ScaleUp"
    assert len(p.create_pods) == 3 and p.requeue_after == 5.0
    auto = w.body["status"]["autoscaler"]
    assert auto["desiredReplicas"] == 4 and auto["pressure"] == 7 and auto["reason"] == "ScaleUp"
    assert w.body["spec"]["replicas"]["desired"] == 4
    for name in list(w.pods):
        if w.pods[name].phase != "Running":
            w.serve(name, node="n2", pressure=Pressure(0, 0, True))
    w.load("demo-0", 0, 0)
    p = w.step(t := t + 10)
    assert p.scale is None and p.autoscale is not None and p.autoscale.reason == "Stabilizing"
    t_idle = t  # the first pass that saw no pressure: the window runs from here
    p = w.step(t := t_idle + 30)
    assert p.scale is None
    p = w.step(t := t_idle + 61)
    assert p.scale == 1 and p.autoscale is not None and p.autoscale.reason == "Idle"
    assert w.phases()[0] == "Running" and {w.phases()[i] for i in (1, 2, 3)} <= {
        "Draining",
        "Terminating",
    }


def test_autoscaler_off_never_writes_desired_or_reads_pressure() -> None:
    w, t = serving_world(replicas={"min": 1, "max": 4})
    w.load("demo-0", inflight=50, held=50)
    p = w.step(t := t + 1)
    assert p.scale is None and p.autoscale is None
    assert "autoscaler" not in w.body["status"]


def test_an_external_write_while_autoscaling_is_reported() -> None:
    w, t = serving_world(replicas={"min": 1, "max": 4}, autoscaling={"enabled": True})
    w.load("demo-0", 0, 0)
    w.step(t := t + 1)
    w.set_desired(3)  # an HPA, or a person
    p = w.step(t := t + 1)
    assert any(e.reason == "ScaleOverridden" and e.type == "Warning" for e in p.events)


# For a replica in each phase whose pod runs on a Ready node, outside the
# endpoints, with no drain clock: the checks that report, in order, and the
# phase they leave it in. A check that moves the replica hands it on: the
# checks after it run for the new phase.
C, RP = lc.Check, ReplicaPhase
CHECKS_RUN: dict[ReplicaPhase, tuple[list[lc.Check], ReplicaPhase]] = {
    RP.PENDING: ([], RP.PENDING),  # placement runs apart, after membership
    RP.SCHEDULED: ([C.PRESENCE, C.BIND, C.START], RP.RUNNING),
    RP.STARTING: ([C.PRESENCE, C.NODE, C.START], RP.RUNNING),
    RP.RUNNING: ([C.PRESENCE, C.NODE], RP.RUNNING),
    RP.UNKNOWN: ([C.PRESENCE, C.RECOVER], RP.RUNNING),
    RP.FAILED: ([C.RETRY_FAILED], RP.FAILED),  # 130 s in: within the 300 s back-off
    RP.DRAINING: ([C.PRESENCE, C.NODE, C.DRAIN], RP.TERMINATING),  # past its 32 s
    RP.TERMINATING: ([], RP.TERMINATING),
}


@pytest.mark.parametrize("phase", list(ReplicaPhase), ids=str)
def test_checks_run_in_order_for_the_phase_they_find(
    phase: ReplicaPhase, monkeypatch: pytest.MonkeyPatch
) -> None:
    b, pod, _ = run_to_serving()
    inst = GpuInstance.from_body(b)
    obs = Observed({pod.name: pod}, {"n1": True}, NODES, endpoints=frozenset())
    policy = policy_for(inst)
    ctx = Context(inst, obs, 130.0, CFG, policy, render.spec_hash(inst, CFG))
    assert pod.attempt is not None
    rec = lc.Replica(index=0, phase=phase, attempt=pod.attempt, since=0.0, policy=policy)
    # Watch the real checks run (quiet ones, like "pod present", record nothing).
    ran: list[lc.Check] = []

    def watched(check: lc.Check, run: Any) -> Any:
        def spy(*args: Any) -> Any:
            ran.append(check)
            return run(*args)

        return spy

    monkeypatch.setattr(checks, "CHECKS", tuple((c, watched(c, f)) for c, f in checks.CHECKS))
    monkeypatch.setattr(checks, "check_drain", watched(C.DRAIN, checks.check_drain))
    new, _ = checks.check_replica(ctx, rec, drain_clock=None)
    assert (ran, new.phase) == CHECKS_RUN[phase]


# ------------------------------------------------------- resources per role


def _with_requests(pod: PodView, active: str) -> PodView:
    """The pod's engine containers requesting what their roles of ``active`` call for."""
    inst = GpuInstance.from_body(body())
    want = {
        name: resources.role_requests(inst.spec, active=name == active)
        for name in render.engine_names(inst)
    }
    return replace(pod, requests=want, routable_label="true")


def test_a_failover_resizes_the_engines_in_place_by_role() -> None:
    b, pod, p = run_to_serving()
    assert p.resizes == ()  # the rendered roles hold: nothing to move
    inst = GpuInstance.from_body(b)
    pod = _with_requests(pod, render.PRIMARY)
    shadow = render.shadow_name(1)
    pod = replace(pod, engines={shadow: EngineView(state="Active", epoch=2)})
    p = plan(inst, Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    (r,) = p.resizes
    assert (r.pod, r.active) == (pod.name, shadow)
    assert r.requests[shadow] == resources.active_requests(inst.spec)
    assert r.requests[render.PRIMARY] == resources.standby_requests(inst.spec)
    # Once the pod requests what the roles call for, nothing more is asked.
    done = _with_requests(pod, shadow)
    b = after(p, b)
    again = plan(
        GpuInstance.from_body(b), Observed({pod.name: done}, {"n1": True}, NODES), 131.0, CFG
    )
    assert again.resizes == ()


def test_no_resize_without_an_engine_seen_active_in_this_pass() -> None:
    """A role from the last status (the engines' /state did not answer) could
    be stale: shrinking the engine that serves is worse than waiting a pass."""
    b, pod, _ = run_to_serving()
    pod = _with_requests(pod, render.shadow_name(1))  # as if the shadow were Active
    unknown = replace(pod, engines={render.PRIMARY: EngineView()})
    p = plan(
        GpuInstance.from_body(b), Observed({pod.name: unknown}, {"n1": True}, NODES), 130.0, CFG
    )
    assert p.resizes == ()
    seen = replace(pod, engines={render.PRIMARY: EngineView(state="Active", epoch=1)})
    p = plan(GpuInstance.from_body(b), Observed({pod.name: seen}, {"n1": True}, NODES), 130.0, CFG)
    assert [r.active for r in p.resizes] == [render.PRIMARY]


def test_a_pod_of_an_older_spec_is_not_resized() -> None:
    b, pod, _ = run_to_serving()
    pod = replace(_with_requests(pod, render.shadow_name(1)), spec_hash="older")
    p = plan(GpuInstance.from_body(b), Observed({pod.name: pod}, {"n1": True}, NODES), 130.0, CFG)
    assert p.resizes == ()


# ------------------------------------------------------------ unschedulable


def test_the_scheduled_condition_says_why_a_pod_is_not_bound() -> None:
    b = body()
    p1 = plan(GpuInstance.from_body(b), Observed(node_ready={"n1": True}, nodes=NODES), 100.0, CFG)
    b = after(p1, b)
    waiting = pod_from(p1)
    p2 = plan(
        GpuInstance.from_body(b), Observed({waiting.name: waiting}, {"n1": True}, NODES), 101.0, CFG
    )
    b = after(p2, b)
    scheduled = next(c for c in b["status"]["conditions"] if c["type"] == "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "WaitingForScheduler")
    why = "Unschedulable: 0/1 nodes are available: 1 Insufficient cpu."
    stuck = replace(waiting, unschedulable=why)
    p3 = plan(
        GpuInstance.from_body(b), Observed({stuck.name: stuck}, {"n1": True}, NODES), 102.0, CFG
    )
    assert p3.status is not None
    scheduled = next(c for c in p3.status["conditions"] if c["type"] == "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    assert scheduled["message"] == f"0 of 1 replica pod(s) bound to a node; replica 0: {why}"
    # The new reason is news: an Event carries the scheduler's words.
    (ev,) = [e for e in p3.events if e.reason == "Unschedulable"]
    assert ev.type == "Warning" and "1 Insufficient cpu" in ev.message
    # Said once: the same reason in the next pass is not news again.
    b = after(p3, b)
    p4 = plan(
        GpuInstance.from_body(b), Observed({stuck.name: stuck}, {"n1": True}, NODES), 103.0, CFG
    )
    assert not [e for e in p4.events if e.reason == "Unschedulable"]
