"""A kill drill's result: each ``Round`` as measured, the ``Report`` over
them, its summary (the figures' percentiles), the text a terminal shows
(``render``) and the JSON ``--output`` writes (``to_json``); the HTML page is
``report``'s.

Both lead with a stream's own stall at a kill against the same streams' time
between tokens (``headline``): what a reader of a streamed answer feels.
"Longest with no request completed" (``gap_s``) follows as a secondary row:
on a model whose answers take seconds it is seconds with or without a kill.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

from understudy.tools.figures import stats, verdict
from understudy.tools.stalls import Stall


@dataclass
class Round:
    index: int
    killed: str
    killed_pid: int
    killed_epoch: int
    killed_engine_id: str = ""
    signal: str = ""
    also_killed: str = ""  # what the scenario killed on top (an engine or a sidecar)
    new_active: str = ""
    new_epoch: int = 0
    kill_to_grant_s: float | None = None
    grant_to_active_s: float | None = None
    kill_to_active_s: float | None = None
    gap_s: float | None = None
    first_served_s: float | None = None  # kill -> end of the first request started after it
    # The longest wait between answers in the STEADY_S before the kill (no failover)
    steady_gap_s: float | None = None
    failed_requests: int = 0
    rearm_s: float | None = None
    serving_ok: bool | None = None  # only the new Active engine listens for requests
    error: str = ""
    kill_at_s: float | None = None  # when the kill was sent, seconds since the clients started
    # each stream this kill caught between two of its tokens: its stall
    stalls_s: list[float] = field(default_factory=list)
    # A fleet's round (drill_fleet: a pod killed or frozen whole): the fault ->
    # the gateway's /state no longer has the pod ready, and why it said so
    detect_s: float | None = None
    reason: str = ""
    # A fleet's round: ``killed`` is a pod, its epochs are the gateway's
    # generations of it
    whole_pod: bool = False


@dataclass
class Report:
    rounds: list[Round] = field(default_factory=list)
    requests: int = 0
    failed_requests: int = 0
    wrong_answers: int = 0
    split_brain: list[dict[str, Any]] = field(default_factory=list)
    epoch_regressions: list[dict[str, Any]] = field(default_factory=list)
    signal: str = "KILL"
    clients: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)  # request_series()
    # No Standby at all: what a second death would have found (figures.unarmed_figures)
    unarmed: dict[str, Any] = field(default_factory=dict)
    # The streams the kills caught (series.Tally): stalls, and their other
    # intervals between tokens
    stalls: list[Stall] = field(default_factory=list)
    between: list[float] = field(default_factory=list)
    # The poison request (drill --poison), apart from the failures: what it
    # was answered (drill_load.Poisoner.result)
    poison: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def col(name: str) -> list[float]:
            return [v for r in self.rounds if (v := getattr(r, name)) is not None]

        return {
            "kills": len(self.rounds),
            "signal": self.signal,
            "failovers_ok": sum(1 for r in self.rounds if not r.error),
            "requests": self.requests,
            "failed_requests": self.failed_requests,
            "wrong_answers": self.wrong_answers,
            "split_brain": len(self.split_brain),
            "epoch_regressions": len(self.epoch_regressions),
            "serving_violations": sum(1 for r in self.rounds if r.serving_ok is False),
            "unplanned_failovers": unplanned_failovers(self.rounds),
            "clients": self.clients,
            "requests_by_kind": self.by_kind,
            "streams_caught": len(self.stalls),
            "stall_s": stats([x.stall_s for x in self.stalls]),
            "tpot_s": stats(self.between),
            "gap_s": stats(col("gap_s")),
            "steady_gap_s": stats(col("steady_gap_s")),
            "first_served_s": stats(col("first_served_s")),
            "kill_to_grant_s": stats(col("kill_to_grant_s")),
            "grant_to_active_s": stats(col("grant_to_active_s")),
            "kill_to_active_s": stats(col("kill_to_active_s")),
            "rearm_s": stats(col("rearm_s")),
            "detect_s": stats(col("detect_s")),
            **self.unarmed,
            "poison_sent": self.poison.get("sent", 0),
            "poison_told": self.poison.get("told", 0),
        }

    def passed(self) -> bool:
        return verdict(self.summary())


def unplanned_failovers(rounds: list[Round]) -> int:
    """Rounds that found the lock moved since the last one's takeover: an
    engine died, or was killed as hung, without the drill's asking (in a
    fleet's drill: the same pod taken again under a newer generation than it
    came back with). Not a loss by itself, but it leaves the pod a standby
    short."""
    return sum(
        1
        for prev, r in itertools.pairwise(rounds)
        if prev.new_epoch and r.killed_epoch and not prev.also_killed and not prev.error
        and (not r.whole_pod or r.killed == prev.new_active)
        and r.killed_epoch != prev.new_epoch
    )  # fmt: skip


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def round_line(r: Round) -> str:
    return (
        f"round {r.index:>3}: SIG{r.signal} {r.killed}"
        + (f" + {r.also_killed}" if r.also_killed else "")
        + f" (epoch {r.killed_epoch}) -> {r.new_active} "
        f"(epoch {r.new_epoch}): kill->grant {_ms(r.kill_to_grant_s)} ms, grant->active "
        f"{_ms(r.grant_to_active_s)} ms, no request completed for {_ms(r.gap_s)} ms, failed "
        f"{r.failed_requests}, re-arm {_ms(r.rearm_s)} ms"
    )


def pod_round_line(r: Round) -> str:
    """A fleet's round: the pod, how the gateway found it, what the clients saw."""
    return (
        f"round {r.index:>3}: SIG{r.signal} {r.killed} (generation {r.killed_epoch}): "
        f"unroutable after {_ms(r.detect_s)} ms ({r.reason or '-'}), "
        f"no request completed for {_ms(r.gap_s)} ms, "
        f"failed {r.failed_requests}, fleet re-armed after {_ms(r.rearm_s)} ms"
    )


