"""The engine's two HTTP surfaces, on one asyncio loop in a background thread.

- the **status** port (bound at process start): ``/startup``, ``/live``,
  ``/ready``, ``/state``, ``/metrics``;
- the **serving** port (bound only by ``bind_serving``, i.e. only when the
  engine is Active): the adapter's routes and ``GET /health``.

Heavy work (inference) runs in the adapter's executor, so the loop keeps
answering probes while the engine computes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import prometheus_client as prom
from aiohttp import web

from understudy.engine_shim.probes import Probe, Verdict

Health = Callable[[], tuple[bool, str]]


class HttpHost:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._runners: list[web.AppRunner] = []

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    def _call(self, coro: Any, timeout: float = 30.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    async def _serve(self, app: web.Application, host: str, port: int) -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=False)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runners.append(runner)

    def serve_status(
        self,
        host: str,
        port: int,
        verdict: Callable[[Probe], Verdict],
        state: Callable[[], dict[str, Any]],
        registry: prom.CollectorRegistry,
    ) -> None:
        async def probe(request: web.Request) -> web.Response:
            v = verdict(Probe(request.match_info["probe"]))
            return web.Response(status=v.status, text=v.reason + "\n")

        async def state_view(request: web.Request) -> web.Response:
            return web.Response(text=json.dumps(state()), content_type="application/json")

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(
                body=prom.generate_latest(registry),
                headers={"Content-Type": prom.CONTENT_TYPE_LATEST},
            )

        app = web.Application()
        app.add_routes(
            [
                web.get("/{probe:startup|live|ready}", probe),
                web.get("/state", state_view),
                web.get("/metrics", metrics),
            ]
        )
        self._call(self._serve(app, host, port))

    def bind_serving(
        self, host: str, port: int, routes: list[web.RouteDef], health: Health
    ) -> None:
        """Bind the serving port; raises OSError if something else holds it."""

        async def health_view(request: web.Request) -> web.Response:
            ok, why = health()
            return web.Response(status=200 if ok else 503, text=why + "\n")

        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.add_routes([*routes, web.get("/health", health_view)])
        self._call(self._serve(app, host, port))
