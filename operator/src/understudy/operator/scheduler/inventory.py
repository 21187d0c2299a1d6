"""The scheduler's view of the cluster: Nodes, ResourceSlices, ResourceClaims -> NodeInfo.

Two ways in, one result:

* :func:`node_infos` builds the placement candidates from three lists (what
  a list-per-pass reads);
* :class:`Inventory` keeps the same digest up to date event by event (what
  the watch-based cache in ``cache.py`` feeds), and rebuilds only the nodes an
  event touched: a changed claim re-digests the nodes of its devices, a
  changed slice its node, a changed node itself. A snapshot is a tuple
  rebuilt only when something changed, so a scheduling decision over an
  unchanged cluster costs the filters and scorers alone.

A device's index is its ``index`` attribute (or ``gpus.indexAttribute``);
the driver is assumed to be named like the DeviceClass (true of NVIDIA's
``gpu.nvidia.com`` and of our fake ``gpu.understudy.dev``).

Core module: no I/O imports (the caller does the reading).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from understudy.operator.scheduler.filters import NodeInfo, Taint

DeviceKey = tuple[str, str, str]  # (driver, pool, device): how a claim names a device


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ready: bool = False
    schedulable: bool = True
    taints: tuple[Taint, ...] = ()
    images: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    name: str
    attributes: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SliceRecord:
    key: str  # uid (or name)
    driver: str
    node: str | None
    pool: str
    devices: tuple[DeviceRecord, ...]


def _int(value: object) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name") or "")


def parse_node(obj: Mapping[str, Any]) -> NodeRecord:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    ready = False
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            ready = cond.get("status") == "True"
    taints = tuple(
        Taint(str(t.get("key", "")), str(t.get("value") or ""), str(t.get("effect", "")))
        for t in spec.get("taints") or []
    )
    images = frozenset(n for img in status.get("images") or [] for n in img.get("names") or [])
    return NodeRecord(
        name=str(meta.get("name", "")),
        labels=dict(meta.get("labels") or {}),
        ready=ready,
        schedulable=not spec.get("unschedulable", False),
        taints=taints,
        images=images,
    )


def parse_slice(obj: Mapping[str, Any]) -> SliceRecord:
    spec = obj.get("spec") or {}
    devices = tuple(
        DeviceRecord(str(d.get("name", "")), dict(d.get("attributes") or {}))
        for d in spec.get("devices") or []
    )
    return SliceRecord(
        key=_key(obj),
        driver=str(spec.get("driver", "")),
        node=spec.get("nodeName") or None,
        pool=str((spec.get("pool") or {}).get("name", "")),
        devices=devices,
    )


def parse_claim(obj: Mapping[str, Any]) -> frozenset[DeviceKey]:
    """The devices a claim holds (its allocation results)."""
    results = ((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}
    return frozenset(
        (str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", "")))
        for r in results.get("results") or []
    )


def device_index(driver: str, attribute: str, dev: DeviceRecord) -> int | None:
    """The device's index under ``attribute`` (``<domain>/<name>``)."""
    domain, name = attribute.split("/", 1)
    raw = dev.attributes.get(name) if domain == driver else None
    raw = raw or dev.attributes.get(attribute)
    return _int((raw or {}).get("int")) if isinstance(raw, Mapping) else None


ViewKey = tuple[str, str]  # (driver, index attribute)


@dataclass(slots=True)
class _View:
    infos: dict[str, NodeInfo] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    snapshot: tuple[NodeInfo, ...] | None = None