# The summary's rows, the stream's own figures first (their JSON keys are
# kept: gap_s is what the chaos tests bound)
ROWS = (
    ("stall_s", "a stream's stall at a kill"),
    ("tpot_s", "the same streams' time between tokens"),
    ("kill_to_active_s", "kill -> Active"),
    ("kill_to_grant_s", "kill -> lock granted"),
    ("grant_to_active_s", "granted -> Active"),
    ("gap_s", "longest time with no request completed"),
    ("steady_gap_s", "  the same before the kill (no failover)"),
    ("first_served_s", "first new request done"),
    ("rearm_s", "re-arm (Standby; a fleet: every pod)"),
    ("detect_s", "fault -> pod unroutable (gateway)"),
)


def headline(s: dict[str, Any]) -> str:
    """A failover's cost as a reader of a stream feels it, in one sentence."""
    if "stall_s" not in s:  # the JSON of a drill from before streams were timed
        return "this drill did not time its streams' tokens"
    stall, tpot = s["stall_s"], s.get("tpot_s")
    if not stall or not tpot:
        return "no stream was caught by a kill between two of its tokens"
    return (
        f"a stream's stall at a kill (its last token before -> first after): "
        f"p50 {_ms(stall['p50'])}, p99 {_ms(stall['p99'])}, max {_ms(stall['max'])} ms; "
        f"the same streams' time between tokens: p50 {_ms(tpot['p50'])}, "
        f"p99 {_ms(tpot['p99'])}, max {_ms(tpot['max'])} ms "
        f"({s.get('streams_caught', stall['n'])} streams caught in {s['kills']} kills)"
    )


def render(report: Report) -> str:
    s = report.summary()
    lines = [
        f"\ndrill: {headline(s)}",
        f"{s['kills']} kills (SIG{s['signal']}), {s['failovers_ok']} failovers, "
        f"{s['requests']} requests, {s['failed_requests']} failed, "
        f"{s['wrong_answers']} wrong answers, {s['split_brain']} split-brain, "
        f"{s['epoch_regressions']} epoch regressions, "
        f"{s['serving_violations']} serving violations ({s['clients']} clients)",
        *(_poison_line(report.poison) if report.poison else []),
        f"{'':40} {'p50':>9} {'p95':>9} {'p99':>9} {'max':>9}  (ms)",
    ]
    for key, label in ROWS:
        st = s[key]
        if st:
            lines.append(
                f"{label:40} {_ms(st['p50']):>9} {_ms(st['p95']):>9} "
                f"{_ms(st['p99']):>9} {_ms(st['max']):>9}"
            )
    if "unarmed_s" in s:
        lines.append(
            f"pod unarmed (no Standby): {s['unarmed_s']:.1f} s in {s['unarmed_spans']} "
            f"stretches, longest {s['unarmed_longest_s']:.1f} s "
            f"({100 * s['unarmed_fraction']:.0f} % of the drill)"
        )
    if s["unplanned_failovers"]:
        lines.append(
            f"failovers the drill did not cause: {s['unplanned_failovers']} "
            "(an engine died or was killed as hung between rounds)"
        )
    lines.append("PASS" if report.passed() else "FAIL")
    return "\n".join(lines)


def _poison_line(p: dict[str, Any]) -> list[str]:
    told = "told as the poison" if p.get("told") else "NOT told as the poison"
    answer = p.get("error") or f"HTTP {p.get('status')} after {p.get('seconds', 0):.2f} s"
    return [f"poison: {p.get('sent', 0)} sent, {told} ({answer}: {p.get('message', '')!r})"]


def to_json(report: Report, *, series: bool = False) -> dict[str, Any]:
    """The drill's JSON; with ``series``, also every request (thinned out in a
    long drill: see request_series) for ``understudy drill --report``."""
    out = {
        "summary": report.summary(),
        "errors": report.errors,
        "rounds": [asdict(r) for r in report.rounds],
        "split_brain": report.split_brain,
        "epoch_regressions": report.epoch_regressions,
        "poison": report.poison,
    }
    if series:
        out["series"] = report.series
    return out
