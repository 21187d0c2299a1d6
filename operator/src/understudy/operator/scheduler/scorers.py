"""Placement scorers: binpack or spread, then the best candidate, pure.

binpack prefers the node that is fullest after placement (fewest bins used);
spread prefers the emptiest one and, above all, a node holding fewer replicas
of this instance (one lost node takes fewer replicas with it). Ties break on
the node name so the choice is deterministic.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from understudy.operator.api import PlacementStrategy
from understudy.operator.scheduler.filters import NodeInfo, Request, filter_nodes


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


def score(req: Request, node: NodeInfo) -> float:
    util = _utilisation_after(req, node)
    match req.strategy:
        case PlacementStrategy.BINPACK:
            return 100.0 * util + 10.0 * node.ours
        case PlacementStrategy.SPREAD:
            return 100.0 * (1.0 - util) - 1000.0 * node.ours


def select(req: Request, nodes: Sequence[NodeInfo]) -> Placement:
    if not nodes:
        return Placement(None, True, "no node information: kube-scheduler places the pod")
    kept, rejected = filter_nodes(req, nodes)
    if not kept:
        detail = "; ".join(f"{n}: {r}" for n, r in sorted(rejected.items()))
        return Placement(None, False, f"no feasible node ({detail})")
    best = max(kept, key=lambda n: (score(req, n), [-ord(c) for c in n.name]))
    return Placement(
        best.name, True, f"{req.strategy} chose {best.name} of {len(kept)} candidate(s)"
    )
