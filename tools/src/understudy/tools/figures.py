"""The figures of a drill, as pure functions of what it recorded.

A drill records three things: the requests its clients made (``Sample``:
start, end, ok), the engines' ``/state`` documents as its watcher polled them,
and when it killed what. Every number it reports is computed here from those
records, so each can be tested on records made up for the test, with no pod,
no clock and no threads: the longest time with no request completed, the
first request served after a kill, the failed requests of a round, kill →
grant → Active, whether the pod is armed, and how long it was not (a stream's
stall at a kill is ``stalls``').

Pure: no clocks, no I/O, no threads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from understudy.tools.series import Sample

Engine = Mapping[str, Any]  # one engine's /state document


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least q % of
    the values at or below it (no interpolation: every figure is one that was
    measured). ``q * n`` first: ``0.99 * 100`` is not 99 in floating point."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered) / 100)))
    return ordered[rank - 1]


def stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values),
        "min": min(values),
    }


def verdict(s: Mapping[str, Any]) -> bool:
    """Whether a drill's summary passes. Zero loss is the bar: an engine death
    may cost latency, never an error."""
    return (
        s["failovers_ok"] == s["kills"]
        and not s["failed_requests"]
        and not s["wrong_answers"]
        and not s["split_brain"]
        and not s["epoch_regressions"]
        and not s["serving_violations"]
        # a poison sent and not told apart from the others (drill --poison)
        and s.get("poison_told", 0) == s.get("poison_sent", 0)
    )


# --- the engines, as the watcher sees them -------------------------------------


def _in(engines: Iterable[Engine], state: str) -> list[Engine]:
    return [e for e in engines if e.get("state") == state]


def armed(engines: Sequence[Engine]) -> tuple[Engine, list[Engine]] | None:
    """(the Active engine, the Standbys) when the pod can take a kill: exactly
    one Active, at least one Standby, and every engine past its startup probe
    (a container still starting is not yet watched by its liveness probe)."""
    active, standby = _in(engines, "Active"), _in(engines, "Standby")
    if len(active) == 1 and standby and all(e.get("started", True) for e in engines):
        return active[0], standby
    return None


def settled(engines: Sequence[Engine]) -> Engine | None:
    """The Active engine when every other engine is a started Standby: the
    state a sidecar drill starts from and waits to see again."""
    active = _in(engines, "Active")
    if len(active) == 1 and all(
        e.get("state") == "Standby" and e.get("started", True)
        for e in engines
        if e is not active[0]
    ):
        return active[0]
    return None


def split_brain(engines: Sequence[Engine]) -> list[Engine]:
    """The Active engines of one snapshot that were Active at once: an engine
    said Active when asked (``asked_at``, wall time: its answer was read at
    that time or later) after another was granted the lock under a newer
    epoch (its ``granted_at``). A snapshot asks the engines one after
    another, so an engine that answered Active and was killed just after can
    appear beside its successor: that is a failover, not two engines
    serving. Without the times, any two Active engines count."""
    active = sorted(_in(engines, "Active"), key=lambda e: e.get("epoch") or 0)
    for older, newer in itertools.combinations(active, 2):
        asked, granted = older.get("asked_at"), newer.get("granted_at")
        if asked is None or granted is None or asked >= granted:
            return active
    return []


def whole(engines: Sequence[Engine]) -> Engine | None:
    """Settled, and no engine still giving its weights back to a restarted GMS:
    the state a sidecar drill kills from again."""
    if any(e.get("readopting") for e in engines):
        return None
    return settled(engines)


def successor(engines: Iterable[Engine], above_epoch: int) -> Engine | None:
    """The engine Active under a newer epoch than the killed one's, if any."""
    for e in _in(engines, "Active"):
        if (e.get("epoch") or 0) > above_epoch:
            return e
    return None


def rearmed(engines: Iterable[Engine], name: str, engine_id: str) -> bool:
    """Whether the killed container is a Standby again, in a new process:
    engine ids carry a per-process suffix (a pid repeats: in a container the
    engine is often pid 1)."""
    return any(
        e.get("name") == name and e.get("engine_id") != engine_id for e in _in(engines, "Standby")
    )


def rearm_s(
    standby_seen: Mapping[str, tuple[str, float]], name: str, engine_id: str, t_kill: float
) -> float | None:
    """Kill → the killed container's next engine first seen in Standby, from the
    watcher's ``engine id -> (name, first seen in Standby)``."""
    times = [
        at - t_kill
        for eid, (n, at) in standby_seen.items()
        if n == name and eid != engine_id and at >= t_kill
    ]
    return min(times, default=None)


@dataclass(frozen=True, slots=True)
class Wake:
    """kill → lock granted → Active, from the new engine's wall-clock stamps."""

    kill_to_grant_s: float
    grant_to_active_s: float
    kill_to_active_s: float


def wake(new: Engine, wall_kill: float) -> Wake | None:
    granted, active_at = new.get("waking_at"), new.get("active_at")
    if not (granted and active_at):
        return None
    return Wake(granted - wall_kill, active_at - granted, active_at - wall_kill)


# --- a fleet's pods, as the gateway's /state shows them ----------------------------

PodView = Mapping[str, Any]  # one pod in the gateway's /state


def busiest_pod(pods: Sequence[PodView]) -> PodView | None:
    """Where a fleet drill's fault goes: of the ready pods, the one serving
    the most streams, then the most requests; the first ready one when none
    serves anything (``max`` keeps the first of equals)."""
    ready = [p for p in pods if p.get("phase") == "ready"]
    return max(ready, key=lambda p: (p.get("streams") or 0, p.get("busy") or 0), default=None)


