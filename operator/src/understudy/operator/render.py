"""Rendering: a GpuInstance becomes the objects of docs/pod.md (pure).

``render_pod`` is the pod contract of docs/pod.md, container by container;
``render_claim`` the DRA claim (a ``ResourceClaimTemplate`` for exclusive
devices, one shared ``ResourceClaim`` otherwise) that GMS and every engine
reference; ``render_service`` the Service of the readiness-trap design
(``publishNotReadyAddresses`` plus the ``understudy.dev/routable`` selector).
Every object is a plain dict carrying an owner reference to the GpuInstance.
``docs/operator.md`` explains the design.

Core module: no I/O imports.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from understudy.operator import api, resources
from understudy.operator.api import EngineAdapter, GpuInstance
from understudy.wire.serving import SERVING_PORT_NAME, STATUS_PORT_NAME

PREFIX = "understudy.dev"
LABEL_INSTANCE = f"{PREFIX}/instance"
LABEL_REPLICA = f"{PREFIX}/replica"
LABEL_ROUTABLE = f"{PREFIX}/routable"
ANNOTATION_ATTEMPT = f"{PREFIX}/attempt"
ANNOTATION_SPEC_HASH = f"{PREFIX}/spec-hash"
# Every container port whose name is here serves Prometheus /metrics (the
# chart's PodMonitor lists them; docs/monitoring-kubernetes.md): the lock
# server, GMS, the front's status port and each engine's status port.
METRICS_PORT_NAMES = ("lock-metrics", "gms-metrics", "front-status")
MANAGED_BY = "understudy-operator"

RUN_DIR = "/run/understudy"
LOCK_SOCKET = f"{RUN_DIR}/lock.sock"
LOCK_STATE = f"{RUN_DIR}/lock.state"
GMS_SOCKET_DIR = f"{RUN_DIR}/gms"
CLAIM_NAME = "gpus"  # the pod-level name of the DRA claim
RUN_UID = 65532

LOCKSERVER = "lockserver"
GMS = "gms"
FRONT = "front"
PRIMARY = "engine-primary"


def shadow_name(k: int) -> str:
    return f"engine-shadow-{k}"


@dataclass(frozen=True, slots=True)
class RenderConfig:
    """Operator-level settings the rendering needs (not part of the spec)."""

    image: str = "localhost/understudy:dev"  # the one component image
    image_pull_policy: str = "IfNotPresent"
    # Probe timings of docs/pod.md; the startup probe's failureThreshold is
    # derived from the startup budget.
    engine_startup_period_s: int = 2


def drain_seconds(inst: GpuInstance) -> int:
    """How long the front and an Active engine finish in-flight work after SIGTERM.

    ``drain.gracePeriodSeconds`` is the pod's grace (and the operator's delete
    uses it); the drains end 5 s before it so that they exit on their own
    rather than by SIGKILL.
    """
    return max(1, inst.spec.drain.grace_period_seconds - 5)


def pod_name(inst: GpuInstance, index: int) -> str:
    return f"{inst.metadata.name}-{index}"


def claim_name(inst: GpuInstance) -> str:
    return f"{inst.metadata.name}-gpus"


def service_name(inst: GpuInstance) -> str:
    return inst.metadata.name


def engine_names(inst: GpuInstance) -> list[str]:
    return [PRIMARY, *(shadow_name(k) for k in range(1, inst.spec.shadow_count + 1))]


def status_port(i: int) -> int:
    return api.STATUS_PORT_BASE + i


def owner_reference(inst: GpuInstance) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": inst.metadata.name,
        "uid": inst.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def common_labels(inst: GpuInstance, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "understudy",
        "app.kubernetes.io/instance": inst.metadata.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_INSTANCE: inst.metadata.name,
    }


def _meta(inst: GpuInstance, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": inst.metadata.namespace,
        "labels": common_labels(inst, component),
        "ownerReferences": [owner_reference(inst)],
    }


def devices_arg(inst: GpuInstance) -> str:
    return ",".join(str(d) for d in range(inst.spec.gpus.count))


def _container_security(*, read_only_root: bool) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_UID,
        "runAsGroup": RUN_UID,
        "fsGroup": RUN_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _port(name: str, number: int) -> dict[str, Any]:
    """A container port."""
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def _resources(
    req: api.ResourceRequirements, *, defaults: Mapping[str, str], claim: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": {**defaults, **req.requests}}
    if req.limits:
        out["limits"] = dict(req.limits)
    if claim:
        out["claims"] = [{"name": CLAIM_NAME}]
    return out


def _mounts(inst: GpuInstance, *, model: bool) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "run", "mountPath": RUN_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if model and inst.spec.model.path is not None:
        mounts.append({"name": "model", "mountPath": inst.spec.model.path, "readOnly": True})
    return mounts


def _exec(*argv: str) -> dict[str, Any]:
    return {"exec": {"command": list(argv)}}


def lockserver_container(inst: GpuInstance, cfg: RenderConfig) -> dict[str, Any]:
    window = inst.spec.failover.lock_reconnect_window_seconds
    return {
        "name": LOCKSERVER,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "restartPolicy": "Always",
        # Under the respawner, as every process of the pod: a lock server
        # that dies is back at once, not after kubelet's back-off, within the
        # reconnect window in which its holder resumes its grant. Through a
        # back-off (10 s, then 20 s, 40 s …) the holder's wait runs out and a
        # healthy Active engine gives up the lock.
        "command": ["understudy"],
        "args": [
            "respawn",
            "--",
            "understudy",
            "lockserver",
            "serve",
            "--socket",
            LOCK_SOCKET,
            "--state-file",
            LOCK_STATE,
            "--reconnect-window",
            str(window),
            "--metrics-port",
            str(api.LOCKSERVER_METRICS_PORT),
            # It keeps the serving socket and hands it to each front that
            # starts: a front's death refuses no connection (docs/pod.md).
            "--serving-port",
            str(inst.spec.serving_port),
            # Host memory: the next engine needs nothing of the dead one's
            # freed, so the lock goes at its death, not ~0.1 s later at its
            # connection's close. A GPU is free only once the process is gone.
            *(["--grant-at-death"] if inst.spec.gms.backend is api.GmsBackend.HOST else []),
        ],
        "ports": [
            {
                "name": "lock-metrics",
                "containerPort": api.LOCKSERVER_METRICS_PORT,
                "protocol": "TCP",
            }
        ],
        "startupProbe": {
            **_exec("understudy", "lock", "status", "--socket", LOCK_SOCKET, "--timeout", "1"),
            "periodSeconds": 1,
            "timeoutSeconds": 2,
            "failureThreshold": 60,
        },
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": _mounts(inst, model=False),
    }


def gms_container(inst: GpuInstance, cfg: RenderConfig) -> dict[str, Any]:
    devices = devices_arg(inst)
    return {
        "name": GMS,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "restartPolicy": "Always",
        # Under the respawner too: a GMS that dies is back at once, without
        # kubelet's back-off, and the Active engine gives it the weights back
        # (docs/pod.md, GMS re-adoption).
        "command": ["understudy"],
        "args": [
            "respawn",
            "--",
            "understudy",
            "gms",
            "serve",
            "--socket-dir",
            GMS_SOCKET_DIR,
            "--devices",
            devices,
            "--backend",
            inst.spec.gms.backend.value,
            "--metrics-port",
            str(api.GMS_METRICS_PORT),
        ],
        "ports": [
            {"name": "gms-metrics", "containerPort": api.GMS_METRICS_PORT, "protocol": "TCP"}
        ],
        "startupProbe": {
            **_exec(
                "understudy",
                "gms",
                "wait-ready",
                "--socket-dir",
                GMS_SOCKET_DIR,
                "--devices",
                devices,
                "--timeout",
                "1",
            ),
            "periodSeconds": 1,
            "timeoutSeconds": 2,
            "failureThreshold": 120,
        },
        "resources": _resources(
            inst.spec.gms.resources, defaults={"cpu": "50m", "memory": "64Mi"}, claim=True
        ),
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": _mounts(inst, model=False),
    }


def front_container(inst: GpuInstance, cfg: RenderConfig) -> dict[str, Any]:
    """The pod's front door: it serves the pod's port for the pod's whole life.

    Under the respawner, which restarts it in place at once (kubelet's
    CrashLoopBackOff would cost the second death in ten minutes 10 s) from a
    spare that has already paid Python's start and the imports, and as
    ``python -m understudy.front``: the dispatcher's entry-point scan is time
    that connections wait in the lock server's queue."""
    f = inst.spec.failover

    def http(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": api.FRONT_STATUS_PORT, "scheme": "HTTP"}}

    return {
        "name": FRONT,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "restartPolicy": "Always",
        "command": ["understudy"],
        "args": [
            "respawn",
            "--spare",
            # The spare at once: a front's start is the whole time new
            # connections wait, and a front dies alone (no failover runs
            # beside it for the spare's imports to slow down).
            "--spare-after",
            "0",
            # The status port is the respawner's, bound once: kubelet's probes
            # sent while the next front starts wait in its queue. A front that
            # bound it itself left it refusing in the gap, and failed its start
            # (EADDRINUSE) while the dead one's witness still held the old
            # listener: three failed liveness probes, a container restart.
            "--listen",
            f"status=0.0.0.0:{api.FRONT_STATUS_PORT}",
            "--",
            "python",
            "-m",
            "understudy.front",
            "serve",
            "--run-dir",
            RUN_DIR,
            "--port",
            str(inst.spec.serving_port),
            "--status-port",
            str(api.FRONT_STATUS_PORT),
            "--hold",
            str(f.hold_seconds),
            "--migration-limit",
            str(f.migration_limit),
            "--hang-after",
            f"{f.hang_after_seconds:g}",
            "--drain",
            str(drain_seconds(inst)),
        ],
        "ports": [
            _port(SERVING_PORT_NAME, inst.spec.serving_port),
            _port(STATUS_PORT_NAME, api.FRONT_STATUS_PORT),
        ],
        "startupProbe": {**http("/live"), "periodSeconds": 1, "failureThreshold": 30},
        "livenessProbe": {**http("/live"), "periodSeconds": 2, "failureThreshold": 3},
        # docs/pod.md, the readiness trap: ready while the front can serve (an
        # Active engine, or a failover within the hold). The operator copies
        # it into the understudy.dev/routable label.
        "readinessProbe": {
            **http("/ready"),
            "periodSeconds": 1,
            "timeoutSeconds": 1,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": _mounts(inst, model=False),
    }


def engine_env(inst: GpuInstance, name: str, i: int) -> list[dict[str, Any]]:
    s = inst.spec
    values = {
        "ENGINE_ROLE": "primary" if i == 0 else "shadow",
        "UNDERSTUDY_ENGINE_NAME": name,
        "UNDERSTUDY_RUN_DIR": RUN_DIR,
        "UNDERSTUDY_LOCK_SOCKET": LOCK_SOCKET,
        "UNDERSTUDY_GMS_SOCKET_DIR": GMS_SOCKET_DIR,
        "UNDERSTUDY_GMS_BACKEND": s.gms.backend.value,
        "UNDERSTUDY_DEVICES": devices_arg(inst),
        "UNDERSTUDY_ENGINE_ADAPTER": s.engine.adapter.value,
        "UNDERSTUDY_MODEL": s.model.source,
        "UNDERSTUDY_ENGINE_ARGS": json.dumps(list(s.engine.args)),
        "UNDERSTUDY_STATUS_PORT": str(status_port(i)),
        "UNDERSTUDY_STARTUP_BUDGET_S": str(s.failover.startup_budget_seconds),
        "UNDERSTUDY_WAKE_TIMEOUT_S": str(s.failover.wake_timeout_seconds),
        "UNDERSTUDY_REMAP_TIMEOUT_S": str(s.failover.remap_timeout_seconds),
        # The client waits longer than the server's reconnect window, so a
        # restarted lock server still sees its holder come back.
        "UNDERSTUDY_LOCK_RECONNECT_S": str(s.failover.lock_reconnect_window_seconds + 5),
        # One BLAS thread: answers stay bit-identical across engines and nodes.
        "OPENBLAS_NUM_THREADS": "1",
        # SIGTERM drains an Active engine this long, within the pod's grace.
        "UNDERSTUDY_DRAIN_S": str(drain_seconds(inst)),
    }
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in values.items()]
    env += [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    return env


def engine_container(inst: GpuInstance, cfg: RenderConfig, i: int) -> dict[str, Any]:
    name = PRIMARY if i == 0 else shadow_name(i)
    port = status_port(i)
    budget = inst.spec.failover.startup_budget_seconds
    period = cfg.engine_startup_period_s

    def http(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": port, "scheme": "HTTP"}}

    # vLLM writes caches (torch compile, triton) under $HOME; the CPU adapters don't.
    read_only = inst.spec.engine.adapter is not EngineAdapter.VLLM
    return {
        "name": name,
        "image": inst.spec.engine.image or cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        # The respawner restarts a dead engine in place at once, without
        # kubelet's CrashLoopBackOff, from a spare that has done its imports;
        # an engine that cannot start is backed off and then handed to
        # kubelet. It holds the status port, so the probes never find it
        # closed while the engine restarts (docs/pod.md, re-arm on a stock
        # kubelet).
        "command": ["understudy"],
        "args": [
            "respawn",
            "--spare",
            "--listen",
            f"status=0.0.0.0:{port}",
            "--",
            "understudy",
            "engine",
            "run",
        ],
        "env": engine_env(inst, name, i),
        # No serving port: the front owns it; an engine listens on a Unix socket
        # in the pod's run directory, and only while Active.
        "ports": [{"name": f"status-{i}", "containerPort": port, "protocol": "TCP"}],
        "startupProbe": {
            **http("/startup"),
            "periodSeconds": period,
            "timeoutSeconds": 2,
            "failureThreshold": max(1, math.ceil(budget / period)),
        },
        # The front kills a hung Active engine within its hang limit (1 s); this
        # probe is the backstop (a hung standby, a front that is down): a hung
        # engine keeps its lock connection open until its process ends. A 1 s
        # grace instead of the pod's 30 s: a stopped process never acts on SIGTERM.
        # Five failures, not three: the probe's kill is a container restart,
        # which meets kubelet's back-off (10 s, 20 s, ...), and it must not win
        # the race with the front's, which costs a restart in place; on a busy
        # node the front took up to 1.5 s, and a probe times out per second.
        "livenessProbe": {
            **http("/live"),
            "periodSeconds": 1,
            "timeoutSeconds": 1,
            "failureThreshold": 5,
            "terminationGracePeriodSeconds": 1,
        },
        "readinessProbe": {
            **http("/ready"),
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
        # The primary is rendered Active and the shadows standbys; after a
        # failover the operator resizes them in place (resize.py).
        "resources": _resources(
            resources.for_role(inst.spec, active=i == 0), defaults={}, claim=True
        ),
        "securityContext": _container_security(read_only_root=read_only),
        "volumeMounts": _mounts(inst, model=True),
    }


def _volumes(inst: GpuInstance) -> list[dict[str, Any]]:
    vols: list[dict[str, Any]] = [
        # Survives container restarts within the pod: the lock state file
        # (a restarted lock server reads its holder from it) and the sockets
        # live here.
        # medium Memory: tmpfs makes the state file's fsync, which every grant
        # waits for, cost microseconds (docs/pod.md).
        {"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    if inst.spec.model.path is not None:
        vols.append(
            {"name": "model", "hostPath": {"path": inst.spec.model.path, "type": "Directory"}}
        )
    return vols


def _pod_claim(inst: GpuInstance) -> dict[str, str]:
    if inst.spec.gpus.exclusive:
        return {"name": CLAIM_NAME, "resourceClaimTemplateName": claim_name(inst)}
    return {"name": CLAIM_NAME, "resourceClaimName": claim_name(inst)}


def pod_spec(inst: GpuInstance, cfg: RenderConfig) -> dict[str, Any]:
    """The pod spec without placement: what the spec hash covers."""
    spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": inst.spec.drain.grace_period_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        # One process namespace for the pod: the front can end a hung engine
        # (its death is the fence that hands the lock on), and no engine runs
        # as PID 1, whom the kernel shields from signals it has no handler
        # for (a SIGSEGV sent from the node would otherwise be ignored).
        "shareProcessNamespace": True,
        "resourceClaims": [_pod_claim(inst)],
        "initContainers": [
            lockserver_container(inst, cfg),
            gms_container(inst, cfg),
            front_container(inst, cfg),
        ],
        "containers": [engine_container(inst, cfg, i) for i in range(inst.spec.shadow_count + 1)],
        "volumes": _volumes(inst),
    }
    if inst.spec.placement.node_selector:
        spec["nodeSelector"] = dict(inst.spec.placement.node_selector)
    if inst.spec.placement.tolerations:
        spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in inst.spec.placement.tolerations
        ]
    return spec


def spec_hash(inst: GpuInstance, cfg: RenderConfig) -> str:
    """Changes exactly when the rendered pod (minus placement) changes."""
    blob = json.dumps(pod_spec(inst, cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def scrape_annotations() -> dict[str, str]:
    """The ``prometheus.io/*`` convention of plain Prometheus: one port per pod.

    The pod serves metrics on several ports (``METRICS_PORT_NAMES`` and every
    engine's ``status-N``); the convention names one, so it names the lock
    server's: it sees both ends of every handover and outlives the engines, so
    its counters (grants, epoch, handover time) are the failover record. The
    PodMonitor, and the scrape config of docs/monitoring-kubernetes.md, take
    every metrics port by name.
    """
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(api.LOCKSERVER_METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }


def render_pod(
    inst: GpuInstance, index: int, attempt: int, node: str | None, cfg: RenderConfig
) -> dict[str, Any]:
    """Replica ``index`` of placement ``attempt``; ``node`` narrows kube-scheduler's choice.

    Placement is node affinity, not ``nodeName``: a pod with ``nodeName`` skips
    kube-scheduler, and with it the DRA allocation of its claim.
    """
    meta = _meta(inst, pod_name(inst, index), "engine-pod")
    meta["labels"][LABEL_REPLICA] = str(index)
    meta["labels"][LABEL_ROUTABLE] = "false"  # the operator sets it from the front's readiness
    meta["annotations"] = {
        ANNOTATION_ATTEMPT: str(attempt),
        ANNOTATION_SPEC_HASH: spec_hash(inst, cfg),
        **scrape_annotations(),
    }
    spec = pod_spec(inst, cfg)
    if node is not None:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _selectors(inst: GpuInstance) -> list[dict[str, Any]]:
    g = inst.spec.gpus
    out = [{"cel": {"expression": s.cel}} for s in g.selectors]
    if g.indices is not None:
        attr = g.index_attribute or f"{g.device_class_name}/index"
        domain, name = attr.split("/", 1)
        values = ", ".join(str(i) for i in g.indices)
        out.append({"cel": {"expression": f'device.attributes["{domain}"].{name} in [{values}]'}})
    return out


def _device_request(inst: GpuInstance) -> dict[str, Any]:
    g = inst.spec.gpus
    exactly: dict[str, Any] = {
        "deviceClassName": g.device_class_name,
        "allocationMode": "ExactCount",
        "count": g.count,
    }
    selectors = _selectors(inst)
    if selectors:
        exactly["selectors"] = selectors
    return {"devices": {"requests": [{"name": CLAIM_NAME, "exactly": exactly}]}}


def render_claim(inst: GpuInstance) -> dict[str, Any]:
    """ResourceClaimTemplate (exclusive: one claim per pod) or a shared ResourceClaim."""
    meta = _meta(inst, claim_name(inst), "gpus")
    if inst.spec.gpus.exclusive:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": meta,
            "spec": {
                "metadata": {"labels": common_labels(inst, "gpus")},
                "spec": _device_request(inst),
            },
        }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": _device_request(inst),
    }


def render_service(inst: GpuInstance) -> dict[str, Any]:
    """The Service clients use.

    Without a gateway, the readiness-trap Service: not-ready addresses
    published, routable pods selected. With one, it selects the gateway's
    replicas, which route to the pods themselves (:func:`render_pods_service`).
    """
    port = inst.spec.serving_port
    name = inst.metadata.name
    gateway = inst.spec.gateway is not None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(inst, service_name(inst), "serving"),
        "spec": {
            "type": "ClusterIP",
            # A gateway replica is ready while it runs (it holds requests
            # while no pod is ready), and a terminating one leaves at once.
            "publishNotReadyAddresses": not gateway,
            "selector": (
                {LABEL_GATEWAY: name} if gateway else {LABEL_INSTANCE: name, LABEL_ROUTABLE: "true"}
            ),
            "ports": [
                {"name": SERVING_PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}
            ],
        },
    }


# ------------------------------------------------------------------ gateway
#
# An instance with a ``gateway`` section gets the fleet gateway
# (docs/gateway.md, "On Kubernetes"): a Deployment of ``understudy gateway
# --endpointslices NS/<name>-pods``, its PodDisruptionBudget, the pods'
# headless Service it watches, and its own ServiceAccount, Role and
# RoleBinding (EndpointSlices of its namespace, read only). The instance's
# Service then selects the gateway's pods (render_service).

GATEWAY = "gateway"
LABEL_GATEWAY = f"{PREFIX}/gateway"
GATEWAY_STATUS_PORT = 8091  # the gateway's /live, /ready, /metrics, /state
GATEWAY_STATUS_PORT_NAME = "gateway-status"
GATEWAY_KEYS_DIR = "/etc/understudy/api-keys"
GATEWAY_KEYS_FILE = "keys"
# A terminating gateway replica keeps accepting this long before its SIGTERM:
# the Service's EndpointSlice and then every node's kube-proxy drop it
# asynchronously, and a connection routed to it meanwhile must not be
# refused (a rollout of the gateway, a drain of its node).
GATEWAY_UNLIST_S = 5


def gateway_drain_seconds(inst: GpuInstance) -> int:
    """The gateway's drain after SIGTERM: inside the pod's grace, after the
    pre-stop wait, with 5 s to exit on its own rather than by SIGKILL."""
    return max(1, inst.spec.drain.grace_period_seconds - GATEWAY_UNLIST_S - 5)


def gateway_name(inst: GpuInstance) -> str:
    """The gateway's Deployment, PodDisruptionBudget, ServiceAccount, Role and RoleBinding."""
    return f"{inst.metadata.name}-gateway"


def pods_service_name(inst: GpuInstance) -> str:
    """The headless Service over the instance's pods, which the gateway watches."""
    return f"{inst.metadata.name}-pods"


def endpoints_service_name(inst: GpuInstance) -> str:
    """The Service whose EndpointSlices list the instance's pods (drains, availability)."""
    return pods_service_name(inst) if inst.spec.gateway is not None else service_name(inst)


def gateway_grace_seconds(inst: GpuInstance) -> int:
    """How long a terminating pod's requests finish there before the gateway moves them.

    Inside the pod's front's own drain (:func:`drain_seconds`), so that they
    move before the front gives up on them: 20 s with the default 30 s grace.
    """
    return max(1, drain_seconds(inst) - 5)


def gateway_pod_labels(inst: GpuInstance) -> dict[str, str]:
    """The gateway pods' labels: no ``understudy.dev/instance``, which names the
    instance's own pods (the operator's pod list, the scale subresource's
    selector, the pods' PodMonitor and headless Service)."""
    labels = common_labels(inst, GATEWAY)
    del labels[LABEL_INSTANCE]
    labels[LABEL_GATEWAY] = inst.metadata.name
    return labels


def render_pods_service(inst: GpuInstance) -> dict[str, Any]:
    """Headless, every pod of the instance, ready or not: the gateway's list.

    ``publishNotReadyAddresses``: the gateway judges each pod itself (its
    front's ``/ready``, probed every 0.1 s), much faster than a pod's
    readiness reaches the API server, and a pod that is being deleted stays
    listed with ``terminating`` (its requests finish there). No routable
    selector for the same reason. Both of the front's ports, by name.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(inst, pods_service_name(inst), "engine-pods"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_INSTANCE: inst.metadata.name},
            "ports": [
                {
                    "name": SERVING_PORT_NAME,
                    "port": inst.spec.serving_port,
                    "targetPort": SERVING_PORT_NAME,
                    "protocol": "TCP",
                },
                {
                    "name": STATUS_PORT_NAME,
                    "port": api.FRONT_STATUS_PORT,
                    "targetPort": STATUS_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
    }


def gateway_args(inst: GpuInstance) -> list[str]:
    """``understudy gateway``'s command line for this instance."""
    gw = inst.spec.gateway
    assert gw is not None
    args = [
        "gateway",
        "--endpointslices",
        f"{inst.metadata.namespace}/{pods_service_name(inst)}",
        "--port",
        str(inst.spec.serving_port),
        "--metrics-port",
        str(GATEWAY_STATUS_PORT),
        "--hold",
        str(gw.hold_seconds),
        "--migration-limit",
        str(inst.spec.failover.migration_limit),
        "--grace",
        str(gateway_grace_seconds(inst)),
        "--drain",
        str(gateway_drain_seconds(inst)),
    ]
    if gw.api_key_secret is not None:
        args += ["--api-key-file", f"{GATEWAY_KEYS_DIR}/{GATEWAY_KEYS_FILE}"]
    return args


def gateway_container(inst: GpuInstance, cfg: RenderConfig) -> dict[str, Any]:
    gw = inst.spec.gateway
    assert gw is not None

    def http(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": GATEWAY_STATUS_PORT_NAME, "scheme": "HTTP"}}

    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if gw.api_key_secret is not None:
        # The directory, not a subPath: a subPath mount never sees the
        # Secret's rotation, which the gateway picks up without a restart.
        mounts.append({"name": "api-keys", "mountPath": GATEWAY_KEYS_DIR, "readOnly": True})
    return {
        "name": GATEWAY,
        "image": cfg.image,  # the pod's front's image: the gateway is the front's forwarder
        "imagePullPolicy": cfg.image_pull_policy,
        # Under the respawner with both ports bound by it, as the pod's
        # processes: a gateway that dies is started again in place from a
        # spare that has done its imports, while new connections wait in the
        # port's queue. Without it, a replica's crash refuses the Service's
        # connections until its readiness fails (seconds) and then costs
        # kubelet's back-off. The connections it had accepted are lost with
        # it (docs/gateway.md, a gateway replica killed).
        "command": ["understudy"],
        "args": [
            "respawn",
            "--spare",
            "--listen",
            f"serving=0.0.0.0:{inst.spec.serving_port}",
            "--listen",
            f"status=0.0.0.0:{GATEWAY_STATUS_PORT}",
            "--",
            "understudy",
            *gateway_args(inst),
        ],
        "ports": [
            _port(SERVING_PORT_NAME, inst.spec.serving_port),
            _port(GATEWAY_STATUS_PORT_NAME, GATEWAY_STATUS_PORT),
        ],
        "startupProbe": {**http("/live"), "periodSeconds": 1, "failureThreshold": 30},
        "livenessProbe": {**http("/live"), "periodSeconds": 2, "failureThreshold": 3},
        # Ready while it runs, not while a pod is routable (its /ready): a
        # gateway holds requests through a moment with no ready pod, which
        # is when an empty Service would refuse them instead.
        "readinessProbe": {**http("/live"), "periodSeconds": 1, "failureThreshold": 3},
        "lifecycle": {"preStop": {"sleep": {"seconds": GATEWAY_UNLIST_S}}},
        "resources": _resources(
            # the gateway, its spare and the respawner
            gw.resources,
            defaults={"cpu": "100m", "memory": "128Mi"},
            claim=False,
        ),
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": mounts,
    }


def render_gateway_deployment(inst: GpuInstance, cfg: RenderConfig) -> dict[str, Any]:
    """The gateway's replicas: surge first, spread over nodes where they can be."""
    gw = inst.spec.gateway
    assert gw is not None
    labels = gateway_pod_labels(inst)
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if gw.api_key_secret is not None:
        ref = gw.api_key_secret
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": ref.name,
                    "items": [{"key": ref.key, "path": GATEWAY_KEYS_FILE}],
                    "defaultMode": 0o440,
                },
            }
        )
    spec: dict[str, Any] = {
        "serviceAccountName": gateway_name(inst),
        # It reads EndpointSlices with its ServiceAccount's token.
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": inst.spec.drain.grace_period_seconds,
        "securityContext": _pod_security(),
        # One node's loss takes one gateway replica, not all of them.
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": {LABEL_GATEWAY: inst.metadata.name}},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        },
        "containers": [gateway_container(inst, cfg)],
        "volumes": volumes,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(inst, gateway_name(inst), GATEWAY),
        "spec": {
            "replicas": gw.replicas,
            "selector": {"matchLabels": {LABEL_GATEWAY: inst.metadata.name}},
            # A new replica serves before an old one goes.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {"labels": labels, "annotations": gateway_scrape_annotations()},
                "spec": spec,
            },
        },
    }


