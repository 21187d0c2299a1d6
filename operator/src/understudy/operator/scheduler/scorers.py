"""Placement scorers: binpack or spread plus locality, then the best candidate, pure.

GPUStack's scorer chain: the total score of a candidate is the sum of its
scorers, and the highest total wins.

* **placement** (always): binpack prefers the node that is fullest after
  placement (fewest bins used); spread prefers the emptiest one and, above
  all, a node holding fewer replicas of this instance (one lost node takes
  fewer replicas with it).
* **locality**: a node that already holds the engine image (its
  ``status.images``, as kube-scheduler's ImageLocality reads it) or carries
  the labels the instance prefers (``placement.preferredNodeLabels``, e.g. a
  label a user puts on the nodes that hold the model's files) starts the
  engine sooner: no image pull, no model download.

Weights: placement spans 0..100, locality 0..50, so locality decides between
nodes whose fill differs by less than half, and never overrides spread's
"fewer replicas of this instance per node". Ties break on the node name so
the choice is deterministic.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from understudy.operator.api import PlacementStrategy
from understudy.operator.scheduler.filters import NodeInfo, Request, filter_nodes

PLACEMENT_WEIGHT = 100.0
LOCALITY_WEIGHT = 50.0
SPREAD_REPLICA_PENALTY = 1000.0
BINPACK_REPLICA_BONUS = 10.0


@dataclass(frozen=True, slots=True)
class Placement:
    node: str | None  # None: no node info; kube-scheduler picks among the selector's nodes
    feasible: bool
    reason: str


def _utilisation_after(req: Request, node: NodeInfo) -> float:
    if node.devices is None or not node.devices:
        return 0.0
    free = node.free if node.free is not None else 0
    used = len(node.devices) - free + req.count
    return min(1.0, used / len(node.devices))


def image_names(name: str) -> tuple[str, ...]:
    """The spellings of one image reference that a node's status may list."""
    out = [name]
    for prefix in ("docker.io/library/", "docker.io/"):
        if name.startswith(prefix):
            out.append(name[len(prefix) :])
    return tuple(out)


def placement_score(req: Request, node: NodeInfo) -> float:
    util = _utilisation_after(req, node)
    match req.strategy:
        case PlacementStrategy.BINPACK:
            return PLACEMENT_WEIGHT * util + BINPACK_REPLICA_BONUS * node.ours
        case PlacementStrategy.SPREAD:
            return PLACEMENT_WEIGHT * (1.0 - util) - SPREAD_REPLICA_PENALTY * node.ours


def locality_score(req: Request, node: NodeInfo) -> float:
    """0..1: the share of locality signals the node satisfies."""
    signals: list[float] = []
    if req.image is not None:
        signals.append(float(any(n in node.images for n in image_names(req.image))))
    if req.preferred_labels:
        hits = sum(1 for k, v in req.preferred_labels.items() if node.labels.get(k) == v)
        signals.append(hits / len(req.preferred_labels))
    return sum(signals) / len(signals) if signals else 0.0


def score(req: Request, node: NodeInfo) -> float:
    return placement_score(req, node) + LOCALITY_WEIGHT * locality_score(req, node)


def select(req: Request, nodes: Sequence[NodeInfo]) -> Placement:
    if not nodes:
        return Placement(None, True, "no node information: kube-scheduler places the pod")
    kept, rejected = filter_nodes(req, nodes)
    if not kept:
        detail = "; ".join(f"{n}: {r}" for n, r in sorted(rejected.items())[:8])
        more = f" and {len(rejected) - 8} more" if len(rejected) > 8 else ""
        return Placement(None, False, f"no feasible node ({detail}{more})")
    best = kept[0]
    best_score = score(req, best)
    for node in kept[1:]:
        s = score(req, node)
        if s > best_score or (s == best_score and node.name < best.name):
            best, best_score = node, s
    return Placement(
        best.name, True, f"{req.strategy} chose {best.name} of {len(kept)} candidate(s)"
    )
