"""The requests of a drill, as data: each request's sample, what a long drill
keeps of them (counts and a bounded series, ``Tally``) and the series a
report draws (``request_series``). Pure: no clocks, no I/O; the drill feeds
it, ``understudy drill --report`` draws what it returns."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from understudy.tools.stalls import Stall, stream_times


class KindLike(Protocol):
    """A kind of request (drill_load.Kind): its name, and whether it streams."""

    @property
    def name(self) -> str: ...

    @property
    def streaming(self) -> bool: ...


@dataclass(slots=True)
class Sample:
    """One request: started and ended (monotonic seconds), answered right or
    not, the digest of its answer or its error, its kind's name, for a
    stream when each of its tokens arrived (until the tally has read them),
    and for a failure where it failed."""

    start: float
    end: float
    ok: bool
    digest: str = ""
    error: str = ""
    kind: str = ""
    tokens: tuple[float, ...] = ()
    # A failure's where: the step it failed in and the client's port (to
    # find the connection in the front's log: ``adopted ... peer=``).
    detail: str = ""


# The per-request series a report draws: every request near a kill (the part
# worth looking at) and every failure, the steady stretches between kills
# thinned out so that a long drill's JSON and charts stay small.
SERIES_LIMIT = 20_000
KILL_WINDOW_S = (-1.0, 3.0)  # around each kill, kept whole
RECENT = 50  # answered requests whose durations a Tally keeps (the drill's kill phase)


def _near_kill(s: Sample, kills: list[float]) -> bool:
    lo, hi = KILL_WINDOW_S
    return any(s.end >= k + lo and s.start <= k + hi for k in kills)


def request_series(
    samples: list[Sample],
    kinds: Sequence[KindLike],
    origin: float,
    kills: list[float],
    limit: int = SERIES_LIMIT,
    total: int | None = None,
) -> dict[str, Any]:
    """The requests as ``[start_s, latency_s, kind, ok]`` rows, times in seconds
    since ``origin``, ``kind`` an index into ``kinds``; at most ``limit`` rows
    (kept: failures and requests overlapping a kill's window; the rest evenly
    thinned, and the kept ones too if they alone exceed the limit). ``total``:
    how many requests there were, if ``samples`` is already a thinned part."""
    index = {k.name: i for i, k in enumerate(kinds)}
    ordered = sorted(samples, key=lambda s: s.start)
    keep = [s for s in ordered if not s.ok or _near_kill(s, kills)]
    rest = [s for s in ordered if s.ok and not _near_kill(s, kills)]
    if len(keep) >= limit:
        keep, rest = _thin(keep, limit), []
    chosen = sorted([*keep, *_thin(rest, limit - len(keep))], key=lambda s: s.start)
    return {
        "columns": ["start_s", "latency_s", "kind", "ok"],
        "kinds": [{"name": k.name, "streaming": k.streaming} for k in kinds],
        "total": len(samples) if total is None else total,
        "rows": [
            [
                round(s.start - origin, 4),
                round(s.end - s.start, 4),
                index.get(s.kind, -1),
                int(s.ok),
            ]
            for s in chosen
        ],
    }


class Tally:
    """The requests a drill no longer needs one by one, folded into counts
    (requests, failures and errors by kind, each kind's answers by digest) and
    a bounded sample for the series: every failure and every request near a
    kill, and of the rest every ``stride``-th, the stride doubling whenever
    they exceed the limit. A long drill's memory, and the cost of the rounds'
    polls over the requests still held, stay bounded by the requests of about
    one round."""

    def __init__(self, limit: int = SERIES_LIMIT) -> None:
        self.limit = limit
        self.requests = 0
        self.failed = 0
        self.by_kind: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.answers: dict[str, Counter[str]] = {}
        self.near: list[Sample] = []
        self.rest: list[Sample] = []
        self.stride = 1
        self.seen_rest = 0
        # the streams a kill caught: each one's stall, and its other intervals
        # between tokens (the TPOT the stall reads against)
        self.stalls: list[Stall] = []
        self.between: list[float] = []
        self.recent_s: deque[float] = deque(maxlen=RECENT)  # the last answered ones' durations

    def add(self, samples: list[Sample], kills: list[float]) -> None:
        """Fold ``samples``, which end before any kill after ``kills``."""
        for s in samples:
            self.requests += 1
            if s.tokens:
                caught = stream_times(s.tokens, kills)
                self.stalls += caught.stalls
                self.between += caught.between_s
                s.tokens = ()  # read: a long drill keeps no token times
            self.by_kind[s.kind] = self.by_kind.get(s.kind, 0) + 1
            if s.ok:
                self.answers.setdefault(s.kind, Counter())[s.digest] += 1
                self.recent_s.append(s.end - s.start)
            else:
                self.failed += 1
                self.errors[s.error] = self.errors.get(s.error, 0) + 1
            if not s.ok or _near_kill(s, kills):
                self.near.append(s)
                if len(self.near) > 2 * self.limit:
                    self.near = self.near[::2]
                continue
            if self.seen_rest % self.stride == 0:
                self.rest.append(s)
                if len(self.rest) > self.limit:
                    self.rest, self.stride = self.rest[::2], self.stride * 2
            self.seen_rest += 1

    def wrong_answers(self) -> int:
        """Answers that differ from their kind's most common one."""
        return sum(sum(c.values()) - max(c.values()) for c in self.answers.values() if c)

    def series(
        self, kinds: Sequence[KindLike], origin: float, kills: list[float]
    ) -> dict[str, Any]:
        return request_series(
            [*self.near, *self.rest], kinds, origin, kills, self.limit, total=self.requests
        )


def _thin(items: list[Sample], n: int) -> list[Sample]:
    """``n`` of ``items``, evenly spaced (all of them if there are no more)."""
    if n <= 0:
        return []
    if len(items) <= n:
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]