def pod_unroutable(pods: Sequence[PodView], name: str, generation: int) -> PodView | None:
    """The pod ``name`` once the gateway no longer routes to it under
    ``generation``: not ready, back under a later generation (dead and
    revived between two looks), or gone from the list."""
    for p in pods:
        if p.get("name") == name:
            later = (p.get("generation") or 0) > generation
            return p if p.get("phase") != "ready" or later else None
    return {"name": name, "phase": "removed", "reason": "removed"}


def fleet_armed(pods: Sequence[PodView], engines: Mapping[str, Sequence[Engine]]) -> bool:
    """Every pod of the fleet ready in the gateway's eyes and armed inside
    (its own Active engine and a Standby): it can take the next fault."""
    ready = {p.get("name") for p in pods if p.get("phase") == "ready"}
    return all(name in ready and armed(es) is not None for name, es in engines.items())


# --- the requests ----------------------------------------------------------------


def first_served(samples: Iterable[Sample], t_kill: float) -> Sample | None:
    """The first request started after the kill to end well: the pod serves again."""
    done = [s for s in samples if s.ok and s.start >= t_kill]
    return min(done, key=lambda s: s.end) if done else None


def client_gap(samples: Iterable[Sample], t_kill: float, served: Sample) -> float:
    """The gap clients see: the longest stretch from the kill on in which no
    request completed, up to the first request that started after the kill.
    Under load the pod answers every few milliseconds, so a failover shows as
    a hole in that stream of completions."""
    ends = sorted(s.end for s in samples if s.ok and t_kill <= s.end <= served.end)
    return max(b - a for a, b in itertools.pairwise([t_kill, *ends, served.end]))


def steady_gap(samples: Iterable[Sample], t0: float, t1: float) -> float | None:
    """The longest stretch between two successful completions inside
    ``[t0, t1]``, with nothing killed: what the clients wait between answers
    anyway. A failover's gap reads against it: with a model that takes
    seconds per answer, answers are seconds apart without any failover."""
    ends = sorted(s.end for s in samples if s.ok and t0 <= s.end <= t1)
    return max((b - a for a, b in itertools.pairwise(ends)), default=None)


def failed_between(samples: Iterable[Sample], t0: float, t1: float) -> int:
    return sum(1 for s in samples if not s.ok and t0 <= s.end <= t1)


def longest_gap(samples: Sequence[Sample], t_kill: float) -> float | None:
    """The longest stretch without a successful answer from the kill to the
    last request's end (so requests that failed at the end count)."""
    if not samples:
        return None
    t_end = max(s.end for s in samples)
    ends = [t_kill, *sorted(s.end for s in samples if s.ok and s.end >= t_kill), t_end]
    return max((b - a for a, b in itertools.pairwise(ends)), default=None)


@dataclass(frozen=True, slots=True)
class EngineChanges:
    """What became of the engines across a fault, container by container."""

    restarts: int  # containers whose engine is another process than before
    reloads: int  # of those, engines that loaded the weights from the checkpoint
    readoptions: int  # times the engines gave their weights back to a restarted GMS


def engine_changes(before: Iterable[Engine], after: Iterable[Engine]) -> EngineChanges:
    """Compare two snapshots of every engine's ``/state`` (one per container)."""
    old = {e.get("name"): e for e in before}
    restarts = reloads = readoptions = 0
    for e in after:
        was = old.get(e.get("name"))
        if was is None:
            continue
        if e.get("engine_id") != was.get("engine_id"):
            restarts += 1
            reloads += bool((e.get("weights") or {}).get("loaded"))
        else:
            readoptions += (e.get("readoptions") or 0) - (was.get("readoptions") or 0)
    return EngineChanges(restarts, reloads, readoptions)


def gaps_between_kills(samples: Sequence[Sample], kills: Sequence[float]) -> list[float | None]:
    """The longest stretch without a successful answer after each kill, up to
    the next kill (or the last request's end)."""
    out: list[float | None] = []
    for t_kill, t_next in itertools.zip_longest(kills, kills[1:]):
        window = [s for s in samples if t_next is None or s.end <= t_next]
        out.append(longest_gap(window, t_kill))
    return out


# --- armed or not, over time -------------------------------------------------------


def unarmed_spans(
    timeline: Sequence[tuple[float, int]], start: float, end: float
) -> list[tuple[float, float]]:
    """The stretches of ``[start, end]`` with no Standby engine, from the
    watcher's timeline of ``(time, standbys)`` changes (times rising; a change
    before ``start`` counts from ``start``). Unarmed is what a second death
    would find: no shadow to take over, so a full outage and a cold start."""
    spans: list[tuple[float, float]] = []
    since: float | None = None
    for at, standbys in timeline:
        t = min(max(at, start), end)
        if standbys == 0 and since is None:
            since = t
        elif standbys > 0 and since is not None:
            spans.append((since, t))
            since = None
    if since is not None and end > since:
        spans.append((since, end))
    return spans


def unarmed_figures(spans: Sequence[tuple[float, float]], observed_s: float) -> dict[str, Any]:
    lengths = [b - a for a, b in spans]
    return {
        "unarmed_s": sum(lengths),
        "unarmed_spans": len(lengths),
        "unarmed_longest_s": max(lengths, default=0.0),
        "unarmed_fraction": sum(lengths) / observed_s if observed_s > 0 else 0.0,
    }
