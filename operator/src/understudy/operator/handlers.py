"""The kopf handlers: thin, level-based, all feeding one reconcile pass.

create / update / resume / the timer on a GpuInstance, and every event of a
pod the operator owns, run the same pass: observe -> ``plan`` -> apply. No
logic depends on which event fired, so a missed or repeated event costs
nothing. Passes of one instance never overlap: a :class:`Coalescer` runs at
most one at a time per instance and, if anything asked for another
meanwhile, runs exactly one more with the newest body from the index. No
pass re-triggers itself: a pass that writes nothing generates no event, so
there is no hot loop; the timer is the slow safety net and the deadline clock
of the lifecycle (expiry is judged when a pass runs).

A plan may ask for another pass after a delay (``Plan.requeue_after``): a
replica draining out of the Service's endpoints (EndpointSlices are not
watched here), a phase deadline, or an autoscaled instance's next pressure
sample. :class:`Requeue` keeps at most one such wake-up per instance, the
earliest.

Placement reads the watch-based :class:`~understudy.operator.cache.ClusterCache`
of Nodes, ResourceSlices and ResourceClaims, started with the operator.

Failures map to kopf's vocabulary: a status conflict or an API error is a
``TemporaryError`` (retried with a delay), an invalid spec a
``PermanentError``. Deletion needs no cleanup outside the cluster: owner
references let the garbage collector remove pods, claims and the Service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from typing import Any

import aiohttp
import kopf
import pydantic

from understudy.operator import api
from understudy.operator.api import GpuInstance
from understudy.operator.apply import Conflict, apply
from understudy.operator.cache import ClusterCache
from understudy.operator.metrics import (
    AUTOSCALER_DECISIONS,
    AUTOSCALER_DESIRED,
    AUTOSCALER_PRESSURE,
    CACHE_EVENTS,
    PHASES,
    RECONCILE_DURATION,
    RECONCILE_ERRORS,
    TRANSITIONS,
    timed_select,
)
from understudy.operator.observe import observe
from understudy.operator.plan import plan
from understudy.operator.render import MANAGED_BY
from understudy.operator.settings import RESYNC_S, OperatorConfig, configure
from understudy.operator.view import Plan
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.operator")

Key = tuple[str, str]


class Coalescer:
    """At most one pass per key at a time; requests meanwhile collapse into one rerun."""

    def __init__(self) -> None:
        self._running: set[Hashable] = set()
        self._dirty: set[Hashable] = set()

    async def run(self, key: Hashable, fn: Callable[[], Awaitable[None]]) -> bool:
        """Run ``fn`` (and reruns); False when another pass took the request over."""
        if key in self._running:
            self._dirty.add(key)
            return False
        self._running.add(key)
        try:
            while True:
                self._dirty.discard(key)
                await fn()
                if key not in self._dirty:
                    return True
        finally:
            self._running.discard(key)
            self._dirty.discard(key)


class Requeue:
    """At most one delayed pass per key, at the earliest time any plan asked for."""

    MIN_DELAY_S = 0.5

    def __init__(self) -> None:
        self._handles: dict[Hashable, asyncio.TimerHandle] = {}
        self._due: dict[Hashable, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def after(
        self, key: Hashable, delay: float, fire: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        loop = asyncio.get_running_loop()
        delay = max(self.MIN_DELAY_S, delay)
        due = loop.time() + delay
        if key in self._due and self._due[key] <= due:
            return
        if key in self._handles:
            self._handles[key].cancel()
        self._due[key] = due
        self._handles[key] = loop.call_later(delay, self._fire, key, fire)

    def _fire(self, key: Hashable, fire: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._handles.pop(key, None)
        self._due.pop(key, None)
        task = asyncio.get_running_loop().create_task(fire())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()
        self._due.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    from kubernetes.aio import config as kconfig
    from kubernetes.aio.client import ApiClient
    from kubernetes.aio.dynamic import DynamicClient

    cfg: OperatorConfig = memo.get("config") or OperatorConfig()
    memo["config"] = cfg
    configure(settings, cfg)
    try:
        kconfig.load_incluster_config()  # type: ignore[no-untyped-call]
    except kconfig.ConfigException:
        await kconfig.load_kube_config()  # type: ignore[no-untyped-call]
    memo["api_client"] = ApiClient()
    memo["dyn"] = await DynamicClient(memo["api_client"])  # type: ignore[no-untyped-call]
    memo["http"] = aiohttp.ClientSession()
    memo["coalescer"] = Coalescer()
    memo["requeue"] = Requeue()
    cache = ClusterCache(memo["api_client"])
    cache.start()
    memo["cache"] = cache
    log_event(log, "operator_started", resync_s=RESYNC_S, image=cfg.render.image)


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    if "requeue" in memo:
        await memo["requeue"].close()
    if "cache" in memo:
        await memo["cache"].stop()
    if "http" in memo:
        await memo["http"].close()
    if "api_client" in memo:
        await memo["api_client"].close()


@kopf.index(api.GROUP, api.VERSION, api.PLURAL)
def gpuinstances(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Key, Any]:
    """The newest body of every GpuInstance, for passes started by pod events."""
    return {(namespace or "", name): dict(body)}


def _rv(body: Any) -> str | None:
    rv = (body.get("metadata") or {}).get("resourceVersion") if body else None
    return str(rv) if rv is not None else None


def _record(inst: GpuInstance, the_plan: Plan, memo: Any) -> None:
    """Metrics of one pass that the plan carries (the autoscaler's decision, the caches)."""
    decision = the_plan.autoscale
    ns, name = inst.metadata.namespace, inst.metadata.name
    if decision is not None:
        AUTOSCALER_DECISIONS.labels(str(decision.reason)).inc()
        AUTOSCALER_DESIRED.labels(ns, name).set(decision.desired)
        if decision.pressure is not None:
            AUTOSCALER_PRESSURE.labels(ns, name).set(decision.pressure)
    cache: ClusterCache | None = memo.get("cache")
    if cache is not None:
        for kind, informer in cache.informers.items():
            CACHE_EVENTS.labels(kind).set(informer.events)


async def _pass(body: Any, memo: Any, trigger: str, key: Key | None = None) -> Any:
    """One observe -> plan -> apply pass; returns the body after our own status write."""
    cfg: OperatorConfig = memo["config"]
    try:
        inst = GpuInstance.from_body(body)
    except pydantic.ValidationError as exc:
        RECONCILE_ERRORS.labels("invalid").inc()
        raise kopf.PermanentError(f"invalid GpuInstance: {exc}") from exc
    started = asyncio.get_running_loop().time()
    try:
        observed = await observe(
            memo["dyn"],
            memo["http"],
            inst,
            state_timeout=cfg.state_timeout_s,
            cache=memo.get("cache"),
        )
        # Wall-clock: the lifecycle's deadlines are persisted in status.
        the_plan = plan(inst, observed, time.time(), cfg.render, placer=timed_select)
        new_body = await apply(memo["dyn"], inst, the_plan, _rv(body))
        for ev in the_plan.events:
            TRANSITIONS.labels(trigger, str(ev.reason)).inc()
        _record(inst, the_plan, memo)
        if key is not None:
            PHASES.record(key, str((the_plan.status or {}).get("phase") or inst.status.phase))
        wait = the_plan.requeue_after
        if key is not None and wait is not None and wait < RESYNC_S:
            memo["requeue"].after(key, wait, lambda: _requeued(key, memo))
        return new_body or body
    except Conflict as exc:
        RECONCILE_ERRORS.labels("conflict").inc()
        raise kopf.TemporaryError("planned from a stale body; re-planning", delay=1) from exc
    except kopf.PermanentError:
        raise
    except Exception as exc:
        cause = "api" if hasattr(exc, "status") else "unexpected"
        RECONCILE_ERRORS.labels(cause).inc()
        raise kopf.TemporaryError(f"reconcile failed: {exc!r}", delay=5) from exc
    finally:
        RECONCILE_DURATION.labels(trigger).observe(asyncio.get_running_loop().time() - started)


async def _requeued(key: Key, memo: Any) -> None:
    """A delayed pass a plan asked for, from the newest body in the index."""
    index = memo.get("index")
    if index is None or key not in index:
        return
    current = next(iter(index[key]), None)
    if current is None or (current.get("metadata") or {}).get("deletionTimestamp"):
        return
    try:
        await reconcile(key, current, memo, "requeue", index)
    except kopf.TemporaryError as exc:
        log_event(log, "requeue_deferred", logging.DEBUG, instance=key[1], error=exc)


async def reconcile(key: Key, body: Any, memo: Any, trigger: str, index: Any = None) -> None:
    latest: list[Any] = [body]
    if index is not None:
        memo["index"] = index

    async def once() -> None:
        used = latest[0]
        after = await _pass(used, memo, trigger, key)
        # A rerun plans from the newest body: the index's, unless it has not yet
        # seen our own status write (then the body that write returned).
        fresh = next(iter(index[key]), None) if index is not None and key in index else None
        latest[0] = fresh if fresh is not None and _rv(fresh) not in (_rv(used), None) else after

    await memo["coalescer"].run(key, once)


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL, id="reconcile-resume")
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL, id="reconcile-create")
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, id="reconcile-update")
async def on_change(
    namespace: str | None, name: str, body: kopf.Body, memo: Any, reason: str, **kwargs: Any
) -> None:
    key = (namespace or "", name)
    await reconcile(key, dict(body), memo, str(reason), kwargs.get("gpuinstances"))


