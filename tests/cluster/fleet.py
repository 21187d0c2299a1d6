"""A fleet of Node objects with fake GPUs in a real apiserver, without kubelets.

Nodes are API objects: ``Fleet.grow(n)`` creates ``n`` Nodes (Ready, tainted
``understudy.dev/fleet=<name>:NoSchedule`` so no one else's pod lands on
them), their ResourceSlices (8 GPUs each, driver ``fleet.understudy.dev``,
its own DeviceClass, so kube-scheduler's allocations for the real node's
fake GPUs never consider them) and their node Leases. ``heartbeat()`` renews
the Leases the way kubelets do, so the node lifecycle controller keeps the
Nodes Ready (it marks a node whose lease stops moving Unknown after ~50 s).
Scheduling decisions over them are real decisions over real API data,
though no kubelet runs a pod bound there.

``delete()`` removes everything by label (deletecollection): leave no 1,000
fake nodes behind on a shared cluster. Used by tests/cluster/test_fleet.py
and bench/scheduler.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

LABEL = "understudy.dev/fleet"
DRIVER = "fleet.understudy.dev"
ZONE = "topology.kubernetes.io/zone"
GPUS = 8
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
MERGE = "application/merge-patch+json"


def _now_micro() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


async def request(
    api: Any,
    method: str,
    path: str,
    body: Any = None,
    query: list[tuple[str, Any]] | None = None,
    content_type: str = "application/json",
) -> Any:
    """One raw API call with the client's credentials; the JSON answer."""
    m, url, headers, data, _ = await api.param_serialize(
        method,
        path,
        query_params=query or [],
        header_params={"Accept": "application/json", "Content-Type": content_type},
        body=body,
        auth_settings=["BearerToken"],
    )
    resp = await api.rest_client.request(m, url, headers=headers, body=data)
    raw = resp.response
    try:
        text = await raw.text()
    finally:
        raw.release()
    if raw.status >= 300:
        raise ApiError(raw.status, text)
    return json.loads(text) if text else None


