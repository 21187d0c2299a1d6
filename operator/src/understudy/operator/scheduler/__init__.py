"""Instance scheduler: a filter chain, then scorers (pure)."""

from understudy.operator.scheduler.filters import NodeInfo, Request, filter_nodes
from understudy.operator.scheduler.scorers import Placement, score, select

__all__ = ["NodeInfo", "Placement", "Request", "filter_nodes", "score", "select"]
