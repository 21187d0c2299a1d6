"""Placement filters/scorers and set_condition semantics."""

from __future__ import annotations

from understudy.operator.api import ConditionStatus, PlacementStrategy
from understudy.operator.conditions import set_condition
from understudy.operator.scheduler import NodeInfo, Request, filter_nodes, select

N = [
    NodeInfo("a", devices=frozenset({0, 1, 2, 3}), allocated=frozenset({0, 1})),
    NodeInfo("b", devices=frozenset({0, 1, 2, 3})),
    NodeInfo("c", devices=frozenset({0, 1}), ready=False),
    NodeInfo("d", labels={"zone": "x"}, devices=frozenset({0})),
]


def test_filters_explain_rejections() -> None:
    kept, rejected = filter_nodes(Request(count=2), N)
    assert [n.name for n in kept] == ["a", "b"]
    assert rejected == {"c": "node not Ready", "d": "1 free device(s), 2 needed"}
    kept, rejected = filter_nodes(Request(count=1, node_selector={"zone": "x"}), N)
    assert [n.name for n in kept] == ["d"]
    kept, _ = filter_nodes(Request(count=2, indices=(0, 1)), N)
    assert [n.name for n in kept] == ["b"]


def test_binpack_and_spread_choose_opposite_nodes() -> None:
    assert select(Request(count=1, strategy=PlacementStrategy.BINPACK), N).node == "d"
    assert select(Request(count=1, strategy=PlacementStrategy.SPREAD), N).node == "b"
    assert select(Request(count=1, target_node="a"), N).node == "a"
    assert not select(Request(count=8), N).feasible
    assert select(Request(count=1), []).node is None  # kube-scheduler decides


def test_spread_avoids_nodes_holding_replicas() -> None:
    nodes = [NodeInfo("a", ours=1), NodeInfo("b")]
    assert select(Request(count=1), nodes).node == "b"


def test_set_condition_semantics() -> None:
    conds, changed = set_condition([], "Ready", ConditionStatus.FALSE, "Nope", "m", 1, 100.0)
    assert changed and conds[0].last_transition_time == "1970-01-01T00:01:40Z"
    same, changed = set_condition(conds, "Ready", ConditionStatus.FALSE, "Nope", "m", 1, 200.0)
    assert not changed and same == conds
    msg, changed = set_condition(conds, "Ready", ConditionStatus.FALSE, "Other", "m2", 2, 200.0)
    assert changed and msg[0].last_transition_time == conds[0].last_transition_time
    assert msg[0].observed_generation == 2
    flip, changed = set_condition(msg, "Ready", ConditionStatus.TRUE, "Yes", "", 2, 300.0)
    assert changed and flip[0].last_transition_time == "1970-01-01T00:05:00Z"
    two, _ = set_condition(flip, "Degraded", ConditionStatus.FALSE, "AsExpected", "", 2, 300.0)
    assert [c.type for c in two] == ["Ready", "Degraded"]


def test_untolerated_taints_reject_a_node() -> None:
    from understudy.operator.scheduler import Taint, Toleration

    gpu = Taint("nvidia.com/gpu", "", "NoSchedule")
    nodes = [
        NodeInfo("t", taints=(gpu,)),
        NodeInfo("p", taints=(Taint("x", "", "PreferNoSchedule"),)),
    ]
    kept, rejected = filter_nodes(Request(count=1), nodes)
    assert [n.name for n in kept] == ["p"]
    assert rejected == {"t": "untolerated taint nvidia.com/gpu=:NoSchedule"}
    for tol in (
        Toleration("nvidia.com/gpu", "Exists"),
        Toleration("nvidia.com/gpu", "Equal", "", "NoSchedule"),
        Toleration(None, "Exists"),
    ):
        kept, _ = filter_nodes(Request(count=1, tolerations=(tol,)), nodes)
        assert [n.name for n in kept] == ["t", "p"], tol
    wrong = Toleration("nvidia.com/gpu", "Equal", "", "NoExecute")
    kept, _ = filter_nodes(Request(count=1, tolerations=(wrong,)), nodes)
    assert [n.name for n in kept] == ["p"]


def test_locality_prefers_the_node_holding_the_image_or_the_labels() -> None:
    devices = frozenset({0, 1, 2, 3})
    cold = NodeInfo("a-cold", devices=devices)
    warm = NodeInfo("b-warm", devices=devices, images=frozenset({"localhost/understudy:dev"}))
    req = Request(count=1, image="localhost/understudy:dev")
    assert select(req, [cold, warm]).node == "b-warm"
    # docker.io spellings match the short name a node lists.
    hub = NodeInfo("c-hub", devices=devices, images=frozenset({"vllm/vllm-openai:v1"}))
    assert (
        select(Request(count=1, image="docker.io/vllm/vllm-openai:v1"), [cold, hub]).node == "c-hub"
    )
    labelled = NodeInfo("d-model", labels={"models/llama": "cached"}, devices=devices)
    req = Request(count=1, preferred_labels={"models/llama": "cached"})
    assert select(req, [cold, labelled]).node == "d-model"
    # Locality never beats spread's one-replica-per-node.
    mine = NodeInfo("e-mine", devices=devices, images=warm.images, ours=1)
    assert select(Request(count=1, image="localhost/understudy:dev"), [cold, mine]).node == "a-cold"


def test_binpack_and_spread_disagree_on_a_fleet() -> None:
    eight = frozenset(range(8))
    fleet = [NodeInfo(f"n{i:03}", devices=eight) for i in range(100)]
    fleet[42] = NodeInfo("n042", devices=eight, allocated=frozenset({0, 1, 2, 3}))
    assert select(Request(count=2, strategy=PlacementStrategy.BINPACK), fleet).node == "n042"
    assert select(Request(count=2, strategy=PlacementStrategy.SPREAD), fleet).node == "n000"


def test_selects_fast_scorer_equals_the_reference_scorer() -> None:
    from understudy.operator.scheduler.scorers import _fast_scorer, scorer

    nodes = [
        NodeInfo(
            f"n{i}", devices=frozenset(range(8)), allocated=frozenset(range(i % 8)), ours=i % 2
        )
        for i in range(16)
    ]
    for strategy in PlacementStrategy:
        req = Request(count=1, strategy=strategy, image="img", preferred_labels={"a": "b"})
        assert [_fast_scorer(req)(n) for n in nodes] == [scorer(req)(n) for n in nodes]
