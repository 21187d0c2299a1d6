"""Observed state of one GpuInstance: its pods, the nodes, devices, engines and fronts.

Shell module: reads the API with the ``kubernetes.aio`` dynamic client, each
engine's ``/state`` and (when the instance autoscales) each front's
``/pressure`` over HTTP, then builds the plain, frozen
:class:`~understudy.operator.view.Observed` that ``plan`` decides from. The
parsing functions (``pod_view``, ``node_infos``, ``engine_view``,
``pressure_view``, ``endpoint_pods``) are pure and unit-tested; the
coroutines only fetch.

Nodes, ResourceSlices and ResourceClaims come from the watch-based
:class:`~understudy.operator.cache.ClusterCache` once it has synced, and
from a list per pass before that (or without a cache).

Every read that the operator may lack permission for (nodes, ResourceSlices,
cluster-wide ResourceClaims, EndpointSlices) degrades to "unknown" rather
than failing the reconcile; an engine or front that does not answer within
a short timeout is unknown too (never blocking the loop for long).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

import aiohttp

from understudy.operator import api, render
from understudy.operator.api import GpuInstance
from understudy.operator.cache import ClusterCache
from understudy.operator.scheduler import NodeInfo, inventory
from understudy.operator.view import ContainerView, EngineView, Observed, PodView, Pressure

log = logging.getLogger("understudy.operator.observe")

STATE_TIMEOUT_S = 0.5


def _int(text: object) -> int | None:
    try:
        return int(str(text))
    except (TypeError, ValueError):
        return None


def _time(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """A pod (API dict, camelCase) as the planner sees it."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    unschedulable = None
    ready = False
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            unschedulable = f"{cond.get('reason', '')}: {cond.get('message', '')}".strip(": ")
        if cond.get("type") == "Ready":
            ready = cond.get("status") == "True"
    front_ready = any(
        c.get("name") == render.FRONT and bool(c.get("ready"))
        for c in status.get("initContainerStatuses") or []
    )
    containers = tuple(
        ContainerView(
            name=c.get("name", ""),
            ready=bool(c.get("ready")),
            started=bool(c.get("started")),
            restart_count=int(c.get("restartCount") or 0),
            waiting_reason=((c.get("state") or {}).get("waiting") or {}).get("reason"),
        )
        for c in status.get("containerStatuses") or []
    )
    requests = {
        c.get("name", ""): {
            k: str(v) for k, v in ((c.get("resources") or {}).get("requests") or {}).items()
        }
        for c in spec.get("containers") or []
    }
    return PodView(
        name=meta.get("name", ""),
        index=_int(labels.get(render.LABEL_REPLICA)),
        attempt=_int(annotations.get(render.ANNOTATION_ATTEMPT)),
        spec_hash=annotations.get(render.ANNOTATION_SPEC_HASH),
        phase=status.get("phase") or "Pending",
        node=spec.get("nodeName") or None,
        deleting=meta.get("deletionTimestamp") is not None,
        unschedulable=unschedulable or None,
        routable_label=labels.get(render.LABEL_ROUTABLE),
        ready=ready,
        front_ready=front_ready,
        containers=containers,
        requests=requests,
    )


def engine_view(data: Mapping[str, Any] | None) -> EngineView:
    """An engine's ``/state`` JSON (role, state, epoch, granted_at, active_at, released_at...)."""
    if not data:
        return EngineView()
    epoch = data.get("epoch")
    return EngineView(
        role=str(data["role"]) if data.get("role") is not None else None,
        state=str(data["state"]) if data.get("state") is not None else None,
        epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        granted_at=_time(data.get("granted_at")),
        active_at=_time(data.get("active_at")),
        released_at=_time(data.get("released_at")),
    )


def pressure_view(data: Mapping[str, Any] | None) -> Pressure | None:
    """A front's ``/pressure`` JSON (inflight, held, active); None when unusable."""
    if not data:
        return None
    inflight, held = data.get("inflight"), data.get("held")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (inflight, held)):
        return None
    assert isinstance(inflight, int) and isinstance(held, int)
    return Pressure(inflight=inflight, held=held, active=bool(data.get("active")))


def endpoint_pods(slices: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """The pods an EndpointSlice list names (any condition: listed is listed)."""
    return frozenset(
        str(ref.get("name"))
        for sl in slices
        for ep in sl.get("endpoints") or []
        if (ref := ep.get("targetRef") or {}).get("kind") == "Pod"
    )


def device_view(inst: GpuInstance) -> tuple[str, str]:
    """(driver, index attribute) of the instance's devices."""
    g = inst.spec.gpus
    return g.device_class_name, g.index_attribute or f"{g.device_class_name}/index"


def node_infos(
    inst: GpuInstance,
    nodes: Iterable[Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]] | None,
    claims: Iterable[Mapping[str, Any]] | None,
) -> tuple[tuple[NodeInfo, ...], dict[str, bool]]:
    """Placement candidates from Nodes, ResourceSlices and allocated ResourceClaims."""
    driver, attribute = device_view(inst)
    return inventory.node_infos(driver, attribute, nodes, slices, claims)


