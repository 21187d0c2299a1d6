"""GMS metrics (prometheus-client, base units, ``understudy_gms_`` prefix).

The supervisor runs one server process per device. They share the pod's one
GMS metrics port (9102, docs/pod.md) through prometheus-client's
*multiprocess mode*: the supervisor gives every child the same
``PROMETHEUS_MULTIPROC_DIR``, children write their samples to files there,
and the supervisor serves a ``MultiProcessCollector`` over them. Chosen over
a port per child because the pod contract has one scrape target per
container and a scraper should not need to know the device count. Gauges
use ``livesum``: a dead child's values vanish with it; every series carries
``device`` and ``tag`` labels, so the sum is the child's own value.
"""

from __future__ import annotations

import os

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import multiprocess as _mp

_LABELS = ("device", "tag")

ALLOCATED_BYTES = Gauge(
    "understudy_gms_allocated_bytes",
    "Bytes allocated (aligned)",
    _LABELS,
    multiprocess_mode="livesum",
)
ALLOCATIONS = Gauge(
    "understudy_gms_allocations", "Live allocations", _LABELS, multiprocess_mode="livesum"
)
SESSIONS = Gauge(
    "understudy_gms_sessions",
    "Granted sessions by mode",
    (*_LABELS, "mode"),
    multiprocess_mode="livesum",
)
WAITING = Gauge(
    "understudy_gms_waiting_sessions",
    "Sessions waiting for the lock",
    _LABELS,
    multiprocess_mode="livesum",
)
WAITING_WRITERS = Gauge(
    "understudy_gms_waiting_writers",
    "Sessions waiting for RW",
    _LABELS,
    multiprocess_mode="livesum",
)
COMMITTED = Gauge(
    "understudy_gms_committed", "1 if a layout is committed", _LABELS, multiprocess_mode="livesum"
)
KV_POOL_BYTES = Gauge(
    "understudy_gms_kv_pool_bytes",
    "Bytes of the KV pool (0: none created since this server started)",
    _LABELS,
    multiprocess_mode="livesum",
)
KV_POOL_EPOCH = Gauge(
    "understudy_gms_kv_pool_holder_epoch",
    "Lock epoch of the engine that maps the KV pool now (0: nobody)",
    _LABELS,
    multiprocess_mode="livemax",
)
KV_POOL_READERS = Gauge(
    "understudy_gms_kv_pool_readers",
    "Sessions that map the KV pool read-only (kv_peek): standbys ahead of a failover",
    _LABELS,
    multiprocess_mode="livesum",
)
LOCK_WAIT = Histogram(
    "understudy_gms_lock_wait_seconds",
    "Time from hello to grant or expiry",
    (*_LABELS, "mode", "outcome"),
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
)
DEVICE_HEALTHY = Gauge(
    "understudy_gms_device_healthy",
    "1 if NVML reports the device healthy (absent without NVML)",
    _LABELS,
    multiprocess_mode="livesum",
)
DEVICE_MEMORY_USED = Gauge(
    "understudy_gms_device_memory_used_bytes",
    "Device memory in use by every process (NVML)",
    _LABELS,
    multiprocess_mode="livesum",
)
DEVICE_MEMORY_TOTAL = Gauge(
    "understudy_gms_device_memory_total_bytes",
    "Device memory (NVML)",
    _LABELS,
    multiprocess_mode="livesum",
)
DEVICE_XIDS = Counter(
    "understudy_gms_device_xid_events_total", "Xid events NVML reported", (*_LABELS, "xid")
)
TRANSITIONS = Counter(
    "understudy_gms_transitions_total", "State transitions by event", (*_LABELS, "event")
)


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def serve_multiprocess(port: int, addr: str = "0.0.0.0") -> None:
    """Serve what every child process wrote to ``PROMETHEUS_MULTIPROC_DIR``."""
    registry = CollectorRegistry()
    _mp.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    prometheus_client.start_http_server(port, addr=addr, registry=registry)


def mark_process_dead(pid: int) -> None:
    if multiprocess_enabled():
        _mp.mark_process_dead(pid)  # type: ignore[no-untyped-call]
