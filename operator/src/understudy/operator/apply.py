"""Carry out a :class:`~understudy.operator.view.Plan` with ``kubernetes.aio``.

Shell module, the only place that writes to the API (kopf's own annotation
and finalizer writes aside). Every step is idempotent: ensured objects are
server-side applied (field manager ``understudy-operator``), a pod that
already exists (409) or is already gone (404) is fine, and the status is a
merge patch **preconditioned on the resourceVersion** that was observed, so a
concurrent writer makes it fail with :class:`Conflict` instead of being
overwritten; the handler then retries the whole level-based pass.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from understudy.operator import api
from understudy.operator.api import GpuInstance
from understudy.operator.conditions import Reason
from understudy.operator.metrics import ACTIONS, RESIZES
from understudy.operator.view import Delete, EventSpec, LabelPatch, Plan, Resize
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.operator.apply")

FIELD_MANAGER = "understudy-operator"
AUTOSCALER_MANAGER = "understudy-autoscaler"  # owns spec.replicas.desired when enabled
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"  # containers merge by name


class Conflict(Exception):
    """The status changed since it was observed (HTTP 409)."""


def _status_code(exc: BaseException) -> int | None:
    code = getattr(exc, "status", None)
    return code if isinstance(code, int) else None


def _api_message(exc: BaseException) -> str:
    """What the API server said (its Status message), else the exception's first line."""
    body = getattr(exc, "body", None)
    try:
        message = json.loads(body)["message"] if body else None
    except (ValueError, TypeError, KeyError):
        message = None
    text = message if isinstance(message, str) else (str(exc).splitlines() or [""])[0]
    return text[:512]


async def _resource(dyn: Any, api_version: str, kind: str) -> Any:
    return await dyn.resources.get(api_version=api_version, kind=kind)


async def ensure(dyn: Any, obj: dict[str, Any]) -> None:
    res = await _resource(dyn, obj["apiVersion"], obj["kind"])
    meta = obj["metadata"]
    try:
        await dyn.server_side_apply(
            res,
            body=obj,
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )
    except Exception as exc:
        # An immutable spec that differs (a claim template): the plan deletes it.
        if _status_code(exc) != 422:
            raise
        log_event(log, "ensure_rejected", logging.WARNING, kind=obj["kind"], name=meta["name"])
        return
    ACTIONS.labels("ensure").inc()


async def create_pod(dyn: Any, pod: dict[str, Any]) -> None:
    res = await _resource(dyn, "v1", "Pod")
    try:
        await dyn.create(res, body=pod, namespace=pod["metadata"]["namespace"])
    except Exception as exc:
        if _status_code(exc) != 409:
            raise
        return
    ACTIONS.labels("create_pod").inc()
    log_event(log, "pod_created", name=pod["metadata"]["name"])


async def delete(dyn: Any, namespace: str, d: Delete) -> None:
    version = d.api_version or ("v1" if d.kind == "Pod" else "resource.k8s.io/v1")
    res = await _resource(dyn, version, d.kind)
    body: dict[str, Any] = {"propagationPolicy": "Background"}
    if d.grace_seconds is not None:
        body["gracePeriodSeconds"] = d.grace_seconds
    try:
        await dyn.delete(res, name=d.name, namespace=namespace, body=body)
    except Exception as exc:
        if _status_code(exc) != 404:
            raise
        return
    ACTIONS.labels("delete").inc()
    log_event(log, "deleted", kind=d.kind, name=d.name, reason=d.reason, grace=d.grace_seconds)


async def label(dyn: Any, namespace: str, patch: LabelPatch) -> None:
    res = await _resource(dyn, "v1", "Pod")
    body = {"metadata": {"labels": {patch.key: patch.value}}}
    try:
        await dyn.patch(res, body=body, name=patch.pod, namespace=namespace, content_type=MERGE)
    except Exception as exc:
        if _status_code(exc) != 404:
            raise
        return
    ACTIONS.labels("label").inc()


async def patch_status(
    dyn: Any, inst: GpuInstance, status: dict[str, Any] | None, resource_version: str | None
) -> dict[str, Any] | None:
    """Merge-patch the status, preconditioned on ``resource_version``; the new body.

    With ``status=None`` the patch carries only the precondition: a fence that
    fails (409) when the pass planned from a stale body, and changes nothing.
    """
    path = (
        f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{inst.metadata.namespace}"
        f"/{api.PLURAL}/{inst.metadata.name}/status"
    )
    body: dict[str, Any] = {}
    if status is not None:
        body["status"] = status
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    if not body:
        return None
    try:
        result = await dyn.request("patch", path, body=body, content_type=MERGE)
    except Exception as exc:
        if _status_code(exc) == 409:
            raise Conflict(str(exc)) from exc
        raise
    if status is not None:
        ACTIONS.labels("status").inc()
    new: dict[str, Any] | None = result.to_dict() if hasattr(result, "to_dict") else None
    return new


async def post_event(dyn: Any, inst: GpuInstance, ev: EventSpec) -> None:
    """A core/v1 Event about the GpuInstance (best effort: never fails the pass)."""
    now = datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{inst.metadata.name}.{uuid.uuid4().hex[:12]}",
            "namespace": inst.metadata.namespace,
        },
        "involvedObject": {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": inst.metadata.name,
            "namespace": inst.metadata.namespace,
            "uid": inst.metadata.uid,
        },
        "type": ev.type,
        "reason": str(ev.reason)[:128],
        "message": ev.message[:1024],
        "source": {"component": FIELD_MANAGER},
        "reportingComponent": FIELD_MANAGER,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        res = await _resource(dyn, "v1", "Event")
        await dyn.create(res, body=body, namespace=inst.metadata.namespace)
    except Exception as exc:  # Events are advisory
        log_event(log, "event_failed", logging.WARNING, reason=ev.reason, error=exc)


