"""The ``GpuInstance`` API (``understudy.dev/v1alpha1``): one source of truth.

The pydantic models below are the spec and status. ``crd.py`` generates the
CRD's structural schema from them, including the defaults, enums, bounds and
the CEL ``x-kubernetes-validations`` attached here with :func:`cel`. A test
checks that the generated CRD equals the copies in ``manifests/`` and
``charts/``, so the schema and the model cannot drift.

Field names are snake_case in Python and camelCase on the wire (alias
generator); always dump with ``by_alias=True``.

Core module: no I/O imports.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from understudy.wire import engines

GROUP = "understudy.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GpuInstance"
PLURAL = "gpuinstances"
SINGULAR = "gpuinstance"
SHORT_NAMES = ("gi", "gpui")

# Ports fixed by docs/pod.md.
STATUS_PORT_BASE = 8100
LOCKSERVER_METRICS_PORT = 9101
GMS_METRICS_PORT = 9102
FRONT_STATUS_PORT = 8090  # the front's /live, /ready, /metrics, /pressure
MAX_SHADOWS = 4
MAX_GPUS = 16

DEFAULT_DEVICE_CLASS = "gpu.understudy.dev"

# Kubernetes' apiserver estimates the cost of every CEL rule from the maximum
# sizes of the lists and strings it touches; unbounded ones make a rule too
# expensive to admit. Every list and free string therefore has a bound.
_NAME = 253
_TEXT = 4096


def cel(
    rule: str, message: str, *, field_path: str | None = None, reason: str | None = None
) -> dict[str, str]:
    """One ``x-kubernetes-validations`` entry."""
    entry = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    if reason is not None:
        entry["reason"] = reason
    return entry


def _validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )


# A resource quantity as core/v1 spells it (the pattern of its OpenAPI
# schema): a wrong one is refused at admission with this pattern, not by the
# pod that would carry it minutes later.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = int | Annotated[str, Field(max_length=64, pattern=QUANTITY_PATTERN)]  # 1, "500m", "8Gi"


def _request_within_limit(requests: str, limits: str) -> str:
    """CEL: every quantity in ``requests`` is at most the one of the same name in ``limits``."""
    return (
        f"!has({requests}) || !has({limits}) || {requests}.all(k, !(k in {limits}) || "
        f"quantity(string({requests}[k])).compareTo(quantity(string({limits}[k]))) <= 0)"
    )


# --------------------------------------------------------------------- spec


# The adapter names are the pod contract's, defined once for every component.
EngineAdapter = engines.EngineAdapter


class GmsBackend(StrEnum):
    HOST = "host"
    CUDA = "cuda"


class PlacementStrategy(StrEnum):
    BINPACK = "binpack"
    SPREAD = "spread"


class ModelSpec(_Model):
    """What the engines serve."""

    source: str = Field(
        min_length=1,
        max_length=_TEXT,
        description=(
            "Model source passed to the engine as UNDERSTUDY_MODEL: `builtin:<name>`, a path "
            "in the container, or for the synthetic adapter a size such as `8GiB`."
        ),
    )
    path: str | None = Field(
        default=None,
        max_length=_TEXT,
        pattern=r"^/",
        description=(
            "Optional absolute directory on the node holding model files; mounted read-only "
            "at the same path in every engine container so that `source` may point into it."
        ),
    )


class ResourceRequirements(_Model):
    """CPU and memory of one container (the GPUs come from the DRA claim)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                _request_within_limit("self.requests", "self.limits"),
                "a resource request must not exceed its limit",
                field_path=".requests",
            )
        )
    )

    requests: dict[str, Quantity] = Field(
        default_factory=dict, max_length=8, description="Resource requests (cpu, memory, ...)."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, max_length=8, description="Resource limits (cpu, memory, ...)."
    )


class StandbyResources(_Model):
    """What a sleeping engine reserves: requests only (docs/sizing.md).

    Its limits are ``engine.resources.limits``, an Active engine's, so that a
    standby serves the moment it takes the lock; the operator then resizes
    the containers in place (the new Active's requests grow to
    ``engine.resources.requests``).
    """

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=8,
        description=(
            "Requests of each engine container that is not Active (cpu, memory, ...); a "
            "resource not named here takes the adapter's default (docs/sizing.md), never "
            "more than engine.resources.requests."
        ),
    )


