"""A kill drill's result: each ``Round`` as measured, the ``Report`` over
them, its summary (the figures' percentiles), the text a terminal shows
(``render``) and the JSON ``--output`` writes (``to_json``); the HTML page is
``report``'s."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from understudy.tools.figures import stats, verdict


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
            "clients": self.clients,
            "requests_by_kind": self.by_kind,
            "gap_s": stats(col("gap_s")),
            "steady_gap_s": stats(col("steady_gap_s")),
            "first_served_s": stats(col("first_served_s")),
            "kill_to_grant_s": stats(col("kill_to_grant_s")),
            "grant_to_active_s": stats(col("grant_to_active_s")),
            "kill_to_active_s": stats(col("kill_to_active_s")),
            "rearm_s": stats(col("rearm_s")),
            **self.unarmed,
        }

    def passed(self) -> bool:
        return verdict(self.summary())


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def round_line(r: Round) -> str:
    return (
        f"round {r.index:>3}: SIG{r.signal} {r.killed}"
        + (f" + {r.also_killed}" if r.also_killed else "")
        + f" (epoch {r.killed_epoch}) -> {r.new_active} "
        f"(epoch {r.new_epoch}): kill->grant {_ms(r.kill_to_grant_s)} ms, grant->active "
        f"{_ms(r.grant_to_active_s)} ms, client gap {_ms(r.gap_s)} ms, failed "
        f"{r.failed_requests}, re-arm {_ms(r.rearm_s)} ms"
    )


def render(report: Report) -> str:
    s = report.summary()
    lines = [
        f"\ndrill: {s['kills']} kills (SIG{s['signal']}), {s['failovers_ok']} failovers, "
        f"{s['requests']} requests, {s['failed_requests']} failed, "
        f"{s['wrong_answers']} wrong answers, {s['split_brain']} split-brain, "
        f"{s['epoch_regressions']} epoch regressions, "
        f"{s['serving_violations']} serving violations ({s['clients']} clients)",
        f"{'':22} {'p50':>9} {'p95':>9} {'p99':>9} {'max':>9}  (ms)",
    ]
    for key, label in (
        ("gap_s", "client-observed gap"),
        ("steady_gap_s", "gap, no failover"),
        ("first_served_s", "first new request done"),
        ("kill_to_grant_s", "kill -> lock granted"),
        ("grant_to_active_s", "granted -> Active"),
        ("kill_to_active_s", "kill -> Active"),
        ("rearm_s", "re-arm (Standby)"),
    ):
        st = s[key]
        if st:
            lines.append(
                f"{label:22} {_ms(st['p50']):>9} {_ms(st['p95']):>9} "
                f"{_ms(st['p99']):>9} {_ms(st['max']):>9}"
            )
    if "unarmed_s" in s:
        lines.append(
            f"pod unarmed (no Standby): {s['unarmed_s']:.1f} s in {s['unarmed_spans']} "
            f"stretches, longest {s['unarmed_longest_s']:.1f} s "
            f"({100 * s['unarmed_fraction']:.0f} % of the drill)"
        )
    lines.append("PASS" if report.passed() else "FAIL")
    return "\n".join(lines)


def to_json(report: Report, *, series: bool = False) -> dict[str, Any]:
    """The drill's JSON; with ``series``, also every request (thinned out in a
    long drill: see request_series) for ``understudy drill --report``."""
    out = {
        "summary": report.summary(),
        "errors": report.errors,
        "rounds": [asdict(r) for r in report.rounds],
        "split_brain": report.split_brain,
        "epoch_regressions": report.epoch_regressions,
    }
    if series:
        out["series"] = report.series
    return out
