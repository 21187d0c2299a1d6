"""The front door's metrics (Prometheus conventions: base units, ``_total`` counters).

Counted in plain Python objects and turned into Prometheus families only when
scraped (``FrontMetrics.collect``). The front counts on every request, and a
restarted front must accept before anything else: ``prometheus_client``
costs tens of milliseconds to import (more than the front's whole start
otherwise), so it is imported at the first scrape, and counting a request is
an integer addition rather than a locked update.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import prometheus_client as prom

# Sub-second resolution where failovers live (about 25 % apart, so a
# percentile agrees with a drill's own measurement within a bucket), then up
# to the hold.
GAP_BUCKETS = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4,
    0.5, 0.75, 1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20, 30,
)  # fmt: skip
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Counter:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Gauge:
    __slots__ = ("_fn", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self._fn: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        self.value = value

    def set_function(self, fn: Callable[[], float]) -> None:
        self._fn = fn

    def get(self) -> float:
        return float(self._fn()) if self._fn is not None else self.value


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, +Inf last."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, None), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound is None else repr(float(bound)), float(running)))
        return out


class Labelled:
    """Counters by one label's value."""

    __slots__ = ("by", "label")

    def __init__(self, label: str) -> None:
        self.label = label
        self.by: dict[str, Counter] = {}

    def labels(self, **value: str) -> Counter:
        (v,) = value.values()
        c = self.by.get(v)
        if c is None:
            c = self.by[v] = Counter()
        return c


# name, help, and how each is exposed: (kind, attribute)
_COUNTERS = {
    "requests": (
        "understudy_front_requests",
        "Requests answered by the front, by HTTP status class (a client that left "
        "before its answer began: 4xx)",
    ),
    "held_total": (
        "understudy_front_held_requests",
        "Requests that had to wait for an Active engine",
    ),
    "hold_expired": (
        "understudy_front_hold_expired",
        "Requests answered 503 because no engine became Active within the hold",
    ),
    "migrations": (
        "understudy_front_migrations",
        "Requests moved to the next Active engine: new (replayed whole), "
        "ongoing (a stream continued where it stopped)",
    ),
    "migrations_failed": (
        "understudy_front_migrations_failed",
        "Requests that could not be migrated: limit (the migration limit), state (a "
        "non-streaming answer cut after it began), rejected (the next engine refused "
        "a stream's continuation)",
    ),
    "isolated": (
        "understudy_front_isolated",
        "Requests run alone because engines died twice while they were in flight "
        "(suspects of poison)",
    ),
    "poison": (
        "understudy_front_poison",
        "Requests answered as a poison: an engine died while it ran alone, after two "
        "deaths beside others",
    ),
    "failovers": ("understudy_front_failovers", "Times the route moved to another engine"),
    "stale": (
        "understudy_front_stale_epochs",
        "Lock events ignored because their epoch was older than the newest seen",
    ),
    "hung": (
        "understudy_front_hung_engines",
        "Active engines killed because their heartbeat stopped",
    ),
    "lost": (
        "understudy_front_lost_requests",
        "Requests that were inside a front when it died (their clients saw the "
        "connection close), counted by the next front; durable",
    ),
    "idle_lost": (
        "understudy_front_lost_idle_connections",
        "Kept-alive connections that were idle when a front died (a client may have "
        "been sending its next request on one), counted by the next front; durable",
    ),
    "restarts": (
        "understudy_front_restarts",
        "Times a front started after another one in this pod; durable",
    ),
    "adopted": (
        "understudy_front_adopted_connections",
        "Client connections a front that died had accepted, finished by this one "
        "(the lock server kept them open)",
    ),
    "adopted_streams": (
        "understudy_front_adopted_streams",
        "Streams under way on an adopted connection, continued from the client's last token",
    ),
}
_GAUGES = {
    "inflight": ("understudy_front_requests_inflight", "Requests being forwarded to an engine"),
    "held": ("understudy_front_requests_held", "Requests waiting for an Active engine"),
    "routing": (
        "understudy_front_routing",
        "1 while the front has an Active engine to route to",
    ),
    "epoch": ("understudy_front_route_epoch", "Lock epoch of the engine routed to"),
    "lock_watch_up": (
        "understudy_front_lock_watch_up",
        "1 while the front is connected to the lock server's watch",
    ),
    "start_seconds": (
        "understudy_front_start_seconds",
        "From this front's exec (a spare's: its turn) to accepting connections",
    ),
}
_HISTOGRAMS = {
    "duration": (
        "understudy_front_request_duration_seconds",
        "Time from a request's arrival to the end of its answer",
    ),
    "hold": ("understudy_front_hold_seconds", "How long a request waited for an Active engine"),
    "gap": (
        "understudy_front_failover_gap_seconds",
        "Client-visible gap of a failover: route lost to the first answer of the next engine",
    ),
    "detection": (
        "understudy_front_detection_seconds",
        "Route lost (the engine's release, or the last heartbeat of a hung engine) "
        "to the next engine's grant",
    ),
}


class FrontMetrics:
    def __init__(self) -> None:
        self.requests = Labelled("code")
        self.held_total = Counter()
        self.hold_expired = Counter()
        self.migrations = Labelled("kind")
        self.migrations_failed = Labelled("reason")
        self.isolated = Counter()
        self.poison = Counter()
        self.failovers = Counter()
        self.stale = Counter()
        self.hung = Counter()
        self.lost = Counter()
        self.idle_lost = Counter()
        self.restarts = Counter()
        self.adopted = Counter()
        self.adopted_streams = Counter()
        self.inflight = Gauge()
        self.held = Gauge()
        self.routing = Gauge()
        self.epoch = Gauge()
        self.lock_watch_up = Gauge()
        self.start_seconds = Gauge()
        self.duration = Histogram(_LATENCY_BUCKETS)
        self.hold = Histogram(GAP_BUCKETS)
        self.gap = Histogram(GAP_BUCKETS)
        self.detection = Histogram(GAP_BUCKETS)
        self._registry: prom.CollectorRegistry | None = None

    @property
    def registry(self) -> prom.CollectorRegistry:
        """A registry holding these metrics (built, and prometheus_client
        imported, on first use: the first scrape)."""
        if self._registry is None:
            import prometheus_client as prom

            self._registry = prom.CollectorRegistry()
            self._registry.register(_Collector(self))
        return self._registry

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        for attr, (name, text) in _COUNTERS.items():
            metric = getattr(self, attr)
            if isinstance(metric, Labelled):
                family = CounterMetricFamily(name, text, labels=[metric.label])
                for value, c in sorted(metric.by.items()):
                    family.add_metric([value], c.value)
                yield family
            else:
                yield CounterMetricFamily(name, text, value=metric.value)
        for attr, (name, text) in _GAUGES.items():
            yield GaugeMetricFamily(name, text, value=getattr(self, attr).get())
        for attr, (name, text) in _HISTOGRAMS.items():
            h = getattr(self, attr)
            yield HistogramMetricFamily(name, text, buckets=h.buckets(), sum_value=h.total)


class _Collector:
    def __init__(self, metrics: FrontMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        return self.metrics.collect()
