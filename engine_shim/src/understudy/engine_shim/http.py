"""The engine's two HTTP surfaces, on one asyncio loop in a background thread.

- the **status** port (bound at process start): ``/startup``, ``/live``,
  ``/ready``, ``/state``, ``/metrics``;
- the **serving** socket (bound only by ``bind_serving``, i.e. only when the
  engine is Active): a Unix socket in the pod's run directory, which only the
  pod's front door connects to; the adapter's routes and ``GET /health``.
  A request that carries another epoch than this engine's, or arrives while
  it drains, is refused with 409 and ``X-Understudy-Not-Active``: the front
  then waits for the engine the lock names.

The same loop writes the engine's heartbeat, so a loop that stops (a stopped
or wedged process) stops the heartbeat too. Heavy work (inference) runs in
the adapter's executor, so the loop keeps answering while the engine computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import prometheus_client as prom
from aiohttp import web

from understudy.engine_shim.probes import Probe, Verdict
from understudy.wire.heartbeat import HeartbeatWriter

Health = Callable[[], tuple[bool, str]]
EPOCH_HEADER = "X-Understudy-Epoch"
NOT_ACTIVE_HEADER = "X-Understudy-Not-Active"
# Often enough that a hang is seen within the front's limit (1 s by default)
# with room for a busy loop; rarely enough to cost nothing.
HEARTBEAT_S = 0.1


class HttpHost:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._runners: list[web.AppRunner] = []
        self._serving: web.AppRunner | None = None
        self._serving_path: Path | None = None
        self.inflight = 0
        self.draining = False
        self._idle: asyncio.Event | None = None

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

    def start_heartbeat(self, path: Path, epoch: Callable[[], int | None]) -> None:
        """Rewrite the heartbeat record from this loop every HEARTBEAT_S."""
        writer = HeartbeatWriter(path)

        def beat() -> None:
            writer.beat(epoch() or 0)
            self.loop.call_later(HEARTBEAT_S, beat)

        self.loop.call_soon_threadsafe(beat)

    def _refusal(self, claimed: str | None, epoch: int) -> web.Response | None:
        """409 for a request this engine must not take: it drains, or it was
        meant for another epoch's engine. None: take it."""
        if not self.draining and (claimed is None or claimed == str(epoch)):
            return None
        why = "draining" if self.draining else f"epoch {claimed} is not this engine's"
        refused = web.Response(status=409, text=why + "\n", headers={NOT_ACTIVE_HEADER: why})
        # No keep-alive to an engine on its way out: the front's next try opens
        # a new connection, which finds the next engine.
        refused.force_close()
        return refused

    async def _counted(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Run ``handler`` as one in-flight request, which a drain waits for."""
        self.inflight += 1
        assert self._idle is not None
        self._idle.clear()
        try:
            response = await handler(request)
            if self.is_draining():  # it may have begun while this request ran
                response.force_close()
            # Send it all before counting it done: a drain that ends the
            # process must not cut an answer that was still being written.
            if not response.prepared:
                await response.prepare(request)
            await response.write_eof()
            return response
        except ConnectionResetError:
            if request.transport is not None and not request.transport.is_closing():
                raise  # not the client's: an error of ours
            # The client hung up, say before its body arrived: nobody to
            # answer, nothing wrong here (aiohttp would log an error and a
            # traceback).
            return web.Response(status=400, text="the client hung up\n")
        finally:
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()

    async def _serve_unix(self, path: Path, routes: list[web.RouteDef], middleware: Any) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[middleware])
        app.add_routes(routes)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.UnixSite(runner, str(path)).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._serving, self._serving_path = runner, path

    def bind_serving(
        self, path: Path, routes: list[web.RouteDef], health: Health, epoch: Callable[[], int]
    ) -> None:
        """Listen on the serving socket; raises OSError if it cannot."""

        async def health_view(request: web.Request) -> web.Response:
            ok, why = health()
            return web.Response(status=200 if ok else 503, text=why + "\n")

        @web.middleware
        async def fence(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            refused = self._refusal(request.headers.get(EPOCH_HEADER), epoch())
            return refused if refused is not None else await self._counted(request, handler)

        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket of this very engine id: never another engine's
        self._call(self._serve_unix(path, [*routes, web.get("/health", health_view)], fence))
        path.chmod(0o660)

    def is_draining(self) -> bool:
        return self.draining

    def drain(self, timeout: float) -> int:
        """Take no new requests; wait (at most ``timeout``) for the in-flight
        ones to finish. Returns how many are still running."""

        if self._serving_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._serving_path.unlink()  # no new connection finds it

        async def stop() -> int:
            self.draining = True
            if self._idle is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._idle.wait()
            return self.inflight

        result: int = self._call(stop(), timeout + 5)
        return result
