"""Observed state of one GpuInstance: its pods, the nodes, devices and engines.

Shell module: reads the API with the ``kubernetes.aio`` dynamic client and
each engine's ``/state`` over HTTP, then builds the plain, frozen
:class:`~understudy.operator.plan.Observed` that ``plan`` decides from. The
parsing functions (``pod_view``, ``node_infos``, ``engine_view``) are pure and
unit-tested; the coroutines only fetch.

Every read that the operator may lack permission for (nodes, ResourceSlices,
cluster-wide ResourceClaims) degrades to "unknown" rather than failing the
reconcile; an engine that does not answer ``/state`` within a short timeout
is unknown too (never blocking the loop for long).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import aiohttp

from understudy.operator import api, render
from understudy.operator.api import GpuInstance
from understudy.operator.plan import ContainerView, EngineView, Observed, PodView
from understudy.operator.scheduler import NodeInfo

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
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            unschedulable = f"{cond.get('reason', '')}: {cond.get('message', '')}".strip(": ")
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
        front_ready=front_ready,
        containers=containers,
    )


def engine_view(data: Mapping[str, Any] | None) -> EngineView:
    """An engine's ``/state`` JSON (keys: role, state, epoch, granted_at, active_at, ...)."""
    if not data:
        return EngineView()
    epoch = data.get("epoch")
    return EngineView(
        role=str(data["role"]) if data.get("role") is not None else None,
        state=str(data["state"]) if data.get("state") is not None else None,
        epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        granted_at=_time(data.get("granted_at")),
        active_at=_time(data.get("active_at")),
    )


def _ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def node_infos(
    inst: GpuInstance,
    nodes: Iterable[Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]] | None,
    claims: Iterable[Mapping[str, Any]] | None,
) -> tuple[tuple[NodeInfo, ...], dict[str, bool]]:
    """Placement candidates from Nodes, ResourceSlices and allocated ResourceClaims.

    The driver is assumed to be named like the DeviceClass (true of NVIDIA's
    ``gpu.nvidia.com`` and of our fake ``gpu.understudy.dev``); a device's
    index is its ``index`` attribute (or ``gpus.indexAttribute``).
    """
    g = inst.spec.gpus
    attr = g.index_attribute or f"{g.device_class_name}/index"
    domain, attr_name = attr.split("/", 1)
    driver = g.device_class_name
    # (driver, pool, device) -> (node, index)
    where: dict[tuple[str, str, str], tuple[str, int]] = {}
    per_node: dict[str, set[int]] = {}
    for sl in slices or ():
        spec = sl.get("spec") or {}
        if spec.get("driver") != driver or not spec.get("nodeName"):
            continue
        node = spec["nodeName"]
        pool = (spec.get("pool") or {}).get("name", "")
        for dev in spec.get("devices") or []:
            attrs = dev.get("attributes") or {}
            raw = attrs.get(attr_name) if domain == driver else None
            raw = raw or attrs.get(attr)
            index = _int((raw or {}).get("int"))
            if index is None:
                continue
            where[(driver, pool, dev.get("name", ""))] = (node, index)
            per_node.setdefault(node, set()).add(index)
    allocated: dict[str, set[int]] = {}
    for claim in claims or ():
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
        for res in results.get("results") or []:
            key = (res.get("driver", ""), res.get("pool", ""), res.get("device", ""))
            if key in where:
                node, index = where[key]
                allocated.setdefault(node, set()).add(index)
    infos = []
    ready: dict[str, bool] = {}
    for n in nodes:
        meta = n.get("metadata") or {}
        name = meta.get("name", "")
        ready[name] = _ready(n)
        infos.append(
            NodeInfo(
                name=name,
                labels=dict(meta.get("labels") or {}),
                ready=ready[name],
                schedulable=not (n.get("spec") or {}).get("unschedulable", False),
                devices=frozenset(per_node[name])
                if slices is not None and name in per_node
                else (frozenset() if slices is not None else None),
                allocated=frozenset(allocated.get(name, set())),
            )
        )
    return tuple(infos), ready


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


async def fetch_state(
    http: aiohttp.ClientSession, ip: str, port: int, limit_s: float = STATE_TIMEOUT_S
) -> dict[str, Any] | None:
    """An engine's /state, or None (unknown) when it does not answer within ``limit_s``."""
    try:
        async with asyncio.timeout(limit_s):
            async with http.get(f"http://{ip}:{port}/state") as resp:
                if resp.status != 200:
                    return None
                data = await resp.json(content_type=None)
                return data if isinstance(data, dict) else None
    except (TimeoutError, aiohttp.ClientError, ValueError, OSError):
        return None


async def observe(
    dyn: Any,
    http: aiohttp.ClientSession,
    inst: GpuInstance,
    *,
    state_timeout: float = STATE_TIMEOUT_S,
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
    nodes_raw, slices, claims = await asyncio.gather(
        _list(dyn, "v1", "Node"),
        _list(dyn, "resource.k8s.io/v1", "ResourceSlice"),
        _list(dyn, "resource.k8s.io/v1", "ResourceClaim"),
    )
    nodes: tuple[NodeInfo, ...] = ()
    node_ready: dict[str, bool] | None = None
    if nodes_raw is not None:
        nodes, node_ready = node_infos(inst, nodes_raw, slices, claims)

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
    for p in owned:
        view = pod_view(p)
        views[view.name] = view
        ip = (p.get("status") or {}).get("podIP")
        if ip and view.phase == "Running" and not view.deleting:
            for i, name in enumerate(engines):
                probes.append(
                    (
                        view.name,
                        name,
                        fetch_state(http, ip, api.STATUS_PORT_BASE + i, state_timeout),
                    )
                )
    if probes:
        results = await asyncio.gather(*(c for _, _, c in probes))
        per_pod: dict[str, dict[str, EngineView]] = {}
        for (pod_name, engine, _), data in zip(probes, results, strict=True):
            per_pod.setdefault(pod_name, {})[engine] = engine_view(data)
        for pod_name, states in per_pod.items():
            v = views[pod_name]
            views[pod_name] = PodView(
                **{**{f: getattr(v, f) for f in PodView.__slots__}, "engines": states}
            )
    return Observed(pods=views, node_ready=node_ready, nodes=nodes, claim=claim)