class EngineSpec(_Model):
    """The inference engine run by every engine container."""

    adapter: EngineAdapter = Field(
        default=EngineAdapter.REFERENCE, description="Engine adapter of the shim."
    )
    image: str | None = Field(
        default=None,
        max_length=_TEXT,
        description="Engine image; defaults to the operator's component image.",
    )
    args: list[Annotated[str, Field(max_length=_TEXT)]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra adapter arguments (UNDERSTUDY_ENGINE_ARGS, a JSON list).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description=(
            "Requests of the Active engine's container, and limits of every engine "
            "container (a standby's requests are failover.standbyResources)."
        ),
    )


class DeviceSelector(_Model):
    cel: Annotated[str, Field(min_length=1, max_length=10240)] = Field(
        description=(
            "A DRA CEL device selector, e.g. "
            '`device.attributes["gpu.understudy.dev"].productName == "A100"`.'
        )
    )


class GpuSpec(_Model):
    """The devices every pod gets through one DRA claim shared by GMS and the engines."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                "!has(self.indices) || size(self.indices) == self.count",
                "gpus.indices must list exactly gpus.count device indices",
                field_path=".indices",
            ),
            cel(
                "!has(self.indices) || self.indices.all(i, self.indices.exists_one(j, j == i))",
                "gpus.indices must not repeat an index",
                field_path=".indices",
            ),
        )
    )

    count: int = Field(default=1, ge=1, le=MAX_GPUS, description="Devices per pod.")
    device_class_name: str = Field(
        default=DEFAULT_DEVICE_CLASS,
        min_length=1,
        max_length=_NAME,
        description="DRA DeviceClass of the devices (immutable).",
        json_schema_extra=_validations(cel("self == oldSelf", "gpus.deviceClassName is immutable")),
    )
    selectors: list[DeviceSelector] = Field(
        default_factory=list, max_length=8, description="Extra CEL device selectors."
    )
    exclusive: bool = Field(
        default=True,
        description=(
            "true: each pod gets its own claim (ResourceClaimTemplate), devices reserved for it. "
            "false: one ResourceClaim shared by every replica pod (immutable)."
        ),
        json_schema_extra=_validations(cel("self == oldSelf", "gpus.exclusive is immutable")),
    )
    indices: list[Annotated[int, Field(ge=0, le=1023)]] | None = Field(
        default=None,
        max_length=MAX_GPUS,
        description="Explicit device indices (the devices' index attribute), as many as count.",
    )
    index_attribute: str | None = Field(
        default=None,
        max_length=_NAME,
        pattern=r"^[a-z0-9.-]+/[A-Za-z0-9_]+$",
        description=(
            "Qualified device attribute holding the index, `<domain>/<name>`; "
            "defaults to `<deviceClassName>/index`."
        ),
    )


class GmsSpec(_Model):
    backend: GmsBackend = Field(
        default=GmsBackend.CUDA,
        description="GMS memory backend: `cuda` (CUDA VMM) or `host` (memfd, CPU clusters).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Requests and limits of the GMS sidecar."
    )


class FailoverSpec(_Model):
    enabled: bool = Field(default=True, description="Run shadow engines (hot standby).")
    shadows: int = Field(
        default=1, ge=1, le=MAX_SHADOWS, description="Shadow engines per pod when enabled."
    )
    wake_timeout_seconds: int = Field(
        default=60, ge=1, le=3600, description="Longest Waking phase."
    )
    remap_timeout_seconds: int = Field(
        default=30, ge=1, le=3600, description="GMS remap timeout on wake."
    )
    lock_reconnect_window_seconds: int = Field(
        default=10, ge=1, le=600, description="Lock server reconnect window after its restart."
    )
    startup_budget_seconds: int = Field(
        default=1800, ge=10, le=86400, description="Longest Init phase of an engine (model load)."
    )
    hold_seconds: int = Field(
        default=30,
        ge=1,
        le=600,
        description="How long the pod's front door holds a request while no engine is Active "
        "before answering 503 with Retry-After.",
    )
    migration_limit: int = Field(
        default=8,
        ge=0,
        le=16,
        description="How many times a request may move to the next Active engine after its "
        "engine died: the last guard, above poison isolation (docs/poison.md).",
    )
    hang_after_seconds: float = Field(
        default=1.0,
        ge=0.2,
        le=60,
        description="Heartbeat silence after which the front treats the Active engine as hung "
        "and kills it.",
    )
    standby_resources: StandbyResources = Field(
        default_factory=StandbyResources,
        description="Requests of each engine container that is not Active.",
    )


class Toleration(_Model):
    """A pod toleration (``core/v1``), copied into every replica pod."""

    key: str | None = Field(default=None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class PlacementSpec(_Model):
    target_node: str | None = Field(
        default=None, max_length=_NAME, description="Place every replica on this node."
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=16, description="Node labels a node must carry."
    )
    strategy: PlacementStrategy = Field(
        default=PlacementStrategy.SPREAD,
        description="binpack: fill the busiest fitting node; spread: the least busy.",
    )
    preferred_node_labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=16,
        description=(
            "Locality: node labels that make a node preferred (not required), e.g. a label "
            "a user puts on the nodes that hold the model's files."
        ),
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=16,
        description="Tolerations of the replica pods (GPU nodes are often tainted).",
    )


class ReplicasSpec(_Model):
    """min / desired / max replicas: an elastic pool.

    ``min`` pods always exist. ``desired`` (default ``min``) is the replica
    count: the ``scale`` subresource reads and writes it, so ``kubectl scale``,
    an HPA or KEDA move it, or the built-in autoscaler when
    ``autoscaling.enabled`` (then it owns the field). Without ``max`` the
    instance is fixed-size and ``desired <= min`` is a readiness threshold
    below ``min`` (start work when that many serve); with ``max`` it is
    elastic and the operator runs ``max(min, desired)`` pods.
    """

    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                "!has(self.max) || self.max >= self.min",
                "replicas.max must be at least replicas.min",
                field_path=".max",
            ),
            cel(
                "!has(self.desired) || self.desired <= (has(self.max) ? self.max : self.min)",
                "replicas.desired must be at most replicas.max (or replicas.min when max is unset)",
                field_path=".desired",
            ),
        )
    )

    min: int = Field(default=1, ge=1, le=64, description="Pods that always exist.")
    desired: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description=(
            "Replica count (the scale subresource's spec.replicas); default min. Below min "
            "it is the number of serving replicas that makes the instance Ready."
        ),
    )
    max: int | None = Field(default=None, ge=1, le=64, description="Upper bound when elastic.")

    @property
    def ready_threshold(self) -> int:
        """Serving replicas that make the instance Ready.

        ``desired`` below ``min`` is a partial-readiness threshold (as in Skyward);
        above ``min`` it is a count a scaler moved, and a scale-up must not
        make a serving instance un-Ready, so the threshold stays ``min``.
        """
        return min(self.min, self.desired if self.desired is not None else self.min)

    @property
    def target(self) -> int:
        desired = self.desired if self.desired is not None else self.min
        return max(self.min, desired)


class AutoscalingSpec(_Model):
    """The built-in autoscaler (``operator/autoscaler.py``): desired replicas from pressure.

    Pressure is what the front of every pod reports: requests being served
    plus requests held waiting for an Active engine. The recommendation is
    ``ceil(total pressure / targetPressure)`` within ``[replicas.min,
    replicas.max]``; it is stabilised like the HPA's: a scale-up takes the
    lowest recommendation of the last ``scaleUpStabilizationSeconds``, a
    scale-down the highest of the last ``scaleDownStabilizationSeconds``, so
    an idle instance returns to ``min`` one down-window after its load ends.
    """

    enabled: bool = Field(
        default=False,
        description=(
            "Run the built-in autoscaler; it then owns replicas.desired (point no HPA or KEDA "
            "at an instance with this on)."
        ),
    )
    target_pressure: int = Field(
        default=4,
        ge=1,
        le=100000,
        description="Requests in flight or held per replica that the autoscaler aims at.",
    )
    scale_up_stabilization_seconds: int = Field(
        default=0,
        ge=0,
        le=3600,
        description="Scale up to the lowest recommendation of this window.",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="Scale down to the highest recommendation of this window.",
    )


class RolloutSpec(_Model):
    """How a spec change replaces pods: surge first, like a Deployment's RollingUpdate."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            # has(): the apiserver also checks this rule against the bare
            # `default: {}` of the rollout object, before its fields default.
            cel(
                "(has(self.maxSurge) ? self.maxSurge : 1)"
                " + (has(self.maxUnavailable) ? self.maxUnavailable : 0) >= 1",
                "rollout.maxSurge and rollout.maxUnavailable cannot both be 0",
            ),
        )
    )

    max_surge: int = Field(
        default=1, ge=0, le=16, description="Replicas created above the count during a rollout."
    )
    max_unavailable: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Serving replicas a rollout may take away before their replacement serves.",
    )


