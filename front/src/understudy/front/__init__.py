"""The pod's front door: owns the serving port for the pod's whole life and
forwards each request to the Active engine (newest epoch) over its Unix
socket; holds requests while no engine is Active, migrates the ones whose
engine died, and kills an Active engine whose heartbeat stopped.

``fsm`` (routing machine and request verdicts, pure), ``continuation`` (what a
migrated stream sends to the next engine, pure), ``proxy`` (the asyncio
shell), ``downstream`` (its HTTP/1.1 server, on llhttp), ``upstream`` (its
client to the engines' sockets), ``forwarding`` (what a request becomes for
an engine, and its answer for the client), ``status`` (probes and metrics on
their own port), ``metrics``, ``config``, ``cli``.
"""

from understudy.front.config import FrontConfig
from understudy.front.proxy import Front, run

__all__ = ["Front", "FrontConfig", "run"]
