"""The front's status port: probes, its state, and its metrics.

On their own port, off the request's path, served by the front's own HTTP
server (``downstream``): ``/live`` (the front runs), ``/ready`` (it can
serve: an Active engine, or a failover within the hold), ``/pressure`` (in
flight and held, for the autoscaler), ``/state`` (its routing state),
``/metrics``. A web framework would cost a restarted front more time to
import than the rest of its start.
"""

from __future__ import annotations

import json
import socket
from typing import Any, Protocol

from understudy.front import downstream
from understudy.front.metrics import FrontMetrics

_TEXT = (b"Content-Type", b"text/plain; charset=utf-8")
# Probes and scrapes: a few connections at a time.
_STATUS_BACKLOG = 128


class Source(Protocol):
    """What the status port reports on (the front)."""

    @property
    def metrics(self) -> FrontMetrics: ...

    def ready(self) -> tuple[bool, str]: ...

    def pressure(self) -> dict[str, Any]: ...

    def view(self) -> dict[str, Any]: ...


def handler(source: Source) -> downstream.Handler:
    def handle(ex: downstream.Exchange) -> None:
        path = ex.target.split(b"?", 1)[0]
        if ex.method not in (b"GET", b"HEAD"):
            ex.error(405, "the status port answers GET only")
        elif path == b"/live":
            ex.answer(200, [_TEXT], b"ok\n")
        elif path == b"/ready":
            ok, why = source.ready()
            ex.answer(200 if ok else 503, [_TEXT], why.encode() + b"\n")
        elif path == b"/pressure":
            ex.answer(200, [downstream.JSON], json.dumps(source.pressure()).encode())
        elif path == b"/state":
            ex.answer(200, [downstream.JSON], json.dumps(source.view()).encode())
        elif path == b"/metrics":
            from prometheus_client import exposition

            body = exposition.generate_latest(source.metrics.registry)
            ex.answer(200, [(b"Content-Type", exposition.CONTENT_TYPE_LATEST.encode())], body)
        else:
            ex.error(404, f"no such status path: {path.decode(errors='replace')}")

    return handle


async def serve(
    source: Source, host: str, port: int, sock: socket.socket | None = None
) -> downstream.Server:
    """Serve the status port until the returned server is closed: on ``sock``
    where a respawner bound it (it stays open while the process restarts)."""
    server = downstream.Server(handler(source), downstream.Limits(max_body=64 * 1024))
    if sock is None:
        await server.listen(host, port)
    else:
        server.serve_on(sock, _STATUS_BACKLOG)
    return server
