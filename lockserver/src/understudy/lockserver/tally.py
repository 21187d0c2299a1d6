"""The lock server's durable failover counters (pure: no I/O, no clock).

The lock server sees both ends of every handover, so it keeps the pod's
failover record: grants, handovers, reissued resumes, closed reconnect
windows, and the handover-time histogram. The shell writes the tally into the
state file together with the grant (or release) that moves it and restores it
at start, so a count outlives the process that made it, whichever process
dies (docs/monitoring.md). Exposed with the usual names and types; a restored
counter simply continues.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

# Holder's EOF → next grant: sub-millisecond when a standby waits in acquire,
# up to a reconnect window after a lock server restart.
HANDOVER_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
    0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
WINDOW_REASONS = ("reclaimed", "expired", "holder_gone")


@dataclass(frozen=True, slots=True)
class Tally:
    grants: int = 0  # new epochs
    resumed_grants: int = 0  # the same holder back with its epoch
    handovers: int = 0  # a new epoch after an earlier holder went away
    reissues: int = 0  # a resume claim honoured under a new epoch
    windows_closed: tuple[tuple[str, int], ...] = ()  # (reason, count), sorted
    # Non-cumulative counts per HANDOVER_BUCKETS bound, plus +Inf last.
    handover_buckets: tuple[int, ...] = (0,) * (len(HANDOVER_BUCKETS) + 1)
    handover_sum: float = 0.0

    def window_count(self, reason: str) -> int:
        return dict(self.windows_closed).get(reason, 0)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs, +Inf last: a Prometheus histogram's buckets."""
        out, total = [], 0
        for bound, n in zip((*HANDOVER_BUCKETS, math.inf), self.handover_buckets, strict=True):
            total += n
            out.append(("+Inf" if bound == math.inf else repr(bound), total))
        return out


def granted(
    t: Tally, *, resumed: bool, reissued: bool, handover: bool, handover_s: float | None
) -> Tally:
    """The tally after one grant; ``handover_s`` is observed when the previous
    holder's release time is known (it is not after a lock server restart)."""
    new = replace(
        t,
        grants=t.grants + (0 if resumed else 1),
        resumed_grants=t.resumed_grants + (1 if resumed else 0),
        handovers=t.handovers + (1 if handover else 0),
        reissues=t.reissues + (1 if reissued else 0),
    )
    if handover_s is None:
        return new
    seconds = max(0.0, handover_s)
    index = next((i for i, b in enumerate(HANDOVER_BUCKETS) if seconds <= b), len(HANDOVER_BUCKETS))
    buckets = list(t.handover_buckets)
    buckets[index] += 1
    return replace(new, handover_buckets=tuple(buckets), handover_sum=t.handover_sum + seconds)


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
        "handover_seconds": {
            "bounds": list(HANDOVER_BUCKETS),
            "counts": list(t.handover_buckets),
            "sum": t.handover_sum,
        },
    }


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a count must be a non-negative integer, not {value!r}")
    return value


def from_json(data: object) -> Tally:
    """The tally a state file kept; ValueError if it is not one.

    A histogram written with other bucket bounds (an older or newer server)
    is dropped rather than re-binned: its counts cannot be placed exactly.
    """
    if not isinstance(data, Mapping):
        raise ValueError("counters must be an object")
    windows = data.get("windows_closed", {})
    if not isinstance(windows, Mapping) or not all(isinstance(k, str) for k in windows):
        raise ValueError("windows_closed must map reasons to counts")
    t = Tally(
        grants=_count(data.get("grants", 0)),
        resumed_grants=_count(data.get("resumed_grants", 0)),
        handovers=_count(data.get("handovers", 0)),
        reissues=_count(data.get("reissues", 0)),
        windows_closed=tuple(sorted((str(k), _count(v)) for k, v in windows.items())),
    )
    hist = data.get("handover_seconds")
    if not isinstance(hist, Mapping) or hist.get("bounds") != list(HANDOVER_BUCKETS):
        return t
    counts, total = hist.get("counts"), hist.get("sum")
    if not isinstance(counts, list) or len(counts) != len(HANDOVER_BUCKETS) + 1:
        raise ValueError("handover_seconds.counts must have one count per bucket and +Inf")
    if not isinstance(total, int | float) or isinstance(total, bool) or not total >= 0:
        raise ValueError("handover_seconds.sum must be a non-negative number")
    return replace(t, handover_buckets=tuple(map(_count, counts)), handover_sum=float(total))
