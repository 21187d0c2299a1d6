"""Placement filters: a chain that rejects nodes one reason at a time, pure.

Each filter looks at one candidate node and returns None (keep) or the reason
it is rejected. The chain runs in order and records the first rejection of
every node, so "no feasible node" comes with a message that says why.

Placement only narrows where kube-scheduler may bind the pod (node affinity);
DRA still allocates the actual devices, so device counts here are a forecast
from ResourceSlices and allocated ResourceClaims, not a reservation.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from understudy.operator.api import PlacementStrategy


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str | None = None  # None with Exists: tolerates every taint
    operator: str = "Equal"  # Equal | Exists
    value: str | None = None
    effect: str | None = None  # None: every effect

    def tolerates(self, taint: Taint) -> bool:
        """core/v1 semantics (``Toleration.ToleratesTaint``)."""
        if self.effect is not None and self.effect != taint.effect:
            return False
        if self.key is not None and self.key != taint.key:
            return False
        if self.operator == "Exists":
            return True
        return (self.value or "") == taint.value


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ready: bool = True
    schedulable: bool = True
    taints: tuple[Taint, ...] = ()
    images: frozenset[str] = frozenset()  # image names the node holds (status.images)
    # Device indices of the requested class on this node (ResourceSlices) and
    # those allocated to any claim. None: unknown (no ResourceSlice access).
    devices: frozenset[int] | None = None
    allocated: frozenset[int] = frozenset()
    reserved: int = 0  # devices promised to placements made in this cycle
    ours: int = 0  # replicas of this instance already on the node

    @property
    def free(self) -> int | None:
        if self.devices is None:
            return None
        return len(self.devices - self.allocated) - self.reserved


@dataclass(frozen=True, slots=True)
class Request:
    count: int
    strategy: PlacementStrategy = PlacementStrategy.SPREAD
    indices: tuple[int, ...] | None = None
    target_node: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    exclusive: bool = True
    tolerations: tuple[Toleration, ...] = ()
    # Locality (scorers.locality_score): the engine image, and node labels preferred.
    image: str | None = None
    preferred_labels: Mapping[str, str] = field(default_factory=dict)


Filter = Callable[[Request, NodeInfo], str | None]


def target_node_filter(req: Request, node: NodeInfo) -> str | None:
    if req.target_node is not None and node.name != req.target_node:
        return f"not the target node {req.target_node}"
    return None


def node_selector_filter(req: Request, node: NodeInfo) -> str | None:
    for key, value in req.node_selector.items():
        if node.labels.get(key) != value:
            return f"label {key}={value} missing"
    return None


def status_filter(req: Request, node: NodeInfo) -> str | None:
    if not node.ready:
        return "node not Ready"
    if not node.schedulable:
        return "node unschedulable (cordoned)"
    return None


# Taint effects that keep a pod off a node (PreferNoSchedule only discourages).
HARD_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


@lru_cache(maxsize=4096)
def tolerated(tolerations: tuple[Toleration, ...], taint: Taint) -> bool:
    """Whether any toleration tolerates the taint (memoised: a fleet repeats its taints)."""
    return any(t.tolerates(taint) for t in tolerations)


def taint_filter(req: Request, node: NodeInfo) -> str | None:
    for taint in node.taints:
        if taint.effect in HARD_EFFECTS and not tolerated(req.tolerations, taint):
            return f"untolerated taint {taint.key}={taint.value}:{taint.effect}"
    return None


def device_filter(req: Request, node: NodeInfo) -> str | None:
    if node.devices is None:
        return None  # unknown: leave it to kube-scheduler and DRA
    if req.indices is not None:
        missing = sorted(set(req.indices) - node.devices)
        if missing:
            return f"no device with index {missing}"
        if req.exclusive:
            taken = sorted(set(req.indices) & node.allocated)
            if taken:
                return f"device index {taken} already allocated"
        return None
    have = node.free if req.exclusive else len(node.devices)
    if have is not None and have < req.count:
        return f"{have} free device(s), {req.count} needed"
    return None


CHAIN: tuple[Filter, ...] = (
    target_node_filter,
    node_selector_filter,
    status_filter,
    taint_filter,
    device_filter,
)


def filter_nodes(
    req: Request, nodes: Sequence[NodeInfo], chain: Sequence[Filter] = CHAIN
) -> tuple[list[NodeInfo], dict[str, str]]:
    """Candidates, and the first rejection reason of every other node."""
    kept: list[NodeInfo] = []
    rejected: dict[str, str] = {}
    # Filters that cannot reject anything for this request are skipped: a
    # fleet is filtered node by node, and each call costs.
    idle: dict[Filter, bool] = {
        target_node_filter: req.target_node is None,
        node_selector_filter: not req.node_selector,
    }
    chain = [f for f in chain if not idle.get(f, False)]
    for node in nodes:
        for check in chain:
            reason = check(req, node)
            if reason is not None:
                rejected[node.name] = reason
                break
        else:
            kept.append(node)
    return kept, rejected
