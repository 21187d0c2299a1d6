"""A stream's own stall at a kill, against its own time between tokens.

What a reader of a streamed answer feels of a failover is one pause between
two words. For each stream in flight at a kill, its stall is the time from
its last token before the kill to its first token after; it reads against
the same streams' time per output token (TPOT: every other interval between
their tokens over the run), because on a slow model the tokens are far apart
with or without a kill. The drill (``series.Tally``) and the KV failover
benchmark (``bench/kv_failover.py``) both report these.

Pure: lists of arrival times (monotonic seconds) in, intervals out.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

# A token that arrives this soon after the kill was written before it (it was
# in the front's or the socket's buffers): the pause that counts may be the
# interval after it. So an interval that starts no later than this after the
# kill and ends after the kill is the kill's, and the longest of them is the
# stall.
IN_FLIGHT_S = 0.05


@dataclass(frozen=True, slots=True)
class Stall:
    """One stream caught by one kill: the kill's index in the kills given, and
    the stream's pause across it."""

    kill: int
    stall_s: float


@dataclass(frozen=True, slots=True)
class StreamTimes:
    """One stream's stalls, one per kill caught between two of its tokens, and
    its other intervals between tokens (none when no kill caught it)."""

    stalls: tuple[Stall, ...]
    between_s: tuple[float, ...]


def stream_times(tokens: Sequence[float], kills: Sequence[float]) -> StreamTimes:
    """Split a stream's intervals between tokens (``tokens``: arrival times,
    rising) into its stalls at ``kills`` and the rest. A stream with no token
    before a kill (still in its prefill) or none after it (done) is not caught
    by that kill: its wait is a first token's, not a pause between two."""
    intervals = [b - a for a, b in itertools.pairwise(tokens)]
    stalls: list[Stall] = []
    spent: set[int] = set()  # the intervals that are a kill's, not the stream's pace
    if tokens:
        # only the kills between its first token and its last (kills rise):
        # a long drill asks this of every stream
        first, last = bisect.bisect_left(kills, tokens[0]), bisect.bisect_left(kills, tokens[-1])
        for k in range(first, last):
            at = kills[k]
            spans = [
                i
                for i in range(len(intervals))
                if tokens[i] <= at + IN_FLIGHT_S and tokens[i + 1] > at
            ]
            stalls.append(Stall(k, max(intervals[i] for i in spans)))
            spent.update(spans)
    if not stalls:
        return StreamTimes((), ())
    between = tuple(v for i, v in enumerate(intervals) if i not in spent)
    return StreamTimes(tuple(stalls), between)
