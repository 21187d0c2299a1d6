"""The lock server's durable failover counters (pure: no I/O, no clock).

The lock server sees both ends of every handover, so it keeps the pod's
failover record: grants, handovers, reissued resumes, closed reconnect
windows, the handover time (the holder's death to the next grant) and the
re-arm time (a handover to the next standby queueing for the lock: the pod
can survive another death). The shell writes the tally into the state file
together with the grant (or release) that moves it and restores it at start,
so a count outlives the process that made it, whichever process dies
(docs/monitoring.md). Exposed with the usual names and types; a restored
counter simply continues.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

# Holder's EOF → next grant: sub-millisecond when a standby waits in acquire,
# up to a reconnect window after a lock server restart.
HANDOVER_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
    0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Handover → a standby again: a restart and a weight import (seconds), up to
# a cold load under a long startup budget.
REARM_BUCKETS: tuple[float, ...] = (
    0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.5, 15.0, 20.0, 30.0, 45.0, 60.0,
    120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip
WINDOW_REASONS = ("reclaimed", "expired", "holder_gone")


@dataclass(frozen=True, slots=True)
class Hist:
    """A histogram over fixed bounds: non-cumulative counts, +Inf last."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Hist:
        return cls(bounds, (0,) * (len(bounds) + 1))

    def observe(self, seconds: float) -> Hist:
        s = max(0.0, seconds)
        index = next((i for i, b in enumerate(self.bounds) if s <= b), len(self.bounds))
        counts = list(self.counts)
        counts[index] += 1
        return Hist(self.bounds, tuple(counts), self.total + s)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs, +Inf last: a Prometheus histogram's buckets."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(bound), running))
        return out

    def to_json(self) -> dict[str, object]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


@dataclass(frozen=True, slots=True)
class Tally:
    grants: int = 0  # new epochs
    resumed_grants: int = 0  # the same holder back with its epoch
    handovers: int = 0  # a new epoch after an earlier holder went away
    reissues: int = 0  # a resume claim honoured under a new epoch
    windows_closed: tuple[tuple[str, int], ...] = ()  # (reason, count), sorted
    handover: Hist = field(default_factory=lambda: Hist.empty(HANDOVER_BUCKETS))
    rearm: Hist = field(default_factory=lambda: Hist.empty(REARM_BUCKETS))

    def window_count(self, reason: str) -> int:
        return dict(self.windows_closed).get(reason, 0)


def granted(
    t: Tally, *, resumed: bool, reissued: bool, handover: bool, handover_s: float | None
) -> Tally:
    """The tally after one grant; ``handover_s`` is observed when the previous
    holder's release time is known (it is not after a lock server restart)."""
    return replace(
        t,
        grants=t.grants + (0 if resumed else 1),
        resumed_grants=t.resumed_grants + (1 if resumed else 0),
        handovers=t.handovers + (1 if handover else 0),
        reissues=t.reissues + (1 if reissued else 0),
        handover=t.handover if handover_s is None else t.handover.observe(handover_s),
    )


def rearmed(t: Tally, seconds: float) -> Tally:
    return replace(t, rearm=t.rearm.observe(seconds))


def window_closed(t: Tally, reason: str) -> Tally:
    counts = dict(t.windows_closed)
    counts[reason] = counts.get(reason, 0) + 1
    return replace(t, windows_closed=tuple(sorted(counts.items())))


def to_json(t: Tally) -> dict[str, object]:
    return {
        "grants": t.grants,
        "resumed_grants": t.resumed_grants,
        "handovers": t.handovers,
        "reissues": t.reissues,
        "windows_closed": dict(t.windows_closed),
        "handover_seconds": t.handover.to_json(),
        "rearm_seconds": t.rearm.to_json(),
    }


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a count must be a non-negative integer, not {value!r}")
    return value


def _hist(data: object, bounds: tuple[float, ...], name: str) -> Hist:
    """A kept histogram; one written with other bounds (an older or newer
    server) starts empty rather than being re-binned: its counts cannot be
    placed exactly."""
    if not isinstance(data, Mapping) or data.get("bounds") != list(bounds):
        return Hist.empty(bounds)
    counts, total = data.get("counts"), data.get("sum")
    if not isinstance(counts, list) or len(counts) != len(bounds) + 1:
        raise ValueError(f"{name}.counts must have one count per bucket and +Inf")
    if not isinstance(total, int | float) or isinstance(total, bool) or not total >= 0:
        raise ValueError(f"{name}.sum must be a non-negative number")
    return Hist(bounds, tuple(map(_count, counts)), float(total))


def from_json(data: object) -> Tally:
    """The tally a state file kept; ValueError if it is not one."""
    if not isinstance(data, Mapping):
        raise ValueError("counters must be an object")
    windows = data.get("windows_closed", {})
    if not isinstance(windows, Mapping) or not all(isinstance(k, str) for k in windows):
        raise ValueError("windows_closed must map reasons to counts")
    return Tally(
        grants=_count(data.get("grants", 0)),
        resumed_grants=_count(data.get("resumed_grants", 0)),
        handovers=_count(data.get("handovers", 0)),
        reissues=_count(data.get("reissues", 0)),
        windows_closed=tuple(sorted((str(k), _count(v)) for k, v in windows.items())),
        handover=_hist(data.get("handover_seconds"), HANDOVER_BUCKETS, "handover_seconds"),
        rearm=_hist(data.get("rearm_seconds"), REARM_BUCKETS, "rearm_seconds"),
    )