class DrainSpec(_Model):
    """How a replica leaves (scale-down, rollout): unroute, wait, then a graceful delete."""

    timeout_seconds: int = Field(
        default=30,
        ge=1,
        le=600,
        description="Longest wait for the pod to leave the Service's endpoints.",
    )
    settle_seconds: int = Field(
        default=2,
        ge=0,
        le=60,
        description="Wait after it left them (kube-proxy catching up) before the delete.",
    )
    grace_period_seconds: int = Field(
        default=30,
        ge=6,
        le=3600,
        description=(
            "The pod's termination grace and that of the operator's delete: the front and "
            "the Active engine finish in-flight requests for 5 s less than this."
        ),
    )


class SecretKeyRef(_Model):
    """One key of a Secret in the instance's namespace."""

    name: str = Field(
        min_length=1,
        max_length=_NAME,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The Secret's name.",
    )
    key: str = Field(
        min_length=1,
        max_length=_NAME,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key whose value is the file.",
    )


class GatewaySpec(_Model):
    """The fleet gateway in front of the instance's pods (docs/gateway.md).

    Opt-in: without this section the instance renders no gateway and its
    Service selects the pods themselves; with it (``gateway: {}`` takes every
    default), clients reach the gateway's replicas through the instance's
    Service, and a stream whose pod dies continues on another pod.
    """

    replicas: int = Field(
        default=2,
        ge=1,
        le=16,
        description=(
            "Gateway replicas (a Deployment); two or more, so that one is left while "
            "another is rescheduled."
        ),
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Requests and limits of each gateway container.",
    )
    hold_seconds: int = Field(
        default=30,
        ge=1,
        le=600,
        description=(
            "How long a request (or a stream being moved) waits for a ready pod before "
            "the gateway answers 503 (its --hold)."
        ),
    )
    api_key_secret: SecretKeyRef | None = Field(
        default=None,
        description=(
            "A Secret key holding Bearer API keys, one per line, mounted into the gateway "
            "(its --api-key-file; a rotation takes effect without a restart). Unset: no "
            "key is asked for."
        ),
    )


class GpuInstanceSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                "self.servingPort < 8100 || self.servingPort > 8100 + self.failover.shadows",
                "servingPort collides with an engine status port (8100 + i)",
                field_path=".servingPort",
            ),
            cel(
                "self.servingPort != 9101 && self.servingPort != 9102",
                "servingPort collides with a sidecar metrics port (9101, 9102)",
                field_path=".servingPort",
            ),
            cel(
                "!has(self.gpus.indices) || self.replicas.min == 1 && !has(self.replicas.max)",
                "gpus.indices pins devices of one node: use it with a single replica",
                field_path=".gpus.indices",
            ),
            cel(
                "!self.autoscaling.enabled || has(self.replicas.max)",
                "autoscaling.enabled needs replicas.max",
                field_path=".autoscaling.enabled",
            ),
            # Every engine may become Active at once: a standby's requests fit
            # under the limits it shares with the Active engine.
            cel(
                _request_within_limit(
                    "self.failover.standbyResources.requests", "self.engine.resources.limits"
                ),
                "failover.standbyResources.requests must not exceed engine.resources.limits",
                field_path=".failover.standbyResources.requests",
            ),
        )
    )

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    gpus: GpuSpec = Field(default_factory=GpuSpec)
    gms: GmsSpec = Field(default_factory=GmsSpec)
    failover: FailoverSpec = Field(default_factory=FailoverSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    replicas: ReplicasSpec = Field(default_factory=ReplicasSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    drain: DrainSpec = Field(default_factory=DrainSpec)
    serving_port: int = Field(
        default=8000, ge=1024, le=65535, description="Port of the OpenAI-compatible API."
    )
    gateway: GatewaySpec | None = Field(
        default=None,
        description=(
            "The fleet gateway (docs/gateway.md): unset, none is rendered; `{}` gives "
            "every default."
        ),
    )

    @property
    def shadow_count(self) -> int:
        return self.failover.shadows if self.failover.enabled else 0


# ------------------------------------------------------------------- status


class Phase(StrEnum):
    """The instance's summary phase (a printer column)."""

    PENDING = "Pending"
    SCHEDULING = "Scheduling"
    STARTING = "Starting"
    RUNNING = "Running"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Model):
    """A ``metav1.Condition``."""

    type: str = Field(max_length=316)
    status: ConditionStatus
    observed_generation: int = Field(default=0, ge=0)
    last_transition_time: str = Field(
        max_length=64, description="RFC 3339 time of the last status flip."
    )
    reason: str = Field(max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)


class ReplicaPhase(StrEnum):
    """Lifecycle of one replica (lifecycle.py holds its transition table)."""

    PENDING = "Pending"
    SCHEDULED = "Scheduled"
    STARTING = "Starting"
    RUNNING = "Running"
    UNKNOWN = "Unknown"
    FAILED = "Failed"
    DRAINING = "Draining"  # leaving: unrouted, waiting to be out of the Service's endpoints
    TERMINATING = "Terminating"


class HistoryEntry(_Model):
    time: str = Field(max_length=64)
    replica: int = Field(ge=0)
    attempt: int = Field(ge=0)
    handler: str = Field(max_length=64)
    result: str = Field(max_length=32)
    message: str = Field(default="", max_length=1024)


class ReplicaStatus(_Model):
    index: int = Field(ge=0)
    pod: str = Field(max_length=_NAME)
    phase: ReplicaPhase = ReplicaPhase.PENDING
    phase_since: str = Field(
        default="", max_length=64, description="RFC 3339 time the phase began."
    )
    attempt: int = Field(
        default=0, ge=0, description="Placements so far; pods of older attempts are stale."
    )
    retries: int = Field(default=0, ge=0, description="Failures reported in the current phase.")
    node: str | None = Field(default=None, max_length=_NAME)
    active_engine: str | None = Field(default=None, max_length=_NAME)
    epoch: int | None = Field(default=None, ge=0, description="Lock epoch of the active engine.")
    routable: bool = False
    standby_ready: bool = False
    failovers: int = Field(default=0, ge=0)
    updated: bool = Field(
        default=True, description="The pod has the current spec (or has yet to be created)."
    )
    pressure: int | None = Field(
        default=None, ge=0, description="Requests in flight or held (the front's /pressure)."
    )
    unrouted_since: str | None = Field(
        default=None,
        max_length=64,
        description="Draining: RFC 3339 time the pod was first seen out of the endpoints.",
    )


class Recommendation(_Model):
    """Raw recommendations from ``time`` on: between ``low`` and ``high`` (equal unless merged)."""

    time: str = Field(max_length=64)
    low: int = Field(ge=0)
    high: int = Field(ge=0)


class AutoscalerStatus(_Model):
    """The built-in autoscaler's last decision and the window it decided from."""

    desired_replicas: int = Field(
        ge=0, description="What it decided (written to replicas.desired)."
    )
    pressure: int | None = Field(default=None, ge=0, description="Total pressure observed.")
    reason: str = Field(max_length=64)
    message: str = Field(default="", max_length=1024)
    last_scale_time: str | None = Field(default=None, max_length=64)
    recommendations: list[Recommendation] = Field(
        default_factory=list,
        max_length=64,
        description="Raw recommendations (only changes) inside the longest window.",
    )


class GpuInstanceStatus(_Model):
    phase: Phase = Phase.PENDING
    observed_generation: int = Field(default=0, ge=0)
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    attempt: int = Field(default=0, ge=0, description="Sum of placement attempts over replicas.")
    replicas: list[ReplicaStatus] = Field(default_factory=list, max_length=64)
    ready_replicas: int = Field(default=0, ge=0)
    current_replicas: int = Field(
        default=0, ge=0, description="Replicas that exist and are not leaving (scale: status)."
    )
    updated_replicas: int = Field(default=0, ge=0, description="Replicas with the current spec.")
    selector: str = Field(
        default="", max_length=_TEXT, description="Label selector of the pods (scale: selector)."
    )
    autoscaler: AutoscalerStatus | None = None
    active: str = Field(
        default="0/0", max_length=32, description="Replicas with an Active engine / target."
    )
    failovers: int = Field(default=0, ge=0)
    last_failover_time: str | None = Field(default=None, max_length=64)
    last_failover_duration_seconds: float | None = Field(default=None, ge=0)
    history: list[HistoryEntry] = Field(default_factory=list, max_length=32)


class ObjectMeta(BaseModel):
    """The subset of metadata the operator reads (extra keys allowed)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0
    labels: dict[str, str] = Field(default_factory=dict)


class GpuInstance(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    api_version: Literal["understudy.dev/v1alpha1"] = Field(
        default="understudy.dev/v1alpha1", alias="apiVersion"
    )
    kind: Literal["GpuInstance"] = "GpuInstance"
    metadata: ObjectMeta
    spec: GpuInstanceSpec
    status: GpuInstanceStatus = Field(default_factory=GpuInstanceStatus)

    @classmethod
    def from_body(cls, body: Any) -> GpuInstance:
        """From a raw API body (extra metadata kept, unknown top-level keys dropped)."""
        data = dict(body)
        keep = {
            k: data[k] for k in ("apiVersion", "kind", "metadata", "spec", "status") if k in data
        }
        meta = dict(keep.get("metadata") or {})
        keep["metadata"] = meta
        if keep.get("status") is None:
            keep.pop("status", None)
        else:
            status = {k: v for k, v in dict(keep["status"]).items() if k in _STATUS_KEYS}
            keep["status"] = status
        return cls.model_validate(keep)


_STATUS_KEYS = frozenset(f.alias or n for n, f in GpuInstanceStatus.model_fields.items())
