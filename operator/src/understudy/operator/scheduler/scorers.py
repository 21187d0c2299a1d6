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

from collections.abc import Callable, Sequence
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
    devices = node.devices
    if not devices:
        return 0.0
    free = node.free or 0
    return min(1.0, (len(devices) - free + req.count) / len(devices))


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


def _locality(req: Request) -> Callable[[NodeInfo], float]:
    """0..1 per node: the share of locality signals it satisfies (request parts computed once)."""
    names = image_names(req.image) if req.image is not None else ()
    labels = tuple(req.preferred_labels.items())
    n_signals = bool(names) + bool(labels)
    if not n_signals:
        return lambda node: 0.0

    def locality(node: NodeInfo) -> float:
        total = 0.0
        if names:
            total += any(n in node.images for n in names) if node.images else 0.0
        if labels:
            total += sum(1 for k, v in labels if node.labels.get(k) == v) / len(labels)
        return total / n_signals

    return locality


def locality_score(req: Request, node: NodeInfo) -> float:
    """0..1: the share of locality signals the node satisfies."""
    return _locality(req)(node)


def scorer(req: Request) -> Callable[[NodeInfo], float]:
    """The total score of a node for ``req``: placement plus weighted locality."""
    locality = _locality(req)
    return lambda node: placement_score(req, node) + LOCALITY_WEIGHT * locality(node)


def _fast_scorer(req: Request) -> Callable[[NodeInfo], float]:
    """``scorer(req)`` with the strategy resolved once (select's inner loop)."""
    locality = _locality(req)
    binpack = req.strategy is PlacementStrategy.BINPACK

    def total(node: NodeInfo) -> float:
        util = _utilisation_after(req, node)
        if binpack:
            place = PLACEMENT_WEIGHT * util + BINPACK_REPLICA_BONUS * node.ours
        else:
            place = PLACEMENT_WEIGHT * (1.0 - util) - SPREAD_REPLICA_PENALTY * node.ours
        return place + LOCALITY_WEIGHT * locality(node)

    return total


def score(req: Request, node: NodeInfo) -> float:
    return scorer(req)(node)


def select(req: Request, nodes: Sequence[NodeInfo]) -> Placement:
    if not nodes:
        return Placement(None, True, "no node information: kube-scheduler places the pod")
    kept, rejected = filter_nodes(req, nodes)
    if not kept:
        detail = "; ".join(f"{n}: {r}" for n, r in sorted(rejected.items())[:8])
        more = f" and {len(rejected) - 8} more" if len(rejected) > 8 else ""
        return Placement(None, False, f"no feasible node ({detail}{more})")
    total = _fast_scorer(req)
    best = kept[0]
    best_score = total(best)
    for node in kept[1:]:
        s = total(node)
        if s > best_score or (s == best_score and node.name < best.name):
            best, best_score = node, s
    return Placement(
        best.name, True, f"{req.strategy} chose {best.name} of {len(kept)} candidate(s)"
    )
