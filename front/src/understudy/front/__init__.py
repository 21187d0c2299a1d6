"""The pod's front door: owns the serving port for the pod's whole life and
forwards each request to the Active engine (newest epoch) over its Unix
socket; holds requests while no engine is Active, migrates the ones whose
engine died, and kills an Active engine whose heartbeat stopped.

``fsm`` (routing machine, request verdicts and the heartbeat judgement,
pure), ``continuation`` (what a migrated stream sends to the next engine,
pure), ``router`` (the routing state, the lock watch, the heartbeat check,
the waits for a route), ``forwarder`` (each request: handle, attempt, relay,
continue; it asks a router for a route), ``proxy`` (the two together, with
the port, its hand-over and the drain), ``downstream`` (the HTTP/1.1 server,
on llhttp), ``upstream`` (the client to the engines' sockets),
``forwarding`` (what a request becomes for an engine, and its answer for
the client), ``status`` (probes and metrics on their own port), ``ledger``
(what a dying front loses, counted by the next), ``metrics``, ``config``,
``cli``.

The names below are imported when first used: ``python -m understudy.front``
runs this module first, and a restarted front must accept before it imports
the proxy.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from understudy.front.config import FrontConfig
    from understudy.front.proxy import Front, run

__all__ = ["Front", "FrontConfig", "run"]


def __getattr__(name: str) -> Any:
    if name == "FrontConfig":
        from understudy.front.config import FrontConfig

        return FrontConfig
    if name in ("Front", "run"):
        from understudy.front import proxy

        return getattr(proxy, name)
    raise AttributeError(f"module 'understudy.front' has no attribute {name!r}")
