"""``understudy drill --sidecar front``: kill the front's process under load, N times.

The pod's serving socket outlives the front (the lock server keeps it, and
hands it to each front that starts), so a front's death refuses no
connection: new ones wait in the socket's queue for the next front. The
connections the front had accepted outlive it too: the lock server keeps a
copy of each (``wire.connhold``), and the next front finishes each one from
the dead front's record of it (``front.connlog``): a stream goes on from its
client's last token, an answer the kernel never took is written again. So a
front's death fails nothing.

Per kill: what the next front reports lost (``understudy_front_lost_requests_total``
and ``…_lost_idle_connections_total``: the dead front's connections that were
not kept, which is none while the lock server keeps them), the clients'
failures after the kill (must be none), refused connections, the gap (the
kill to the first answer to a request sent after it) and the next front's
start (its exec to accepting). Exit status 1 on any failure, a wrong answer,
or a front that did not come back.
"""

from __future__ import annotations

import functools
import http.client
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Protocol

from understudy.tools.drill_load import Client
from understudy.tools.drill_sidecar import settled_under_load
from understudy.tools.drill_target import Target
from understudy.tools.series import Sample

LOST = "understudy_front_lost_requests_total"
IDLE_LOST = "understudy_front_lost_idle_connections_total"


class FrontTarget(Target, Protocol):
    def front_status_urls(self) -> list[str]:
        """Each pod's front status port (``http://host:port``)."""
        ...

    def kill_fronts(self) -> list[int]:
        """SIGKILL each pod's front process (not its respawner); the pids."""
        ...


def scrape(url: str, timeout: float = 1.0) -> dict[str, float] | None:
    """A front's unlabelled metrics, or None while it does not answer."""
    parsed = urllib.parse.urlsplit(url)
    try:
        conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port, timeout=timeout)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
    except (OSError, http.client.HTTPException):
        return None
    if resp.status != 200:
        return None
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            out[name] = float(value)
    return out


def _total(target: FrontTarget, name: str) -> float | None:
    found = [scrape(u) for u in target.front_status_urls()]
    if any(m is None or name not in m for m in found):
        return None
    return sum(m[name] for m in found if m is not None)


def _took_over(target: FrontTarget, restarts: float) -> float | None:
    """The restart count once the next front took over (it moved on), else None."""
    now = _total(target, "understudy_front_restarts_total")
    return now if now is not None and now > restarts else None


def _answered_since(pool: list[Client], t: float) -> bool | None:
    return True if any(s.ok and s.start >= t for c in pool for s in c.samples) else None


def _wait(cond: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := cond()) is not None:
            return value
        time.sleep(0.01)
    return None


def front_drill(
    target: FrontTarget,
    kills: int = 5,
    clients: int = 16,
    *,
    timeout: float = 60.0,
    pause: float = 1.0,
) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    with settled_under_load(target, clients, timeout) as (watcher, pool):
        for _ in range(kills):
            time.sleep(pause)
            lost = _wait(lambda: _total(target, LOST), timeout)
            idle = _total(target, IDLE_LOST) or 0.0
            restarts = _total(target, "understudy_front_restarts_total") or 0.0
            t_kill = time.monotonic()
            pids = target.kill_fronts()
            after = _wait(functools.partial(_took_over, target, restarts), timeout)
            # Answers flow again before the next kill (a long request started
            # during the restart must not be in every kill's count).
            _wait(functools.partial(_answered_since, pool, t_kill), timeout)
            rounds.append(
                {
                    "t_kill": t_kill,
                    "killed": pids,
                    "back": after is not None,
                    "in_flight": (_total(target, LOST) or 0.0) - (lost or 0.0),
                    "idle": (_total(target, IDLE_LOST) or 0.0) - idle,
                    "front_start_s": _total(target, "understudy_front_start_seconds"),
                }
            )
        time.sleep(pause)
    return _judge(rounds, [s for c in pool for s in c.samples], len(watcher.split_brain))


def _judge(rounds: list[dict[str, Any]], samples: list[Sample], split_brain: int) -> dict[str, Any]:
    """Attribute every failure to the kill before it, and judge (pure)."""
    kills = [r["t_kill"] for r in rounds]
    for i, r in enumerate(rounds):
        end = kills[i + 1] if i + 1 < len(kills) else float("inf")
        mine = [s for s in samples if r["t_kill"] <= s.end < end]
        failed = [s for s in mine if not s.ok]
        # A request that began after the kill waited in the socket's queue:
        # the first of them answered is the wait a new request saw.
        first_ok = min((s.end for s in mine if s.ok and s.start >= r["t_kill"]), default=None)
        r["failed"] = len(failed)
        r["refused"] = sum(1 for s in failed if s.error == "ConnectionRefusedError")
        r["errors"] = sorted({s.error for s in failed})
        # when each failure began and ended against the kill, and where
        r["failures"] = [
            f"{s.error} {s.detail}: {s.start - r['t_kill']:+.3f}..{s.end - r['t_kill']:+.3f} s"
            for s in failed
        ]
        r["gap_s"] = None if first_ok is None else first_ok - r["t_kill"]
    before_first = [s for s in samples if not s.ok and (not kills or s.end < kills[0])]
    wrong = {k: n for k, n in _answers(samples).items() if n > 1}
    # The front's connections outlive it (the lock server keeps them: issue
    # 30): its death fails nothing, whatever was in flight.
    passed = (
        all(r["back"] and r["failed"] == 0 for r in rounds)
        and not before_first
        and not wrong
        and not split_brain
    )
    return {
        "sidecar": "front",
        "kills": len(rounds),
        "requests": len(samples),
        "failed": sum(r["failed"] for r in rounds) + len(before_first),
        "refused": sum(r["refused"] for r in rounds),
        "reported_in_flight": sum(r["in_flight"] for r in rounds),
        "reported_idle": sum(r["idle"] for r in rounds),
        "different_answers": wrong,
        "split_brain": split_brain,
        "rounds": [{k: v for k, v in r.items() if k != "t_kill"} for r in rounds],
        "passed": passed,
    }


def _answers(samples: list[Sample]) -> dict[str, int]:
    """Distinct answers per kind of request (greedy: one each)."""
    by: dict[str, set[str]] = {}
    for s in samples:
        if s.ok:
            by.setdefault(s.kind, set()).add(s.digest)
    return {k: len(v) for k, v in by.items()}


def render(result: dict[str, Any]) -> str:
    lines = [
        "kill  in flight  idle  failed  refused  gap ms  front start ms  errors",
    ]
    for i, r in enumerate(result["rounds"], 1):
        gap = "-" if r["gap_s"] is None else f"{r['gap_s'] * 1000:.0f}"
        start = "-" if r["front_start_s"] is None else f"{r['front_start_s'] * 1000:.0f}"
        lines.append(
            f"{i:>4}  {r['in_flight']:>9g}  {r['idle']:>4g}  {r['failed']:>6}  "
            f"{r['refused']:>7}  {gap:>6}  "
            f"{start:>14}  {', '.join(r['errors']) or '-'}"
        )
        lines.extend(f"      {f}" for f in r.get("failures", ()))
    lines.append(
        f"{result['requests']} requests, {result['failed']} failed, the dead fronts' "
        f"connections not kept: {result['reported_in_flight']:g} busy and "
        f"{result['reported_idle']:g} idle, {result['refused']} refused, "
        f"split-brain {result['split_brain']}, answers that differ: "
        f"{result['different_answers'] or 'none'}"
    )
    lines.append("PASS" if result["passed"] else "FAIL")
    return "\n".join(lines)
