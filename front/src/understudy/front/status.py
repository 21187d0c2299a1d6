"""The front's status port: probes, its state, and its metrics.

On their own port, served by aiohttp: none of this is on a request's path,
so the front's lean HTTP path (``downstream``) need not serve it.
"""

from __future__ import annotations

from typing import Any, Protocol

import prometheus_client as prom
from aiohttp import web


class Source(Protocol):
    """What the status port reports on (the front)."""

    @property
    def registry(self) -> prom.CollectorRegistry: ...

    def ready(self) -> tuple[bool, str]: ...

    def pressure(self) -> dict[str, Any]: ...

    def view(self) -> dict[str, Any]: ...


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text + "\n")


def app(source: Source) -> web.Application:
    """``/live`` (the front runs), ``/ready`` (it can serve: an Active engine,
    or a failover within the hold), ``/pressure`` (in flight and held, for
    the autoscaler), ``/state`` (its routing state), ``/metrics``."""

    async def live(_: web.Request) -> web.Response:
        return _text(200, "ok")

    async def ready(_: web.Request) -> web.Response:
        ok, why = source.ready()
        return _text(200 if ok else 503, why)

    async def pressure(_: web.Request) -> web.Response:
        return web.json_response(source.pressure())

    async def view(_: web.Request) -> web.Response:
        return web.json_response(source.view())

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=prom.generate_latest(source.registry),
            headers={"Content-Type": prom.CONTENT_TYPE_LATEST},
        )

    status = web.Application()
    status.add_routes(
        [
            web.get("/live", live),
            web.get("/ready", ready),
            web.get("/pressure", pressure),
            web.get("/state", view),
            web.get("/metrics", metrics),
        ]
    )
    return status


async def serve(source: Source, host: str, port: int) -> web.AppRunner:
    """Serve the status port until the returned runner is cleaned up."""
    runner = web.AppRunner(app(source), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner
