"""Instance scheduler: a filter chain, then scorers, and a scale-down ranking (pure)."""

from understudy.operator.scheduler.filters import (
    NodeInfo,
    Request,
    Taint,
    Toleration,
    filter_nodes,
)
from understudy.operator.scheduler.ranking import keep_score, removal_order
from understudy.operator.scheduler.scorers import Placement, score, select

__all__ = [
    "NodeInfo",
    "Placement",
    "Request",
    "Taint",
    "Toleration",
    "filter_nodes",
    "keep_score",
    "removal_order",
    "score",
    "select",
]
