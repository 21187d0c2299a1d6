"""A drill's report as pictures: an HTML page and PNG charts drawn with matplotlib.

Data in, files out: ``write_report(result, out_dir)`` takes the drill's JSON
(``understudy drill --output``'s, with the per-request ``series`` when there
is one) and writes ``index.html`` plus the PNGs it shows, next to it. Nothing
here runs a drill or reads a pod, so a committed JSON can be rendered again
(``understudy drill --from FILE --report DIR``).

The charts:

- ``stalls.png``: each stream's stall at each kill (its last token before →
  its first after), round by round, against the same streams' time between
  tokens (p50 and p99): a failover's cost as a reader of a stream feels it;
- ``latency.png``: every request's latency at the time it completed, streaming
  and non-streaming apart, failures as red crosses, each kill a vertical line
  and the gap after it shaded;
- ``around-kills.png``: the same, every round laid over the others with the
  kill at 0: the gap is the empty stretch after 0, the requests the front held
  through it land together at its end;
- ``gaps.png``: the distribution of the longest time with no request
  completed after each kill (histogram and CDF, p50 and p99 marked);
- ``phases.png``: each round's phases stacked: detection (kill → lock
  granted), wake (granted → Active), serve (Active → the first request sent
  after the kill done), re-arm (the killed engine back in Standby).

matplotlib is an optional extra (``understudy-tools[report]``); the Agg
backend draws without a display.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from understudy.tools.drill_result import headline
from understudy.tools.figures import percentile, stats, verdict

CHARTS = ("stalls.png", "latency.png", "around-kills.png", "gaps.png", "phases.png")
AROUND_KILL_S = (-0.5, 1.5)  # stretched to 1.5 × the longest gap (at most MAX_AROUND_S)
MAX_AROUND_S = 10.0
DPI = 100

STREAMING, PLAIN, FAILED, KILL = "tab:blue", "tab:orange", "tab:red", "tab:red"
SIGNAL_COLORS = ("tab:blue", "tab:purple", "tab:olive", "tab:cyan", "tab:brown")
PHASES = (
    ("detection", "kill → lock granted", "tab:red"),
    ("wake", "granted → Active", "tab:orange"),
    ("serve", "Active → first new request done", "tab:green"),
    ("re-arm", "… → killed engine back in Standby", "tab:gray"),
)


class ReportUnavailable(RuntimeError):
    """matplotlib is not installed."""


def check_available() -> None:
    """Raise ReportUnavailable, saying what to install, if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportUnavailable(
            "drill reports need matplotlib: pip install 'understudy-tools[report]'"
        ) from None