class Inventory:
    """Nodes, slices and claims, digested into NodeInfos per (driver, index attribute).

    ``slices_known`` / ``claims_known`` False (the operator may not read them)
    make every node's devices unknown (None), and placement then leaves the
    choice to kube-scheduler and DRA, as with a failed list. Unreadable claims
    count too: read as "nothing allocated", they would offer taken devices.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self.slices: dict[str, SliceRecord] = {}
        self.claims: dict[str, frozenset[DeviceKey]] = {}
        self.slices_known = True
        self.claims_known = True
        self._slices_by_node: dict[str, set[str]] = {}
        self._device_node: dict[DeviceKey, str] = {}
        # Slices naming a device on a node (a pool may list one twice while a
        # driver republishes): the mapping goes only with the last of them.
        self._device_refs: Counter[tuple[DeviceKey, str]] = Counter()
        self._allocated: Counter[DeviceKey] = Counter()
        self._views: dict[ViewKey, _View] = {}
        self._ready: dict[str, bool] | None = None
        self.version = 0

    # ----------------------------------------------------------- changes

    def _touch(self, nodes: Iterable[str | None]) -> None:
        names = {n for n in nodes if n}
        self.version += 1
        for view in self._views.values():
            view.dirty |= names
            view.snapshot = None

    def _touch_all(self) -> None:
        self._touch(set(self.nodes) | {n for v in self._views.values() for n in v.infos})
        self._ready = None

    def reset_nodes(self, items: Iterable[Mapping[str, Any]]) -> None:
        self.nodes = {r.name: r for r in map(parse_node, items)}
        self._touch_all()

    def put_node(self, obj: Mapping[str, Any]) -> None:
        rec = parse_node(obj)
        if self.nodes.get(rec.name) != rec:
            self.nodes[rec.name] = rec
            self._ready = None
            self._touch([rec.name])

    def drop_node(self, obj: Mapping[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name", ""))
        if self.nodes.pop(name, None) is not None:
            self._ready = None
            self._touch([name])

    def _unlink_slice(self, key: str) -> str | None:
        old = self.slices.pop(key, None)
        if old is None:
            return None
        if old.node is not None:
            self._slices_by_node.get(old.node, set()).discard(key)
            for dev in old.devices:
                dk = (old.driver, old.pool, dev.name)
                self._device_refs[(dk, old.node)] -= 1
                if self._device_refs[(dk, old.node)] <= 0:
                    del self._device_refs[(dk, old.node)]
                    if self._device_node.get(dk) == old.node:
                        del self._device_node[dk]
        return old.node

    def _link_slice(self, rec: SliceRecord) -> None:
        self.slices[rec.key] = rec
        if rec.node is not None:
            self._slices_by_node.setdefault(rec.node, set()).add(rec.key)
            for dev in rec.devices:
                dk = (rec.driver, rec.pool, dev.name)
                self._device_node[dk] = rec.node
                self._device_refs[(dk, rec.node)] += 1

    def reset_slices(self, items: Iterable[Mapping[str, Any]] | None) -> None:
        self.slices, self._slices_by_node, self._device_node = {}, {}, {}
        self._device_refs = Counter()
        self.slices_known = items is not None
        for n, obj in enumerate(items or ()):
            rec = parse_slice(obj)
            self._link_slice(rec if rec.key else replace(rec, key=f"#{n}"))
        self._touch_all()

    def put_slice(self, obj: Mapping[str, Any]) -> None:
        rec = parse_slice(obj)
        if self.slices.get(rec.key) == rec:
            return
        old_node = self._unlink_slice(rec.key)
        self._link_slice(rec)
        self._touch([old_node, rec.node])

    def drop_slice(self, obj: Mapping[str, Any]) -> None:
        self._touch([self._unlink_slice(_key(obj))])

    def reset_claims(self, items: Iterable[Mapping[str, Any]] | None) -> None:
        self.claims = {}
        self._allocated = Counter()
        self.claims_known = items is not None
        for n, obj in enumerate(items or ()):
            self._set_claim(_key(obj) or f"#{n}", parse_claim(obj))
        self._touch_all()

    def _set_claim(self, key: str, devices: frozenset[DeviceKey]) -> frozenset[DeviceKey]:
        old = self.claims.pop(key, frozenset())
        self._allocated.subtract(old)
        if devices:
            self.claims[key] = devices
            self._allocated.update(devices)
        return old ^ devices

    def put_claim(self, obj: Mapping[str, Any]) -> None:
        changed = self._set_claim(_key(obj), parse_claim(obj))
        if changed:
            self._touch(self._device_node.get(dk) for dk in changed)

    def drop_claim(self, obj: Mapping[str, Any]) -> None:
        changed = self._set_claim(_key(obj), frozenset())
        if changed:
            self._touch(self._device_node.get(dk) for dk in changed)

    # ------------------------------------------------------------ views

    def _info(self, rec: NodeRecord, driver: str, attribute: str) -> NodeInfo:
        devices: frozenset[int] | None = None
        allocated: set[int] = set()
        if self.slices_known and self.claims_known:
            found: set[int] = set()
            for key in self._slices_by_node.get(rec.name, ()):
                sl = self.slices[key]
                if sl.driver != driver:
                    continue
                for dev in sl.devices:
                    index = device_index(driver, attribute, dev)
                    if index is None:
                        continue
                    found.add(index)
                    if self._allocated[(sl.driver, sl.pool, dev.name)] > 0:
                        allocated.add(index)
            devices = frozenset(found)
        return NodeInfo(
            name=rec.name,
            labels=rec.labels,
            ready=rec.ready,
            schedulable=rec.schedulable,
            taints=rec.taints,
            images=rec.images,
            devices=devices,
            allocated=frozenset(allocated),
        )

    def node_infos(self, driver: str, attribute: str) -> tuple[NodeInfo, ...]:
        """Placement candidates for devices of ``driver`` indexed by ``attribute``."""
        key = (driver, attribute)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = _View(dirty=set(self.nodes))
        if view.snapshot is not None:
            return view.snapshot
        for name in view.dirty:
            rec = self.nodes.get(name)
            if rec is None:
                view.infos.pop(name, None)
            else:
                view.infos[name] = self._info(rec, driver, attribute)
        view.dirty = set()
        # In the nodes' own order (as the API listed and watched them), not the
        # order a set of dirty names happened to iterate in: a decision between
        # equal nodes must not change from one process to the next.
        view.snapshot = tuple(view.infos[n] for n in self.nodes if n in view.infos)
        return view.snapshot

    def node_ready(self) -> dict[str, bool]:
        if self._ready is None:
            self._ready = {name: rec.ready for name, rec in self.nodes.items()}
        return self._ready


def node_infos(
    driver: str,
    attribute: str,
    nodes: Iterable[Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]] | None,
    claims: Iterable[Mapping[str, Any]] | None,
) -> tuple[tuple[NodeInfo, ...], dict[str, bool]]:
    """Placement candidates and node readiness from three lists."""
    inv = Inventory()
    inv.reset_nodes(nodes)
    inv.reset_slices(slices)
    inv.reset_claims(claims)
    return inv.node_infos(driver, attribute), dict(inv.node_ready())