def gateway_scrape_annotations() -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(GATEWAY_STATUS_PORT),
        "prometheus.io/path": "/metrics",
    }


def render_gateway_pdb(inst: GpuInstance) -> dict[str, Any]:
    """``maxUnavailable: 1``: a voluntary eviction (a node drain) takes one
    replica at a time and never blocks, even at one replica, where
    ``minAvailable: 1`` would refuse every eviction and stall the drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(inst, gateway_name(inst), GATEWAY),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": {LABEL_GATEWAY: inst.metadata.name}},
        },
    }


def render_gateway_rbac(inst: GpuInstance) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding: EndpointSlices of its namespace, read only."""
    name = gateway_name(inst)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(inst, name, GATEWAY)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(inst, name, GATEWAY),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(inst, name, GATEWAY),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [
                {"kind": "ServiceAccount", "name": name, "namespace": inst.metadata.namespace}
            ],
        },
    ]


def render_gateway(inst: GpuInstance, cfg: RenderConfig) -> list[dict[str, Any]]:
    """Every object of the instance's gateway ([] without a ``gateway`` section),
    in the order they can be applied: the ServiceAccount before the pods that use it."""
    if inst.spec.gateway is None:
        return []
    return [
        *render_gateway_rbac(inst),
        render_pods_service(inst),
        render_gateway_pdb(inst),
        render_gateway_deployment(inst, cfg),
    ]


def gateway_objects(inst: GpuInstance) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every object :func:`render_gateway` makes:
    what the plan deletes when the section goes, the Deployment first."""
    name = gateway_name(inst)
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        ("apps/v1", "Deployment", name),
        ("policy/v1", "PodDisruptionBudget", name),
        ("v1", "Service", pods_service_name(inst)),
        (rbac, "RoleBinding", name),
        (rbac, "Role", name),
        ("v1", "ServiceAccount", name),
    ]


def render_all(
    inst: GpuInstance,
    cfg: RenderConfig,
    placements: Mapping[int, tuple[int, str | None]] | None = None,
) -> list[dict[str, Any]]:
    """Everything the operator creates; ``placements`` maps replica -> (attempt, node).

    Without placements, every target replica is rendered at attempt 1 on
    ``placement.targetNode`` (what ``understudy render`` prints).
    """
    if placements is None:
        node = inst.spec.placement.target_node
        placements = {i: (1, node) for i in range(inst.spec.replicas.target)}
    objs = [render_claim(inst), render_service(inst), *render_gateway(inst, cfg)]
    objs += [render_pod(inst, i, a, n, cfg) for i, (a, n) in sorted(placements.items())]
    return objs
