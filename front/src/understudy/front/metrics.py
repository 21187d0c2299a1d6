"""The front door's metrics (Prometheus conventions: base units, ``_total`` counters)."""

from __future__ import annotations

import prometheus_client as prom

# Sub-second resolution where failovers live (about 25 % apart, so a
# percentile agrees with a drill's own measurement within a bucket), then up
# to the hold.
GAP_BUCKETS = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4,
    0.5, 0.75, 1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20, 30,
)  # fmt: skip
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class FrontMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        r = registry or prom.CollectorRegistry()
        self.registry = r
        self.requests = prom.Counter(
            "understudy_front_requests_total",
            "Requests answered by the front, by HTTP status class (a client that left "
            "before its answer began: 4xx)",
            ["code"],
            registry=r,
        )
        self.duration = prom.Histogram(
            "understudy_front_request_duration_seconds",
            "Time from a request's arrival to the end of its answer",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = prom.Gauge(
            "understudy_front_requests_inflight",
            "Requests being forwarded to an engine",
            registry=r,
        )
        self.held = prom.Gauge(
            "understudy_front_requests_held",
            "Requests waiting for an Active engine",
            registry=r,
        )
        self.held_total = prom.Counter(
            "understudy_front_held_requests_total",
            "Requests that had to wait for an Active engine",
            registry=r,
        )
        self.hold = prom.Histogram(
            "understudy_front_hold_seconds",
            "How long a request waited for an Active engine",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.hold_expired = prom.Counter(
            "understudy_front_hold_expired_total",
            "Requests answered 503 because no engine became Active within the hold",
            registry=r,
        )
        self.gap = prom.Histogram(
            "understudy_front_failover_gap_seconds",
            "Client-visible gap of a failover: route lost to the first answer of the next engine",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.detection = prom.Histogram(
            "understudy_front_detection_seconds",
            "Route lost (the engine's release, or the last heartbeat of a hung engine) "
            "to the next engine's grant",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.migrations = prom.Counter(
            "understudy_front_migrations_total",
            "Requests moved to the next Active engine: new (replayed whole), "
            "ongoing (a stream continued where it stopped)",
            ["kind"],
            registry=r,
        )
        self.migrations_failed = prom.Counter(
            "understudy_front_migrations_failed_total",
            "Requests that could not be migrated: limit (the migration limit), state (a "
            "non-streaming answer cut after it began), rejected (the next engine refused "
            "a stream's continuation)",
            ["reason"],
            registry=r,
        )
        self.routing = prom.Gauge(
            "understudy_front_routing",
            "1 while the front has an Active engine to route to",
            registry=r,
        )
        self.epoch = prom.Gauge(
            "understudy_front_route_epoch", "Lock epoch of the engine routed to", registry=r
        )
        self.failovers = prom.Counter(
            "understudy_front_failovers_total",
            "Times the route moved to another engine",
            registry=r,
        )
        self.stale = prom.Counter(
            "understudy_front_stale_epochs_total",
            "Lock events ignored because their epoch was older than the newest seen",
            registry=r,
        )
        self.hung = prom.Counter(
            "understudy_front_hung_engines_total",
            "Active engines killed because their heartbeat stopped",
            registry=r,
        )
        self.lock_watch_up = prom.Gauge(
            "understudy_front_lock_watch_up",
            "1 while the front is connected to the lock server's watch",
            registry=r,
        )
