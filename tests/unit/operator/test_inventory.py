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


def test_unreadable_claims_make_devices_unknown_not_free() -> None:
    infos, _ = node_infos(DRIVER, ATTR, [node("a")], [slice_("sa", "a", 4)], None)
    assert infos[0].devices is None
    inv = Inventory()
    inv.reset_nodes([node("a")])
    inv.reset_slices([slice_("sa", "a", 4)])
    inv.reset_claims(None)
    assert inv.node_infos(DRIVER, ATTR)[0].devices is None
    # readable again (the informer's next list): known, with what is taken
    inv.reset_claims([claim("c1", ("a", 3))])
    (a,) = inv.node_infos(DRIVER, ATTR)
    assert a.devices == {0, 1, 2, 3} and a.allocated == {3}


# Random event sequences: the incremental digest equals one built from scratch.
# An event is (kind, key, the object to put or None to drop it, read the digest after it?).
Ev = tuple[str, str, dict[str, Any] | None, bool]
names = st.sampled_from(["n0", "n1", "n2", "n3"])
tags = st.sampled_from(["x", "y"])
reads = st.booleans()
events = st.lists(
    st.one_of(
        st.builds(lambda n, ready, r: ("node", n, node(n, ready), r), names, st.booleans(), reads),
        st.builds(lambda n, r: ("node", n, None, r), names, reads),
        st.builds(
            lambda n, count, t, r: ("slice", f"{n}-{t}", slice_(f"{n}-{t}", n, count), r),
            names,
            st.integers(0, 8),
            tags,
            reads,
        ),
        st.builds(lambda n, t, r: ("slice", f"{n}-{t}", None, r), names, tags, reads),
        st.builds(
            lambda c, n, i, r: ("claim", str(c), claim(str(c), (n, i)), r),
            st.integers(0, 5),
            names,
            st.integers(0, 8),
            reads,
        ),
        st.builds(lambda c, r: ("claim", str(c), None, r), st.integers(0, 5), reads),
    ),
    max_size=40,
)

# Per kind: how the informer hands the inventory a put and a drop.
FEEDS = {
    "node": (Inventory.put_node, Inventory.drop_node),
    "slice": (Inventory.put_slice, Inventory.drop_slice),
    "claim": (Inventory.put_claim, Inventory.drop_claim),
}


@settings(max_examples=600)
@given(events)
def test_incremental_equals_a_fresh_digest(evs: list[Ev]) -> None:
    inv = Inventory()
    inv.reset_nodes([])
    inv.reset_slices([])
    inv.reset_claims([])
    seen: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in FEEDS}
    for kind, key, obj, read in evs:
        put, drop = FEEDS[kind]
        if obj is not None:
            seen[kind][key] = obj
            put(inv, obj)
        elif key in seen[kind]:  # a watch only deletes what it has seen
            drop(inv, seen[kind].pop(key))
        if read:  # reading in between must not change what later events do
            inv.node_infos(DRIVER, ATTR)
    got = sorted(inv.node_infos(DRIVER, ATTR), key=lambda x: x.name)
    fresh, _ = node_infos(
        DRIVER, ATTR, seen["node"].values(), seen["slice"].values(), seen["claim"].values()
    )
    assert got == sorted(fresh, key=lambda x: x.name)