@kopf.timer(
    api.GROUP, api.VERSION, api.PLURAL, id="resync", interval=RESYNC_S, initial_delay=RESYNC_S
)
async def on_timer(
    namespace: str | None, name: str, body: kopf.Body, memo: Any, **kwargs: Any
) -> None:
    key = (namespace or "", name)
    await reconcile(key, dict(body), memo, "timer", kwargs.get("gpuinstances"))


@kopf.on.delete(api.GROUP, api.VERSION, api.PLURAL, optional=True)
async def on_delete(namespace: str | None, name: str, **_: Any) -> None:
    # Nothing outside the cluster to clean: owner references collect the children.
    PHASES.forget((namespace or "", name))
    log_event(log, "instance_deleted", namespace=namespace, name=name)


@kopf.on.event("", "v1", "pods", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
async def on_pod_event(namespace: str | None, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    """A pod changed: re-run its owner's pass (the routable label, status, lifecycle)."""
    index = kwargs.get("gpuinstances")
    if "coalescer" not in memo or index is None:
        return
    owner = next(
        (
            str(o.get("name"))
            for o in body.get("metadata", {}).get("ownerReferences") or []
            if o.get("kind") == api.KIND and o.get("apiVersion") == api.API_VERSION
        ),
        None,
    )
    if owner is None:
        return
    key = (namespace or "", owner)
    if key not in index:
        return
    current = next(iter(index[key]), None)
    if current is None or (current.get("metadata") or {}).get("deletionTimestamp"):
        return
    try:
        await reconcile(key, current, memo, "pod", index)
    except kopf.TemporaryError as exc:
        # The timer (or the next pod event) runs the pass again.
        log_event(log, "pod_pass_deferred", logging.DEBUG, instance=owner, error=exc)
