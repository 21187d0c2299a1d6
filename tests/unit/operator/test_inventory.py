"""The scheduler's inventory: parsing, and the incremental digest equal to a fresh one."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.operator.scheduler.inventory import Inventory, node_infos, parse_node

DRIVER, ATTR = "gpu.understudy.dev", "gpu.understudy.dev/index"


def node(name: str, ready: bool = True, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"u-{name}", "labels": {"n": name}},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def slice_(name: str, node_name: str, n: int, driver: str = DRIVER) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"s-{name}"},
        "spec": {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": node_name},
            "devices": [
                {"name": f"gpu-{i}", "attributes": {"index": {"int": i}}} for i in range(n)
            ],
        },
    }


def claim(name: str, *devices: tuple[str, int]) -> dict[str, Any]:
    results = [{"driver": DRIVER, "pool": p, "device": f"gpu-{i}"} for p, i in devices]
    return {
        "metadata": {"name": name, "uid": f"c-{name}"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def test_parse_node_reads_taints_and_images() -> None:
    raw = node("n1", unschedulable=True, taints=[{"key": "k", "effect": "NoSchedule"}])
    raw["status"]["images"] = [{"names": ["a:1", "a@sha256:x"]}, {"names": ["b:2"]}]
    rec = parse_node(raw)
    assert rec.ready and not rec.schedulable and rec.taints[0].key == "k"
    assert rec.images == {"a:1", "a@sha256:x", "b:2"}


def test_incremental_updates_touch_the_right_nodes() -> None:
    inv = Inventory()
    inv.reset_nodes([node("a"), node("b")])
    inv.reset_slices([slice_("sa", "a", 4), slice_("sb", "b", 2)])
    inv.reset_claims([])
    first = {n.name: n for n in inv.node_infos(DRIVER, ATTR)}
    assert first["a"].free == 4 and first["b"].free == 2
    same = inv.node_infos(DRIVER, ATTR)
    assert same is inv.node_infos(DRIVER, ATTR)  # unchanged: the cached snapshot
    inv.put_claim(claim("c1", ("a", 0), ("a", 1)))
    second = {n.name: n for n in inv.node_infos(DRIVER, ATTR)}
    assert second["a"].allocated == {0, 1} and second["b"] is first["b"]
    inv.drop_claim(claim("c1"))
    inv.put_node(node("b", ready=False))
    third = {n.name: n for n in inv.node_infos(DRIVER, ATTR)}
    assert third["a"].allocated == frozenset() and not third["b"].ready
    assert inv.node_ready() == {"a": True, "b": False}


def test_unreadable_slices_make_devices_unknown() -> None:
    infos, ready = node_infos(DRIVER, ATTR, [node("a")], None, None)
    assert infos[0].devices is None and ready == {"a": True}


# Random event sequences: the incremental digest equals one built from scratch.
names = st.sampled_from(["n0", "n1", "n2", "n3"])
events = st.lists(
    st.one_of(
        st.tuples(st.just("node"), names, st.booleans()),
        st.tuples(st.just("drop-node"), names, st.booleans()),
        st.tuples(st.just("slice"), names, st.integers(0, 8), st.sampled_from(["x", "y"])),
        st.tuples(st.just("drop-slice"), names, st.sampled_from(["x", "y"])),
        st.tuples(st.just("claim"), st.integers(0, 5), names, st.integers(0, 8)),
        st.tuples(st.just("drop-claim"), st.integers(0, 5)),
    ),
    max_size=40,
)


@settings(max_examples=600)
@given(events)
def test_incremental_equals_a_fresh_digest(evs: list[tuple[Any, ...]]) -> None:  # noqa: C901
    inv = Inventory()
    inv.reset_nodes([])
    inv.reset_slices([])
    inv.reset_claims([])
    nodes: dict[str, dict[str, Any]] = {}
    slices: dict[str, dict[str, Any]] = {}
    claims: dict[str, dict[str, Any]] = {}
    for ev in evs:
        match ev:
            case ("node", n, ready):
                nodes[n] = node(n, ready)
                inv.put_node(nodes[n])
            case ("drop-node", n, _):
                if n in nodes:
                    inv.drop_node(nodes.pop(n))
            case ("slice", n, count, tag):
                key = f"{n}-{tag}"
                slices[key] = slice_(key, n, count)
                inv.put_slice(slices[key])
            case ("drop-slice", n, tag):
                key = f"{n}-{tag}"
                if key in slices:
                    inv.drop_slice(slices.pop(key))
            case ("claim", c, n, i):
                claims[str(c)] = claim(str(c), (f"{n}", i))
                inv.put_claim(claims[str(c)])
            case ("drop-claim", c):
                if str(c) in claims:
                    inv.drop_claim(claims.pop(str(c)))
        if len(evs) % 3 == 0:  # sometimes read in between
            inv.node_infos(DRIVER, ATTR)
    got = sorted(inv.node_infos(DRIVER, ATTR), key=lambda x: x.name)
    fresh, _ = node_infos(DRIVER, ATTR, nodes.values(), slices.values(), claims.values())
    assert got == sorted(fresh, key=lambda x: x.name)