async def _list(
    dyn: Any, api_version: str, kind: str, **kwargs: Any
) -> list[dict[str, Any]] | None:
    """Items as dicts, or None when the read is forbidden or the kind is unknown."""
    from kubernetes.aio.client.exceptions import ApiException
    from kubernetes.aio.dynamic.exceptions import DynamicApiError, ResourceNotFoundError

    try:
        resource = await dyn.resources.get(api_version=api_version, kind=kind)
        result = await dyn.get(resource, **kwargs)
    except ResourceNotFoundError:
        return None
    except (ApiException, DynamicApiError) as exc:
        if getattr(exc, "status", None) in (403, 404):
            log.debug("event=observe_unavailable kind=%s status=%s", kind, exc.status)
            return None
        raise
    items: list[dict[str, Any]] = result.to_dict().get("items") or []
    return items


async def fetch_json(
    http: aiohttp.ClientSession, ip: str, port: int, path: str, limit_s: float = STATE_TIMEOUT_S
) -> dict[str, Any] | None:
    """``GET http://ip:port/path`` as a JSON object, or None (unknown) past ``limit_s``."""
    try:
        async with asyncio.timeout(limit_s):
            async with http.get(f"http://{ip}:{port}{path}") as resp:
                if resp.status != 200:
                    return None
                data = await resp.json(content_type=None)
                return data if isinstance(data, dict) else None
    except (TimeoutError, aiohttp.ClientError, ValueError, OSError):
        return None


async def fetch_state(
    http: aiohttp.ClientSession, ip: str, port: int, limit_s: float = STATE_TIMEOUT_S
) -> dict[str, Any] | None:
    """An engine's /state, or None (unknown) when it does not answer within ``limit_s``."""
    return await fetch_json(http, ip, port, "/state", limit_s)


async def placement_inputs(
    dyn: Any, inst: GpuInstance, cache: ClusterCache | None
) -> tuple[tuple[NodeInfo, ...], dict[str, bool] | None]:
    """Candidates and node readiness: from the cache once synced, else a list per pass."""
    if cache is not None and cache.synced:
        if not cache.nodes_known:
            return (), None
        return cache.node_infos(*device_view(inst)), dict(cache.node_ready())
    nodes_raw, slices, claims = await asyncio.gather(
        _list(dyn, "v1", "Node"),
        _list(dyn, "resource.k8s.io/v1", "ResourceSlice"),
        _list(dyn, "resource.k8s.io/v1", "ResourceClaim"),
    )
    if nodes_raw is None:
        return (), None
    return node_infos(inst, nodes_raw, slices, claims)


async def observe(
    dyn: Any,
    http: aiohttp.ClientSession,
    inst: GpuInstance,
    *,
    state_timeout: float = STATE_TIMEOUT_S,
    cache: ClusterCache | None = None,
) -> Observed:
    ns = inst.metadata.namespace
    selector = f"{render.LABEL_INSTANCE}={inst.metadata.name}"
    pods_raw = await _list(dyn, "v1", "Pod", namespace=ns, label_selector=selector) or []
    owned = [
        p
        for p in pods_raw
        if any(
            o.get("uid") == inst.metadata.uid
            for o in (p.get("metadata") or {}).get("ownerReferences") or []
        )
    ]
    nodes, node_ready = await placement_inputs(dyn, inst, cache)
    slices = await _list(
        dyn,
        "discovery.k8s.io/v1",
        "EndpointSlice",
        namespace=ns,
        label_selector=f"kubernetes.io/service-name={render.endpoints_service_name(inst)}",
    )
    endpoints = endpoint_pods(slices) if slices is not None else None
    gateway = None
    if inst.spec.gateway is None:  # one left from a removed section is deleted
        deployments = await _list(
            dyn,
            "apps/v1",
            "Deployment",
            namespace=ns,
            field_selector=f"metadata.name={render.gateway_name(inst)}",
        )
        gateway = bool(deployments) if deployments is not None else None

    kind = "ResourceClaimTemplate" if inst.spec.gpus.exclusive else "ResourceClaim"
    claim_list = await _list(
        dyn,
        "resource.k8s.io/v1",
        kind,
        namespace=ns,
        field_selector=f"metadata.name={render.claim_name(inst)}",
    )
    claim = claim_list[0] if claim_list else None

    views: dict[str, PodView] = {}
    engines = render.engine_names(inst)
    probes: list[tuple[str, str, Any]] = []
    fronts: list[tuple[str, Any]] = []
    for p in owned:
        view = pod_view(p)
        views[view.name] = view
        ip = (p.get("status") or {}).get("podIP")
        if ip and view.phase == "Running" and not view.deleting:
            for i, name in enumerate(engines):
                port = api.STATUS_PORT_BASE + i
                probes.append((view.name, name, fetch_state(http, ip, port, state_timeout)))
            if inst.spec.autoscaling.enabled:
                port = api.FRONT_STATUS_PORT
                fronts.append((view.name, fetch_json(http, ip, port, "/pressure", state_timeout)))
    states, pressures = await asyncio.gather(
        asyncio.gather(*(c for _, _, c in probes)), asyncio.gather(*(c for _, c in fronts))
    )
    per_pod: dict[str, dict[str, EngineView]] = {}
    for (pod_name, engine, _), data in zip(probes, states, strict=True):
        per_pod.setdefault(pod_name, {})[engine] = engine_view(data)
    for pod_name, engine_states in per_pod.items():
        views[pod_name] = replace(views[pod_name], engines=engine_states)
    for (pod_name, _), data in zip(fronts, pressures, strict=True):
        views[pod_name] = replace(views[pod_name], pressure=pressure_view(data))
    return Observed(
        pods=views,
        node_ready=node_ready,
        nodes=nodes,
        claim=claim,
        endpoints=endpoints,
        gateway=gateway,
    )
