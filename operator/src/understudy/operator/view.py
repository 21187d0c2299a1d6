"""What a reconcile pass sees and what it asks for: the planner's types (pure).

``observe.py`` builds an :class:`Observed`; ``plan.plan`` turns it into a
:class:`Plan`; ``apply.py`` carries the plan out. Every step of the planner
(``checks``, ``membership``, ``status``) reads one :class:`Context`.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from understudy.operator import autoscaler as autoscale_core
from understudy.operator import lifecycle as lc
from understudy.operator import render
from understudy.operator.api import GpuInstance
from understudy.operator.scheduler import NodeInfo, Placement, Request, select

# ---------------------------------------------------------------- observed


@dataclass(frozen=True, slots=True)
class ContainerView:
    name: str
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    waiting_reason: str | None = None


@dataclass(frozen=True, slots=True)
class EngineView:
    """An engine's ``/state`` JSON; every field None when unreachable (unknown)."""

    role: str | None = None
    state: str | None = None
    epoch: int | None = None
    granted_at: float | None = None
    active_at: float | None = None
    # When the previous holder let go of the lock (the lock server's word,
    # carried in the grant): the start of the failover, detection included.
    released_at: float | None = None


@dataclass(frozen=True, slots=True)
class Pressure:
    """The front's ``/pressure``: requests being served and requests held."""

    inflight: int = 0
    held: int = 0
    active: bool = False

    @property
    def total(self) -> int:
        return self.inflight + self.held


@dataclass(frozen=True, slots=True)
class PodView:
    name: str
    index: int | None
    attempt: int | None
    spec_hash: str | None
    phase: str = "Pending"  # the pod's status.phase
    node: str | None = None
    deleting: bool = False
    unschedulable: str | None = None  # PodScheduled=False message
    routable_label: str | None = None
    ready: bool = False  # the pod's Ready condition: every container ready
    front_ready: bool = False
    containers: tuple[ContainerView, ...] = ()
    engines: Mapping[str, EngineView] = field(default_factory=dict)
    pressure: Pressure | None = None  # None: unknown (not read, or no answer)
    # Each container's requests in the pod's spec (what a resize last asked for).
    requests: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Observed:
    pods: Mapping[str, PodView] = field(default_factory=dict)
    # Node name -> Ready; None when nodes cannot be read (then never "lost").
    node_ready: Mapping[str, bool] | None = None
    nodes: tuple[NodeInfo, ...] = ()  # placement candidates (empty: kube-scheduler decides)
    claim: Mapping[str, Any] | None = None  # the existing claim (template), if any
    # Pods listed in the EndpointSlices of the Service over them (the pods'
    # headless Service with a gateway, else the client Service); None when
    # they cannot be read.
    endpoints: frozenset[str] | None = None
    # Whether the gateway's Deployment exists; None when not read (an
    # instance with a gateway section) or unreadable.
    gateway: bool | None = None


# -------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class Delete:
    kind: str
    name: str
    reason: str
    grace_seconds: int | None = None  # 0: force (the pod's node is gone)
    api_version: str | None = None  # None: v1 for a Pod, resource.k8s.io/v1 for a claim


@dataclass(frozen=True, slots=True)
class LabelPatch:
    pod: str
    key: str
    value: str


@dataclass(frozen=True, slots=True)
class Resize:
    """Move the engine containers' requests in place (the pod's ``resize`` subresource).

    All of one pod's containers in one patch: the new Active grows while the
    old one shrinks, so the pod's total, which the node already holds, stays
    the same and the kubelet can admit it at once.
    """

    pod: str
    active: str  # the Active engine's container
    requests: Mapping[str, Mapping[str, str]]  # container -> its requests


@dataclass(frozen=True, slots=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Plan:
    ensure: tuple[dict[str, Any], ...] = ()  # create if absent (Service: also patch)
    create_pods: tuple[dict[str, Any], ...] = ()
    deletes: tuple[Delete, ...] = ()
    labels: tuple[LabelPatch, ...] = ()
    status: dict[str, Any] | None = None  # full new status, None when unchanged
    events: tuple[EventSpec, ...] = ()
    requeue_after: float | None = None
    scale: int | None = None  # write spec.replicas.desired (the built-in autoscaler)
    resizes: tuple[Resize, ...] = ()
    autoscale: autoscale_core.Decision | None = None  # for the shell's metrics


# ------------------------------------------------------------------- a pass

Placer = Callable[[Request, Sequence[NodeInfo]], Placement]


@dataclass(frozen=True, slots=True)
class Context:
    """What every step of one pass reads."""

    inst: GpuInstance
    observed: Observed
    now: float
    cfg: render.RenderConfig
    policy: lc.Policy
    want_hash: str
    placer: Placer = select

    def pod(self, index: int) -> PodView | None:
        return self.observed.pods.get(render.pod_name(self.inst, index))

    def current_pod(self, rec: lc.Replica) -> PodView | None:
        """The replica's pod of its current attempt, unless it is being deleted."""
        pod = self.pod(rec.index)
        if pod is None or pod.attempt != rec.attempt or pod.deleting:
            return None
        return pod

    def node_lost(self, pod: PodView) -> bool:
        """The pod's node is known to be NotReady or gone (unreadable nodes: never lost)."""
        ready = self.observed.node_ready
        if ready is None or pod.node is None:
            return False
        return not ready.get(pod.node, False)

    def in_endpoints(self, pod: PodView) -> bool | None:
        """Whether the Service's EndpointSlices list the pod; None when unknown."""
        if self.observed.endpoints is None:
            return None
        return pod.name in self.observed.endpoints
