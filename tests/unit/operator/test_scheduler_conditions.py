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