def write_report(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write index.html and its charts into ``out_dir``; return the files written."""
    check_available()
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = list(result.get("rounds", []))
    summary = result.get("summary", {})
    series = result.get("series") or None
    written: list[Path] = []
    if any(r.get("stalls_s") for r in rounds):
        written.append(stalls_chart(rounds, summary, out_dir / "stalls.png"))
    if series and series.get("rows"):
        written.append(latency_chart(series, rounds, out_dir / "latency.png"))
        written.append(around_kills_chart(series, rounds, out_dir / "around-kills.png"))
    written.append(gap_chart(rounds, summary, out_dir / "gaps.png"))
    written.append(phases_chart(rounds, out_dir / "phases.png"))
    page = out_dir / "index.html"
    page.write_text(render_html(result, [p.name for p in written]))
    return [page, *written]


# -- data -------------------------------------------------------------------


def _ms(v: float | None) -> float:
    return 0.0 if v is None else v * 1000.0


def _rows(series: dict[str, Any]) -> list[tuple[float, float, bool, bool]]:
    """(completed_s, latency_s, streaming, ok) for every row of the series."""
    kinds = series.get("kinds", [])
    out = []
    for start, latency, kind, ok in series["rows"]:
        streaming = bool(0 <= kind < len(kinds) and kinds[kind].get("streaming"))
        out.append((start + latency, latency, streaming, bool(ok)))
    return out


def by_signal(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The drill's percentiles again, for the rounds of each signal apart (a
    hang is detected in a second, a death in milliseconds: mixed, their
    percentiles say little). Empty when every round had the same signal."""
    signals = sorted({r["signal"] for r in rounds if r.get("signal")})
    if len(signals) < 2:
        return {}
    return {
        sig: {
            key: stats(
                [r[key] for r in rounds if r.get("signal") == sig and r.get(key) is not None]
            )
            for key, _ in STATS
        }
        for sig in signals
    }


def phases(rnd: dict[str, Any]) -> dict[str, float]:
    """A round's phases in ms, each from where the previous one ended; a phase
    the drill did not measure is 0. Serve and re-arm are clamped at 0: a held
    request can complete before the new engine reports Active, and a fast
    restart can be back before the first new request is done."""
    detect = _ms(rnd.get("kill_to_grant_s"))
    wake = _ms(rnd.get("grant_to_active_s"))
    active = detect + wake
    served = _ms(rnd.get("first_served_s"))
    serve = max(0.0, served - active) if rnd.get("first_served_s") is not None else 0.0
    rearm_at = rnd.get("rearm_s")
    rearm = max(0.0, _ms(rearm_at) - (active + serve)) if rearm_at is not None else 0.0
    return {"detection": detect, "wake": wake, "serve": serve, "re-arm": rearm}


# -- charts -----------------------------------------------------------------


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png", pil_kwargs={"optimize": True})
    return path


def _log_ms(ax: Any, label: str) -> None:
    """A log y axis of milliseconds, labelled in plain numbers (2000, not 2×10³)."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_ylabel(label)


def _scatter(ax: Any, points: list[tuple[float, float, bool, bool]], scale: float) -> None:
    """Latency (ms) against completion time (scaled) by kind of request."""

    size = 14 if len(points) < 2000 else 5
    for label, color, streaming in (
        ("streaming", STREAMING, True),
        ("non-streaming", PLAIN, False),
    ):
        chosen = [p for p in points if p[3] and p[2] == streaming]
        if chosen:
            ax.scatter(
                [p[0] * scale for p in chosen],
                [p[1] * 1000 for p in chosen],
                s=size,
                color=color,
                alpha=0.6,
                linewidths=0,
                label=f"{label} ({len(chosen)})",
                rasterized=True,
            )
    failed = [p for p in points if not p[3]]
    if failed:
        ax.scatter(
            [p[0] * scale for p in failed],
            [p[1] * 1000 for p in failed],
            s=18,
            marker="x",
            color=FAILED,
            label=f"failed ({len(failed)})",
        )
    _log_ms(ax, "request latency (ms, log)")
    ax.grid(True, which="major", alpha=0.3)


def stalls_chart(rounds: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    fig = _figure(11, 3.8)
    ax = fig.add_subplot()
    points = [
        (r.get("index", i + 1), v * 1000)
        for i, r in enumerate(rounds)
        for v in r.get("stalls_s") or []
    ]
    ax.scatter(
        [p[0] for p in points],
        [p[1] for p in points],
        s=22,
        color=STREAMING,
        alpha=0.7,
        label=f"a stream's stall at the kill ({len(points)} streams)",
    )
    tpot = summary.get("tpot_s") or {}
    for q, style in (("p50", "--"), ("p99", ":")):
        if q in tpot:
            v = tpot[q] * 1000
            ax.axhline(
                v, color="black", ls=style, lw=1, label=f"time between tokens {q} {v:.0f} ms"
            )
    _log_ms(ax, "ms (log)")
    ax.set_title("Each stream's stall at each kill, against the same streams' time between tokens")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def latency_chart(series: dict[str, Any], rounds: list[dict[str, Any]], path: Path) -> Path:
    fig = _figure(11, 4.2)
    ax = fig.add_subplot()
    points = _rows(series)
    _scatter(ax, points, 1.0)
    first = True
    for r in rounds:
        at = r.get("kill_at_s")
        if at is None:
            continue
        ax.axvline(at, color=KILL, lw=0.7, alpha=0.6, label="kill" if first else None)
        gap = r.get("gap_s")
        if gap:
            ax.axvspan(at, at + gap, color=KILL, alpha=0.15, lw=0)
        first = False
    shown = len(series["rows"])
    total = series.get("total", shown)
    thinned = f"; {shown:,} of {total:,} requests shown" if total > shown else ""
    ax.set_title(f"Request latency over the drill (kills marked{thinned})")
    ax.set_xlabel("request completed at (s since the clients started)")
    ax.legend(loc="upper right", fontsize=8, markerscale=2)
    return _save(fig, path)


def around_kills_chart(series: dict[str, Any], rounds: list[dict[str, Any]], path: Path) -> Path:
    fig = _figure(11, 4.2)
    ax = fig.add_subplot()
    kills = [r["kill_at_s"] for r in rounds if r.get("kill_at_s") is not None]
    gaps = sorted(r["gap_s"] for r in rounds if r.get("gap_s") is not None)
    lo, hi = AROUND_KILL_S
    hi = min(MAX_AROUND_S, max(hi, 1.5 * gaps[-1] if gaps else hi))
    points = []
    for done, latency, streaming, ok in _rows(series):
        for k in kills:
            if k + lo <= done <= k + hi:
                points.append((done - k, latency, streaming, ok))
    _scatter(ax, points, 1000.0)
    ax.axvline(0, color=KILL, lw=1.2, label=f"kill ({len(kills)} rounds overlaid)")
    for q, style in ((50, "--"), (99, ":")):
        if gaps:
            v = percentile(gaps, q) * 1000  # the drill's own definition
            ax.axvline(v, color="black", ls=style, lw=1, label=f"none done p{q} {v:.0f} ms")
    ax.set_xlim(lo * 1000, hi * 1000)
    ax.set_title("Latency around the kills (every round, kill at 0)")
    ax.set_xlabel("request completed at (ms after the kill)")
    ax.legend(loc="upper right", fontsize=8, markerscale=2)
    return _save(fig, path)


def gap_chart(rounds: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> Path:
    fig = _figure(11, 3.8)
    hist, cdf = fig.subplots(1, 2)
    gaps = sorted(r["gap_s"] * 1000 for r in rounds if r.get("gap_s") is not None)
    marks = summary.get("gap_s") or {}
    if gaps:
        # stacked by signal when the drill mixed them: a hang's gap is not a death's
        signals = sorted({r.get("signal") or "?" for r in rounds if r.get("gap_s") is not None})
        groups = [
            [
                r["gap_s"] * 1000
                for r in rounds
                if r.get("gap_s") is not None and (r.get("signal") or "?") == s
            ]
            for s in signals
        ]
        hist.hist(
            groups,
            bins=min(30, max(5, len(gaps) // 2)),
            stacked=True,
            color=[SIGNAL_COLORS[i % len(SIGNAL_COLORS)] for i in range(len(signals))],
            label=[
                f"{'SIG' + s if s != '?' else 'rounds'} ({len(g)})"
                for s, g in zip(signals, groups, strict=True)
            ],
            alpha=0.85,
        )
        cdf.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post")
        cdf.set_ylim(0, 1.02)
    else:
        for ax in (hist, cdf):
            ax.text(0.5, 0.5, "no gaps measured", ha="center", transform=ax.transAxes)
    for key, style in (("p50", "--"), ("p99", ":")):
        if key in marks:
            v = marks[key] * 1000
            for ax in (hist, cdf):
                ax.axvline(v, color="black", ls=style, lw=1, label=f"{key} {v:.1f} ms")
    hist.set_title(f"Longest time with no request completed, per kill ({len(gaps)} rounds)")
    hist.set_xlabel("no request completed (ms)")
    hist.set_ylabel("rounds")
    cdf.set_title("Cumulative")
    cdf.set_xlabel("no request completed (ms)")
    cdf.set_ylabel("fraction of rounds")
    for ax in (hist, cdf):
        ax.grid(True, alpha=0.3)
        if gaps:
            ax.legend(fontsize=8)
    return _save(fig, path)


def phases_chart(rounds: list[dict[str, Any]], path: Path) -> Path:
    fig = _figure(11, 6.4)
    whole, fast = fig.subplots(2, 1, sharex=True)
    index = [r.get("index", i + 1) for i, r in enumerate(rounds)]
    per_round = [phases(r) for r in rounds]
    for ax, names in (
        (whole, [p[0] for p in PHASES]),
        (fast, [p[0] for p in PHASES[:3]]),
    ):
        bottom = [0.0] * len(rounds)
        for name, label, color in PHASES:
            if name not in names:
                continue
            values = [p[name] for p in per_round]
            ax.bar(index, values, bottom=bottom, color=color, label=f"{name}: {label}", width=0.8)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("ms since the kill")
        ax.grid(True, axis="y", alpha=0.3)
    gaps = [(i, r["gap_s"] * 1000) for i, r in zip(index, rounds, strict=True) if r.get("gap_s")]
    if gaps:
        fast.scatter(
            [g[0] for g in gaps],
            [g[1] for g in gaps],
            marker="_",
            s=120,
            color="black",
            label="longest with no request completed",
            zorder=3,
        )
    failed = [i for i, r in zip(index, rounds, strict=True) if r.get("error")]
    for i in failed:
        whole.annotate("✗", (i, 0), ha="center", va="bottom", color="red")
    whole.set_title("Per-round phases, stacked (re-arm runs from the serve's end)")
    fast.set_title("The same without re-arm: what a client waits through")
    # one legend for both panels, above them: inside, it would hide bars
    handles, labels = whole.get_legend_handles_labels()
    more = [
        (h, lb) for h, lb in zip(*fast.get_legend_handles_labels(), strict=True) if lb not in labels
    ]
    fig.legend(
        [*handles, *(h for h, _ in more)],
        [*labels, *(lb for _, lb in more)],
        loc="outside upper center",
        ncols=3,
        fontsize=8,
    )
    fast.set_xlabel("round (and its signal)")
    if len(index) <= 40:
        fast.set_xticks(
            index, [f"{i}\n{r.get('signal', '')}" for i, r in zip(index, rounds, strict=True)]
        )
        fast.tick_params(axis="x", labelsize=7)
    return _save(fig, path)


# -- the page ---------------------------------------------------------------

STATS = (
    ("stall_s", "a stream's stall at a kill (last token before → first after)"),
    ("tpot_s", "the same streams' time between tokens (TPOT)"),
    ("kill_to_active_s", "kill → Active"),
    ("kill_to_grant_s", "detection: kill → lock granted"),
    ("grant_to_active_s", "wake: granted → Active"),
    ("gap_s", "longest time with no request completed"),
    ("first_served_s", "kill → first new request done"),
    ("rearm_s", "re-arm: kill → Standby again"),
)
CAPTIONS = {
    "stalls.png": "Each stream in flight at a kill: the time from its last token before the kill "
    "to its first after it, against the same streams' time between tokens over the drill. A "
    "stall near the dashed line cost its reader about one token.",
    "latency.png": "Every request's latency when it completed; the red lines are the kills "
    "and the shading after each the gap in which no request completed.",
    "around-kills.png": "Every round laid over the others, the kill at 0. Requests the front "
    "held through the failover complete together at the gap's end, their latency raised by it.",
    "gaps.png": "The longest time with no request completed: from the kill to the end of "
    "the longest stretch without a completed request, up to the first request sent after "
    "the kill. On a model whose answers take seconds it is seconds with or without a kill; "
    "a stream's own stall is the figure above the charts.",
    "phases.png": "Each round's phases, stacked. Detection and wake are the engines' own "
    "timestamps (lock granted, Active); serve ends when the first request sent after the kill "
    "is done; re-arm when the killed engine is back in Standby.",
}
CSS = """
body { font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; }
table { border-collapse: collapse; margin: 1rem 0; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 1.5rem 0; } img { max-width: 100%; }
.headline { font-size: 1.15rem; }
.pass { color: #070; font-weight: bold; } .fail { color: #b00; font-weight: bold; }
"""


def _fmt_ms(v: Any) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1000:.1f}"


_E = html.escape
_QS = ("p50", "p95", "p99", "max")
_BY_SIGNAL = ("gap_s", "kill_to_grant_s", "grant_to_active_s", "rearm_s")


def render_html(result: dict[str, Any], images: list[str]) -> str:
    """The page: the verdict and counts, the percentiles, the charts, each round."""
    s = result.get("summary", {})
    ok = verdict(s)
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Failover drill: {_E(str(s.get('kills')))} kills</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>Failover drill: {_E(str(s.get('kills')))} kills "
        f'<span class="{"pass" if ok else "fail"}">{"PASS" if ok else "FAIL"}</span></h1>',
    ]
    line = headline(s)
    out.append(f'<p class="headline">{_E(line[:1].upper() + line[1:])}.</p>')
    if host := result.get("host"):
        out.append(f"<p>Host: {_E(_host_line(host))}</p>")
    out += _percentiles(s)
    out += _counts(s)
    out += _by_signal(result.get("rounds", []))
    out += _figures(images)
    out += _pairs("The cluster", result.get("cluster") or {}, CLUSTER_KEYS)
    errors = result.get("errors") or {}
    out += _pairs("Failed requests by error", errors, sorted(errors))
    out += _rounds(result.get("rounds", []))
    out.append("</body></html>\n")
    return "\n".join(out)


CLUSTER_KEYS = ("left_endpoints", "seconds_not_an_endpoint", "seconds_pod_not_ready", "restarts")


def _counts(s: dict[str, Any]) -> list[str]:
    counts = [
        ("kills", s.get("kills")),
        ("signals", ", ".join(f"SIG{x}" for x in str(s.get("signal", "?")).split(","))),
        ("failovers", s.get("failovers_ok")),
        ("clients", s.get("clients")),
        ("requests", s.get("requests")),
        ("failed requests", s.get("failed_requests")),
        ("wrong answers", s.get("wrong_answers")),
        ("split brain (two Active)", s.get("split_brain")),
        ("epoch regressions", s.get("epoch_regressions")),
        ("serving violations", s.get("serving_violations")),
    ]
    if "unarmed_s" in s:
        counts.append(("seconds unarmed (no Standby)", round(s["unarmed_s"], 2)))
    return [
        "<table>",
        *(f"<tr><td>{_E(k)}</td><td>{_E(str(v))}</td></tr>" for k, v in counts),
        "</table>",
    ]


def _stat_row(label: str, st: dict[str, Any]) -> str:
    cells = "".join(f"<td>{_fmt_ms(st.get(q))}</td>" for q in _QS)
    return f"<tr><td>{_E(label)}</td><td>{st.get('n')}</td>{cells}</tr>"


def _percentiles(s: dict[str, Any]) -> list[str]:
    out = ["<table><tr><th>ms</th><th>n</th><th>p50</th><th>p95</th><th>p99</th><th>max</th></tr>"]
    out += [_stat_row(label, st) for key, label in STATS if (st := s.get(key))]
    out.append("</table>")
    return out


def _by_signal(rounds: list[dict[str, Any]]) -> list[str]:
    split = by_signal(rounds)
    if not split:
        return []
    out = [
        "<table><tr><th>ms, by signal</th><th>n</th><th>p50</th><th>p95</th>"
        "<th>p99</th><th>max</th></tr>"
    ]
    for sig, per in split.items():
        out += [
            _stat_row(f"SIG{sig}: {label}", st)
            for key, label in STATS
            if key in _BY_SIGNAL and (st := per[key])
        ]
    out.append("</table>")
    return out


def _figures(images: list[str]) -> list[str]:
    out = []
    if "latency.png" not in images:
        out.append(
            "<p>This drill's JSON has no per-request series (run the drill with "
            "<code>--report</code> or <code>--series</code>): no latency charts.</p>"
        )
    out += [
        f'<figure><img src="{_E(name)}" alt="{_E(name)}">'
        f"<figcaption>{_E(CAPTIONS.get(name, ''))}</figcaption></figure>"
        for name in images
    ]
    return out


def _pairs(title: str, values: dict[str, Any], keys: Iterable[str]) -> list[str]:
    """A titled two-column table of ``values`` in the order of ``keys`` (none: nothing)."""
    rows = [f"<tr><td>{_E(k)}</td><td>{_E(str(values[k]))}</td></tr>" for k in keys if k in values]
    return [f"<h2>{_E(title)}</h2><table>", *rows, "</table>"] if rows else []


def _rounds(rounds: list[dict[str, Any]]) -> list[str]:
    out = [
        "<h2>Rounds</h2><table><tr><th>#</th><th>signal</th><th>killed → new</th>"
        "<th>streams caught</th><th>longest stall</th><th>detection</th><th>wake</th>"
        "<th>none completed</th><th>first served</th><th>re-arm</th>"
        "<th>failed</th><th>error</th></tr>"
    ]
    out += [
        f"<tr><td>{r.get('index')}</td><td>{_E(str(r.get('signal', '')))}</td>"
        f"<td>{_E(str(r.get('killed')))} → {_E(str(r.get('new_active')))}</td>"
        f"<td>{len(r.get('stalls_s') or [])}</td><td>{_fmt_ms(_longest(r.get('stalls_s')))}</td>"
        f"<td>{_fmt_ms(r.get('kill_to_grant_s'))}</td>"
        f"<td>{_fmt_ms(r.get('grant_to_active_s'))}</td>"
        f"<td>{_fmt_ms(r.get('gap_s'))}</td><td>{_fmt_ms(r.get('first_served_s'))}</td>"
        f"<td>{_fmt_ms(r.get('rearm_s'))}</td><td>{r.get('failed_requests', 0)}</td>"
        f"<td>{_E(str(r.get('error', '')))}</td></tr>"
        for r in rounds
    ]
    out.append("</table>")
    return out


def _longest(values: list[float] | None) -> float | None:
    return max(values) if values else None


def _host_line(host: dict[str, Any]) -> str:
    parts = [f"{host.get('cpus')} CPUs"]
    for key, label in (("loadavg_start", "at the start"), ("loadavg_end", "at the end")):
        if host.get(key):
            parts.append(f"load {label} {' / '.join(f'{x:.2f}' for x in host[key])} (1/5/15 min)")
    return "; ".join(parts)
