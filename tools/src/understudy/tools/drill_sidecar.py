"""``understudy drill --sidecar lockserver|gms``: kill a sidecar under load.

The lock server's death must cause no failover (the holder resumes its grant:
same engine, same epoch); GMS's neither (the Active engine serves on from its
mappings and gives them back to the restarted GMS). ``settled_under_load`` is
the stage this drill and the front's (``drill_front``) share.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from understudy.tools import figures
from understudy.tools.drill_load import Client, kinds_for
from understudy.tools.drill_target import Target
from understudy.tools.drill_watch import Watcher
from understudy.tools.figures import stats

SIDECAR_COMMANDS = {"lockserver": "lockserver serve", "gms": "gms serve"}


def _sidecar_kill(
    target: Any, which: str, watcher: Watcher, timeout: float, settle: float
) -> dict[str, Any]:
    """One kill of the sidecar; watch through ``settle`` (past the lock
    server's reconnect window): when the pod stopped being armed, and when it
    was armed again; what became of the engines."""
    engines_before = watcher.snapshot()
    before = figures.settled(engines_before)
    t_kill = time.monotonic()
    killed = target.kill_sidecar(which)
    unarmed_at: float | None = None
    rearmed_at: float | None = None
    while time.monotonic() - t_kill < settle or (unarmed_at and not rearmed_at):
        if time.monotonic() - t_kill > timeout:
            break
        now, ok_now = time.monotonic(), figures.settled(watcher.snapshot()) is not None
        if not ok_now and unarmed_at is None:
            unarmed_at = now
        elif ok_now and unarmed_at is not None and rearmed_at is None:
            rearmed_at = now
        time.sleep(0.01)
    # Then until the weights are given back (or the limit), so that the engines'
    # figures are read from the finished outcome.
    watcher.until(figures.whole, max(0.0, timeout - (time.monotonic() - t_kill)))
    engines_after = watcher.snapshot()
    after = figures.settled(engines_after)
    changed = figures.engine_changes(engines_before, engines_after)
    return {
        "t_kill": t_kill,
        "killed_pids": killed,  # on the node: which process the round killed
        "failover": before is None
        or after is None
        or (after.get("engine_id"), after.get("epoch"))
        != (before.get("engine_id"), before.get("epoch")),
        "active_before": {k: before.get(k) for k in ("name", "engine_id", "epoch")}
        if before
        else None,
        "active_after": {k: after.get(k) for k in ("name", "engine_id", "epoch")}
        if after
        else None,
        "recovered_s": (
            0.0 if unarmed_at is None else (rearmed_at - t_kill if rearmed_at is not None else None)
        ),
        # GMS: re-adoption means no engine restarts and nothing reloads
        "engine_restarts": changed.restarts,
        "checkpoint_reads": changed.reloads,
        "readoptions": changed.readoptions,
    }


@contextlib.contextmanager
def settled_under_load(
    target: Target, clients: int, timeout: float
) -> Iterator[tuple[Watcher, list[Client]]]:
    """A sidecar drill's stage: a watcher on the pod and ``clients`` request
    streams, started once the pod is settled, all stopped on the way out."""
    watcher = Watcher(target)
    watcher.start()
    pool: list[Client] = []
    try:
        first = watcher.until(figures.settled, timeout)
        if first is None:
            raise RuntimeError(f"pod not armed within {timeout}s")
        kinds = kinds_for(first.get("adapter", "reference"))
        pool = [Client(target.serve_url, kinds, i) for i in range(clients)]
        for c in pool:
            c.start()
        yield watcher, pool
    finally:
        for c in pool:
            c.stop.set()
        for c in pool:
            c.join(5)
        watcher.stop.set()
        watcher.join(5)


def sidecar_drill(
    target: Any,
    which: str,
    *,
    timeout: float = 120.0,
    settle: float = 5.0,
    clients: int = 1,
    kills: int = 1,
) -> dict[str, Any]:
    """Kill a sidecar (``lockserver`` or ``gms``) ``kills`` times under the
    request stream, each time once the pod is settled again.

    Expected outcomes: the lock server's death causes no failover (the holder
    resumes its grant, same engine, same epoch); GMS's death neither: the
    Active engine serves on from its mappings and gives them back to the
    restarted GMS (no engine restarts, nothing is read from the checkpoint).
    Reports what happened rather than judging it; the top-level figures are
    over every kill (the first kill's fields as they were, for one kill).
    """
    rounds: list[dict[str, Any]] = []
    with settled_under_load(target, clients, timeout) as (watcher, pool):
        time.sleep(0.5)
        for _ in range(kills):
            if watcher.until(figures.whole, timeout) is None:
                break
            time.sleep(0.5)  # steady traffic before the kill
            rounds.append(_sidecar_kill(target, which, watcher, timeout, settle))
        time.sleep(0.5)
    samples = [s for c in pool for s in c.samples]
    t_first = rounds[0]["t_kill"] if rounds else time.monotonic()
    after_kill = [s for s in samples if s.start >= t_first]
    gaps = figures.gaps_between_kills(samples, [r["t_kill"] for r in rounds])
    for r, gap in zip(rounds, gaps, strict=True):
        r["longest_gap_s"] = gap
        r["kill_at_s"] = r.pop("t_kill") - t_first
    last = rounds[-1] if rounds else {}
    return {
        "sidecar": which,
        "kills": len(rounds),
        "failover": any(r["failover"] for r in rounds),
        "active_before": rounds[0]["active_before"] if rounds else None,
        "active_after": last.get("active_after"),
        "recovered_s": max((r["recovered_s"] for r in rounds), default=None, key=_none_last),
        "longest_gap_s": max((g for g in gaps if g is not None), default=None),
        "gap_s": stats([g for g in gaps if g is not None]),
        "requests_after_kill": len(after_kill),
        "failed_after_kill": sum(1 for s in after_kill if not s.ok),
        "distinct_answers": len({s.digest for s in samples if s.ok}),
        "split_brain": len(watcher.split_brain),
        "engine_restarts": sum(r["engine_restarts"] for r in rounds),
        "checkpoint_reads": sum(r["checkpoint_reads"] for r in rounds),
        "readoptions": sum(r["readoptions"] for r in rounds),
        "rounds": rounds,
    }


def _none_last(value: float | None) -> float:
    """Order recovery times with "never recovered" above every number."""
    return float("inf") if value is None else value
