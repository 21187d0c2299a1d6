"""After a failover, the engine containers' requests follow the roles (pure).

A pod is rendered with its primary Active and its shadows standbys
(``resources.for_role``). A failover swaps the roles, not the containers, so
the container that now holds the Active engine reserves a standby's share
and the one whose engine died and re-armed reserves an Active's. This step
compares what each engine container requests with what its role calls for
and asks for an in-place resize (the pod's ``resize`` subresource) where
they differ. Nothing waits for it: the limits are the Active engine's in
every container, so the new Active serves at once, and the resize only makes
the node's books say so (docs/sizing.md).

Only a pod of the current spec whose Active engine is seen Active in this
pass is resized; a role read from the last status (an engine's ``/state``
did not answer) could shrink the engine that serves.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Iterable

from understudy.operator import lifecycle as lc
from understudy.operator import render, resources
from understudy.operator.api import ReplicaStatus
from understudy.operator.view import Context, PodView, Resize


def _active_seen(pod: PodView, active: str | None) -> bool:
    view = pod.engines.get(active) if active is not None else None
    return view is not None and (view.state or "").lower() == "active"


def resize_of(ctx: Context, st: ReplicaStatus) -> Resize | None:
    """The resize one replica's pod needs, or None (none, or not decidable now)."""
    pod = ctx.observed.pods.get(st.pod)
    if (
        pod is None
        or pod.deleting
        or pod.phase != "Running"
        or pod.spec_hash != ctx.want_hash
        or st.phase in lc.LEAVING
        or not _active_seen(pod, st.active_engine)
    ):
        return None
    spec = ctx.inst.spec
    want = {
        name: resources.role_requests(spec, active=name == st.active_engine)
        for name in render.engine_names(ctx.inst)
        if name in pod.requests
    }
    if all(resources.satisfied(pod.requests[n], w) for n, w in want.items()):
        return None
    assert st.active_engine is not None  # _active_seen
    return Resize(st.pod, st.active_engine, want)


def resizes(ctx: Context, statuses: Iterable[ReplicaStatus]) -> tuple[Resize, ...]:
    """Every replica pod whose engine containers' requests do not match their roles."""
    return tuple(r for st in statuses if (r := resize_of(ctx, st)) is not None)
