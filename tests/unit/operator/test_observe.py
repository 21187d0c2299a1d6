"""Parsing of observed API objects (pure parts of observe.py)."""

from __future__ import annotations

from understudy.operator.api import GpuInstance
from understudy.operator.observe import engine_view, node_infos, pod_view

INST = GpuInstance.from_body(
    {"metadata": {"name": "d", "uid": "u"}, "spec": {"model": {"source": "x"}}}
)


def test_pod_view() -> None:
    pod = {
        "metadata": {
            "name": "d-0",
            "labels": {"understudy.dev/replica": "0", "understudy.dev/routable": "true"},
            "annotations": {"understudy.dev/attempt": "3", "understudy.dev/spec-hash": "h"},
        },
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Running",
            "initContainerStatuses": [
                {"name": "lockserver", "ready": True},
                {"name": "front", "ready": True},
                {"name": "gms", "ready": True},
            ],
            "containerStatuses": [
                {"name": "engine-primary", "ready": True, "started": True, "restartCount": 2},
                {
                    "name": "engine-shadow-1",
                    "ready": False,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                },
            ],
        },
    }
    v = pod_view(pod)
    assert (v.index, v.attempt, v.spec_hash, v.node, v.phase) == (0, 3, "h", "n1", "Running")
    assert v.front_ready and v.routable_label == "true" and not v.deleting
    assert v.containers[1].waiting_reason == "CrashLoopBackOff"


def test_unschedulable_pod() -> None:
    pod = {
        "metadata": {"name": "d-0", "deletionTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "no gpu",
                }
            ]
        },
    }
    v = pod_view(pod)
    assert v.unschedulable == "Unschedulable: no gpu" and v.deleting and v.attempt is None


def test_engine_view_tolerates_unknown() -> None:
    assert engine_view(None).state is None
    v = engine_view(
        {
            "role": "shadow",
            "state": "Active",
            "epoch": 4,
            "granted_at": 1.5,
            "active_at": "1970-01-01T00:00:02Z",
        }
    )
    assert (v.state, v.epoch, v.granted_at, v.active_at) == ("Active", 4, 1.5, 2.0)
    assert engine_view({"epoch": True}).epoch is None


def test_node_infos_from_slices_and_claims() -> None:
    nodes = [
        {
            "metadata": {"name": "n1", "labels": {"a": "b"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        },
        {"metadata": {"name": "n2"}, "spec": {"unschedulable": True}, "status": {}},
    ]
    slices = [
        {
            "spec": {
                "driver": "gpu.understudy.dev",
                "nodeName": "n1",
                "pool": {"name": "n1"},
                "devices": [
                    {"name": f"gpu-{i}", "attributes": {"index": {"int": i}}} for i in range(4)
                ],
            }
        },
        {
            "spec": {
                "driver": "other",
                "nodeName": "n1",
                "devices": [{"name": "x", "attributes": {"index": {"int": 9}}}],
            }
        },
    ]
    claims = [
        {
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"driver": "gpu.understudy.dev", "pool": "n1", "device": "gpu-2"},
                        ]
                    }
                }
            }
        },
    ]
    infos, ready = node_infos(INST, nodes, slices, claims)
    n1, n2 = infos
    assert ready == {"n1": True, "n2": False}
    assert n1.devices == frozenset({0, 1, 2, 3}) and n1.allocated == frozenset({2}) and n1.free == 3
    assert n2.devices == frozenset() and not n2.schedulable
    infos, _ = node_infos(INST, nodes, None, None)
    assert infos[0].devices is None  # unknown: kube-scheduler and DRA decide


def test_pressure_view_accepts_the_fronts_json_only() -> None:
    from understudy.operator.observe import pressure_view

    p = pressure_view({"inflight": 3, "held": 2, "active": True})
    assert p is not None and (p.inflight, p.held, p.active, p.total) == (3, 2, True, 5)
    assert pressure_view(None) is None
    assert pressure_view({"inflight": -1, "held": 0}) is None
    assert pressure_view({"inflight": True, "held": 0}) is None
    assert pressure_view({"inflight": "3", "held": 0}) is None


def test_endpoint_pods_lists_every_pod_target() -> None:
    from understudy.operator.observe import endpoint_pods

    slices = [
        {
            "endpoints": [
                {"targetRef": {"kind": "Pod", "name": "d-0"}, "conditions": {"ready": True}},
                {"targetRef": {"kind": "Pod", "name": "d-1"}, "conditions": {"ready": False}},
                {"addresses": ["10.0.0.9"]},
            ]
        },
        {"endpoints": None},
    ]
    assert endpoint_pods(slices) == {"d-0", "d-1"}