class Fleet:
    def __init__(self, api: Any, name: str = "bench", gpus: int = GPUS) -> None:
        self.api = api
        self.name = name
        self.gpus = gpus
        self.size = 0
        self._beat: asyncio.Task[None] | None = None
        self.beats = 0
        self.missed = 0
        self.last_error = ""
        self.beat_seconds = 0.0

    def node_name(self, i: int) -> str:
        return f"fleet-{self.name}-{i:05d}"

    @property
    def selector(self) -> str:
        return f"{LABEL}={self.name}"

    def node(self, i: int) -> dict[str, Any]:
        name = self.node_name(i)
        now = _now()
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    LABEL: self.name,
                    ZONE: f"zone-{i % 4}",
                    "kubernetes.io/hostname": name,
                },
            },
            "spec": {"taints": [{"key": LABEL, "value": self.name, "effect": "NoSchedule"}]},
            "status": {
                "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
                "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "FleetNode",
                        "message": "a Node object without a kubelet (tests/cluster/fleet.py)",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
            },
        }

    def resource_slice(self, i: int) -> dict[str, Any]:
        node = self.node_name(i)
        devices = [
            {
                "name": f"gpu-{d}",
                "attributes": {
                    "index": {"int": d},
                    "productName": {"string": "Fleet-H100"},
                },
                "capacity": {"memory": {"value": "80Gi"}},
            }
            for d in range(self.gpus)
        ]
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}", "labels": {LABEL: self.name}},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }

    def lease(self, i: int) -> dict[str, Any]:
        node = self.node_name(i)
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": node,
                "namespace": "kube-node-lease",
                "labels": {LABEL: self.name},
            },
            "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": _now_micro()},
        }

    async def _each(self, fn: Any, items: Iterable[int], concurrency: int) -> None:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                await fn(i)

        await asyncio.gather(*(one(i) for i in items))

    async def _create_one(self, i: int) -> None:
        async def create(path: str, body: dict[str, Any]) -> None:
            try:
                await request(self.api, "POST", path, body)
            except ApiError as exc:
                if exc.status != 409:
                    raise

        await create("/api/v1/nodes", self.node(i))
        # The apiserver taints every new Node not-ready (NoSchedule) and the
        # node lifecycle controller lifts the taint once it sees Ready, about
        # ten nodes a second: minutes for a fleet. Lift it as it would.
        taints = self.node(i)["spec"]["taints"]
        path = f"/api/v1/nodes/{self.node_name(i)}"
        await request(self.api, "PATCH", path, {"spec": {"taints": taints}}, content_type=MERGE)
        await create(
            "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", self.lease(i)
        )
        await create("/apis/resource.k8s.io/v1/resourceslices", self.resource_slice(i))

    async def ensure_device_class(self) -> None:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER, "labels": {LABEL: self.name}},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        }
        try:
            await request(self.api, "POST", "/apis/resource.k8s.io/v1/deviceclasses", body)
        except ApiError as exc:
            if exc.status != 409:
                raise

    async def grow(self, n: int, concurrency: int = 24) -> float:
        """Grow the fleet to ``n`` nodes; seconds it took."""
        started = time.perf_counter()
        await self.ensure_device_class()
        await self._each(self._create_one, range(self.size, n), concurrency)
        self.size = max(self.size, n)
        return time.perf_counter() - started

    async def renew(self, concurrency: int = 32) -> None:
        async def one(i: int) -> None:
            path = f"{LEASES}/{self.node_name(i)}"
            body = {"spec": {"renewTime": _now_micro()}}
            try:
                await request(self.api, "PATCH", path, body, content_type=MERGE)
            except Exception as exc:  # a missed beat, never a dead heartbeat
                self.missed += 1
                self.last_error = repr(exc)

        await self._each(one, range(self.size), concurrency)
        self.beats += 1

    def start_heartbeat(self, period: float = 20.0) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(period)
                started = time.perf_counter()
                await self.renew()
                self.beat_seconds = time.perf_counter() - started

        self._beat = asyncio.create_task(loop(), name="fleet-heartbeat")

    async def stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
            self._beat = None

    async def allocate(self, claim_ns: str, claim: str, node: int, devices: int) -> None:
        """An allocated ResourceClaim holding ``devices`` GPUs of fleet node ``node``."""
        node_name = self.node_name(node)
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": claim, "namespace": claim_ns, "labels": {LABEL: self.name}},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpus",
                            "exactly": {"deviceClassName": DRIVER, "count": devices},
                        }
                    ]
                }
            },
        }
        base = f"/apis/resource.k8s.io/v1/namespaces/{claim_ns}/resourceclaims"
        created = await request(self.api, "POST", base, body)
        created["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpus",
                            "driver": DRIVER,
                            "pool": node_name,
                            "device": f"gpu-{d}",
                        }
                        for d in range(devices)
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node_name]}
                            ]
                        }
                    ]
                },
            }
        }
        await request(self.api, "PUT", f"{base}/{claim}/status", created)

    async def delete(self) -> None:
        """Every object of this fleet, by label (deletecollection), and its DeviceClass."""
        q = [("labelSelector", self.selector)]
        await self.stop_heartbeat()
        for path in (
            "/apis/resource.k8s.io/v1/resourceslices",
            LEASES,
            "/api/v1/nodes",
            "/apis/resource.k8s.io/v1/deviceclasses",
        ):
            with contextlib.suppress(ApiError):
                await request(self.api, "DELETE", path, query=q)
        self.size = 0

    async def count(self) -> dict[str, int]:
        q = [("labelSelector", self.selector)]
        out = {}
        for kind, path in (
            ("nodes", "/api/v1/nodes"),
            ("resourceslices", "/apis/resource.k8s.io/v1/resourceslices"),
            ("leases", LEASES),
        ):
            body = await request(self.api, "GET", path, query=[*q, ("limit", 1)])
            meta = body.get("metadata") or {}
            out[kind] = len(body.get("items") or []) + int(meta.get("remainingItemCount") or 0)
        return out


class Loop:
    """An event loop in a thread, with an API client in it: async fleet work from sync tests."""

    def __init__(self, kubeconfig: str) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.api: Any = self.run(self._client(kubeconfig))

    async def _client(self, kubeconfig: str) -> Any:
        from kubernetes.aio import config
        from kubernetes.aio.client import ApiClient, Configuration

        cfg = Configuration()
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        cfg.connection_pool_maxsize = 64
        return ApiClient(configuration=cfg)

    def run(self, coro: Any, timeout: float = 900) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.api.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
