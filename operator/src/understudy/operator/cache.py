"""Watch-based caches of Nodes, ResourceSlices and ResourceClaims for the scheduler.

Shell module. One :class:`Informer` per kind lists once, then watches from
the list's resourceVersion (with bookmarks), and feeds every event into the
scheduler's :class:`~understudy.operator.scheduler.inventory.Inventory`, so a
scheduling decision reads memory instead of listing the cluster on every
pass. A watch that ends (the server's timeout) resumes from the last
resourceVersion; one the server has compacted away (410 Gone) relists.
A kind the operator may not read (403) or the cluster does not serve (404)
is *unknown*, and placement leaves the choice to kube-scheduler, exactly as
a failed list did. Until every informer has synced, ``observe`` keeps
listing.

Objects are read as raw JSON (no model classes): at thousands of
ResourceSlices the generated models cost more than the decision itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp

from understudy.operator.scheduler import NodeInfo
from understudy.operator.scheduler.inventory import Inventory
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.operator.cache")

WATCH_TIMEOUT_S = 290  # server-side; the client's read timeout is a little longer
PAGE = 500

OnReset = Callable[[Iterable[Mapping[str, Any]] | None], None]
OnEvent = Callable[[str, Mapping[str, Any]], None]


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): relist."""


class HttpError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:200]}")
        self.status = status


class Informer:
    """List, then watch, one kind of object; report a reset and then every event."""

    def __init__(self, api: Any, path: str, on_reset: OnReset, on_event: OnEvent) -> None:
        self.api = api
        self.path = path
        self.on_reset = on_reset
        self.on_event = on_event
        self.synced = asyncio.Event()
        self.unknown = False  # not readable: the consumer treats the kind as unknown
        self.events = 0
        self.relists = 0

    async def _get(self, query: list[tuple[str, Any]], read_timeout: float) -> Any:
        method, url, headers, _, _ = await self.api.param_serialize(
            "GET",
            self.path,
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=read_timeout)
        resp = await self.api.rest_client.request(
            method, url, headers=headers, _request_timeout=timeout
        )
        raw = resp.response
        if raw.status != 200:
            text = await raw.text()
            raw.release()
            raise HttpError(raw.status, text)
        return raw

    async def list(self) -> str:
        items: list[Mapping[str, Any]] = []
        cont: str | None = None
        while True:
            query: list[tuple[str, Any]] = [("limit", PAGE)]
            if cont:
                query.append(("continue", cont))
            raw = await self._get(query, 60)
            try:
                body = json.loads(await raw.read())
            finally:
                raw.release()
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            cont = meta.get("continue")
            if not cont:
                self.on_reset(items)
                self.relists += 1
                return str(meta.get("resourceVersion", ""))

    async def watch(self, rv: str) -> str:
        """Follow changes from ``rv`` until the server ends the watch; the last rv."""
        query: list[tuple[str, Any]] = [
            ("watch", "true"),
            ("resourceVersion", rv),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", WATCH_TIMEOUT_S),
        ]
        raw = await self._get(query, WATCH_TIMEOUT_S + 30)
        try:
            while True:
                line = await raw.content.readline()
                if not line:
                    return rv
                ev = json.loads(line)
                kind, obj = ev.get("type"), ev.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", ""))
                    raise HttpError(int(obj.get("code") or 500), obj.get("message", ""))
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.events += 1
                    self.on_event(kind, obj)
        finally:
            raw.release()

    async def run(self) -> None:
        backoff = 0.5
        while True:
            try:
                rv = await self.list()
                self.unknown = False
                self.synced.set()
                backoff = 0.5
                while True:
                    rv = await self.watch(rv)
            except Gone:
                log_event(log, "cache_relist", logging.DEBUG, path=self.path)
            except HttpError as exc:
                if exc.status in (403, 404):
                    # Not ours to read: unknown, and look again now and then.
                    self.unknown = True
                    self.on_reset(None)
                    self.synced.set()
                    log_event(log, "cache_unreadable", path=self.path, status=exc.status)
                    await asyncio.sleep(60)
                else:
                    log_event(log, "cache_error", logging.WARNING, path=self.path, error=exc)
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                log_event(log, "cache_error", logging.WARNING, path=self.path, error=exc)
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)


class ClusterCache:
    """Nodes, ResourceSlices and ResourceClaims, kept current by watches."""

    def __init__(self, api: Any) -> None:
        self.inventory = Inventory()
        inv = self.inventory

        def dispatch(put: OnEvent, drop: OnEvent) -> OnEvent:
            def on_event(kind: str, obj: Mapping[str, Any]) -> None:
                (drop if kind == "DELETED" else put)(kind, obj)

            return on_event

        def nodes_reset(items: Iterable[Mapping[str, Any]] | None) -> None:
            inv.reset_nodes(items or ())

        self.informers = {
            "nodes": Informer(
                api,
                "/api/v1/nodes",
                nodes_reset,
                dispatch(lambda _, o: inv.put_node(o), lambda _, o: inv.drop_node(o)),
            ),
            "resourceslices": Informer(
                api,
                "/apis/resource.k8s.io/v1/resourceslices",
                inv.reset_slices,
                dispatch(lambda _, o: inv.put_slice(o), lambda _, o: inv.drop_slice(o)),
            ),
            "resourceclaims": Informer(
                api,
                "/apis/resource.k8s.io/v1/resourceclaims",
                inv.reset_claims,
                dispatch(lambda _, o: inv.put_claim(o), lambda _, o: inv.drop_claim(o)),
            ),
        }
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for name, inf in self.informers.items():
            self._tasks.append(asyncio.create_task(inf.run(), name=f"cache-{name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers.values())

    async def wait_synced(self) -> None:
        for inf in self.informers.values():
            await inf.synced.wait()

    @property
    def nodes_known(self) -> bool:
        return not self.informers["nodes"].unknown

    def node_infos(self, driver: str, attribute: str) -> tuple[NodeInfo, ...]:
        return self.inventory.node_infos(driver, attribute)

    def node_ready(self) -> Mapping[str, bool]:
        return self.inventory.node_ready()