async def scale(dyn: Any, inst: GpuInstance, replicas: int) -> None:
    """The built-in autoscaler's decision: ``spec.replicas.desired`` (what /scale writes)."""
    res = await _resource(dyn, api.API_VERSION, api.KIND)
    body = {"spec": {"replicas": {"desired": replicas}}}
    await dyn.patch(
        res,
        body=body,
        name=inst.metadata.name,
        namespace=inst.metadata.namespace,
        content_type=MERGE,
        field_manager=AUTOSCALER_MANAGER,
    )
    ACTIONS.labels("scale").inc()
    log_event(log, "scaled", instance=inst.metadata.name, replicas=replicas)


# Resizes refused so far, by pod: what was asked and when (monotonic). A
# cluster that refuses them (in-place resize off, or Kubernetes 1.36 with DRA
# claims: docs/sizing.md) gets one Event per pod and request, and the same
# request again only after RESIZE_RETRY_S, not one per pass. Bounded: the
# oldest is forgotten first.
_REFUSED: dict[str, tuple[str, float]] = {}
_REFUSED_LIMIT = 1024
RESIZE_RETRY_S = 300.0


def _resize_message(r: Resize) -> str:
    shares = "; ".join(
        f"{name}{' (Active)' if name == r.active else ''} "
        + ", ".join(f"{k}={v}" for k, v in sorted(req.items()))
        for name, req in sorted(r.requests.items())
    )
    return f"pod {r.pod}: requests {shares}"


async def resize(dyn: Any, inst: GpuInstance, r: Resize) -> None:
    """Patch the pod's ``resize`` subresource; a refusal is logged, counted and an Event.

    It never fails the pass: the pod keeps serving with its old requests
    (the limits already let any engine serve), and the next pass asks again.
    """
    ns = inst.metadata.namespace
    path = f"/api/v1/namespaces/{ns}/pods/{r.pod}/resize"
    containers = [
        {"name": name, "resources": {"requests": dict(req)}} for name, req in r.requests.items()
    ]
    message = _resize_message(r)
    key = f"{ns}/{r.pod}"
    before = _REFUSED.get(key)
    recent = before is not None and time.monotonic() - before[1] < RESIZE_RETRY_S
    if before is not None and before[0] == message and recent:
        return  # refused a moment ago: the next pass after RESIZE_RETRY_S asks again
    try:
        await dyn.request(
            "patch", path, body={"spec": {"containers": containers}}, content_type=STRATEGIC
        )
    except Exception as exc:  # any refusal: the pod works on, with its old requests
        RESIZES.labels("refused").inc()
        said = _api_message(exc)
        code = _status_code(exc)
        log_event(log, "resize_refused", logging.WARNING, pod=r.pod, status=code, error=said)
        _REFUSED.pop(key, None)
        _REFUSED[key] = (message, time.monotonic())
        while len(_REFUSED) > _REFUSED_LIMIT:
            del _REFUSED[next(iter(_REFUSED))]
        if before is None or before[0] != message:
            why = f"{message}: refused ({code or type(exc).__name__}: {said})"
            await post_event(dyn, inst, EventSpec("Warning", Reason.RESIZE_REFUSED, why))
        return
    _REFUSED.pop(key, None)
    RESIZES.labels("done").inc()
    log_event(log, "resized", pod=r.pod, active=r.active)
    await post_event(dyn, inst, EventSpec("Normal", Reason.RESIZED, message))


def writes(plan: Plan) -> bool:
    return bool(
        plan.create_pods
        or plan.deletes
        or plan.labels
        or plan.status is not None
        or plan.scale is not None
        or plan.resizes
    )


async def apply(
    dyn: Any, inst: GpuInstance, plan: Plan, resource_version: str | None
) -> dict[str, Any] | None:
    """Carry the plan out; return the instance's new body when the status was written.

    The status patch (or, without a status change, a precondition-only patch)
    goes **first**: it fails with Conflict when this pass planned from a stale
    body (a pod event racing our own last write), and then nothing else is
    written. It also records the attempt of every pod created below, so a
    failure after it leaves no pod that a later pass would take for stale.
    """
    ns = inst.metadata.namespace
    new_body = None
    if writes(plan):
        new_body = await patch_status(dyn, inst, plan.status, resource_version)
    for d in plan.deletes:
        await delete(dyn, ns, d)
    for obj in plan.ensure:
        if any(d.kind == obj["kind"] and d.name == obj["metadata"]["name"] for d in plan.deletes):
            continue  # recreated on the next pass, once the old one is gone
        await ensure(dyn, obj)
    for pod in plan.create_pods:
        await create_pod(dyn, pod)
    for patch in plan.labels:
        await label(dyn, ns, patch)
    if plan.scale is not None:
        await scale(dyn, inst, plan.scale)
    for r in plan.resizes:
        await resize(dyn, inst, r)
    for ev in plan.events:
        log_event(
            log, "transition", instance=inst.metadata.name, reason=ev.reason, message=ev.message
        )
        await post_event(dyn, inst, ev)
    return new_body
