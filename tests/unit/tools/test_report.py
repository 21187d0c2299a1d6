"""The drill report drawn from a fixed synthetic drill: every chart is a real
PNG (decoded back here), of a sane size, not blank, and the page shows it; the
per-request series a drill keeps stays within its limit and keeps what the
charts need."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread

from understudy.tools.drill_load import Kind
from understudy.tools.figures import stats
from understudy.tools.report import CHARTS, by_signal, phases, write_report
from understudy.tools.series import Sample, Tally, request_series

KINDS = [Kind("chat-stream", "/v1/chat/completions", {}, streaming=True), Kind("chat", "/x", {})]


def _round(i: int, kill_at: float, gap: float, **kw: Any) -> dict[str, Any]:
    return {
        "index": i,
        "signal": "KILL",
        "killed": "engine-primary" if i % 2 else "engine-shadow-1",
        "new_active": "engine-shadow-1" if i % 2 else "engine-primary",
        "kill_at_s": kill_at,
        "kill_to_grant_s": 0.010 + 0.001 * i,
        "grant_to_active_s": 0.020,
        "kill_to_active_s": 0.030 + 0.001 * i,
        "gap_s": gap,
        "first_served_s": gap + 0.015,
        "rearm_s": 0.4 + 0.01 * i,
        "failed_requests": 0,
        "stalls_s": [0.15, 0.2 + 0.01 * i],
        "error": "",
        **kw,
    }


def synthetic(with_series: bool = True) -> dict[str, Any]:
    rounds = [_round(i, 2.0 * i, 0.040 + 0.005 * i) for i in range(1, 7)]
    # a round with no failover: nothing measured but the kill
    rounds.append(
        {
            "index": 7,
            "signal": "STOP",
            "killed": "engine-primary",
            "kill_at_s": 14.0,
            "error": "no new Active engine within 60.0s",
        }
    )
    summary = {
        "kills": 7,
        "signal": "KILL,STOP",
        "failovers_ok": 6,
        "requests": 1200,
        "failed_requests": 1,
        "wrong_answers": 0,
        "split_brain": 0,
        "epoch_regressions": 0,
        "serving_violations": 0,
        "clients": 4,
        "gap_s": stats([r["gap_s"] for r in rounds if "gap_s" in r]),
        "kill_to_grant_s": stats([r["kill_to_grant_s"] for r in rounds if "gap_s" in r]),
        "streams_caught": 12,
        "stall_s": stats([0.2 + 0.01 * i for i in range(12)]),
        "tpot_s": stats([0.1, 0.15, 0.2]),
    }
    result: dict[str, Any] = {"summary": summary, "rounds": rounds, "errors": {"HTTP 503": 1}}
    if with_series:
        rows = []
        for n in range(1200):
            start = n * 0.0125
            near = any(0 <= start - r["kill_at_s"] < r.get("gap_s", 0) for r in rounds)
            rows.append([start, 0.5 if near else 0.08 + 0.01 * (n % 5), n % 2, 1])
        rows[600][3] = 0  # one failure
        result["series"] = {
            "columns": ["start_s", "latency_s", "kind", "ok"],
            "kinds": [{"name": k.name, "streaming": k.streaming} for k in KINDS],
            "total": 1200,
            "rows": rows,
        }
    return result


def _check_png(path: Path) -> None:
    assert path.exists() and path.stat().st_size > 5_000, path
    assert path.stat().st_size < 200_000, f"{path} is {path.stat().st_size} bytes"
    pixels = imread(path)  # a real decode
    height, width = pixels.shape[:2]
    assert 800 <= width <= 2000 and 300 <= height <= 1200, (path, pixels.shape)
    assert float(np.std(pixels[..., :3])) > 0.02, f"{path} is blank"


def test_every_chart_is_a_real_png_and_the_page_shows_it(tmp_path: Path) -> None:
    files = write_report(synthetic(), tmp_path)
    assert [f.name for f in files] == ["index.html", *CHARTS]
    for name in CHARTS:
        _check_png(tmp_path / name)
    page = (tmp_path / "index.html").read_text()
    assert sorted(re.findall(r'<img src="([^"]+)"', page)) == sorted(CHARTS)
    # self-contained: nothing but the PNGs next to it is loaded
    assert not re.search(r"(src|href)=\"(https?:|//)", page)
    assert "FAIL" in page  # a round without failover and a failed request
    # the nearest-rank p50 of 45, 50, .. 70 ms: the 3rd of 6 (ceil(0.5 * 6))
    assert "<td>longest time with no request completed</td><td>6</td><td>55.0</td>" in page
    assert "no new Active engine" in page and "HTTP 503" in page
    assert "<td>SIGKILL: longest time with no request completed</td><td>6</td><td>55.0</td>" in page
    # the page leads with a stream's stall against its own time between tokens:
    # the sentence above the tables, and the first two rows of the percentiles
    headline = re.search(r'<p class="headline">([^<]*)</p>', page)
    assert headline is not None and headline.start() < page.index("<table>")
    said = html.unescape(headline[1])
    assert (
        said.startswith("A stream's stall at a kill")
        and "p50 250.0, p99 310.0, max 310.0 ms" in said
    )
    assert "p50 150.0, p99 200.0, max 200.0 ms (12 streams caught in 7 kills)" in said
    rows = [html.unescape(r) for r in re.findall(r"<tr><td>([^<]*)</td><td>\d+</td>", page)]
    assert rows[:2] == [
        "a stream's stall at a kill (last token before → first after)",
        "the same streams' time between tokens (TPOT)",
    ]
    assert "<td>2</td><td>210.0</td>" in page  # round 1: streams caught, longest stall


def test_mixed_signals_get_their_own_percentiles() -> None:
    rounds = synthetic()["rounds"]
    split = by_signal(rounds)
    assert sorted(split) == ["KILL", "STOP"]
    assert split["KILL"]["gap_s"]["n"] == 6 and split["KILL"]["gap_s"]["max"] == 0.070
    assert split["STOP"]["gap_s"] is None  # its one round failed: nothing measured
    assert by_signal(rounds[:6]) == {}  # one signal: the drill's own numbers say it all


def test_a_cluster_drill_shows_what_its_observer_saw(tmp_path: Path) -> None:
    result = synthetic(with_series=False)  # the page is the point here, not the charts
    # what `understudy drill --kube` adds to the JSON (drill_kube.Observer.report)
    result["cluster"] = {
        "samples": 400,
        "seconds_not_an_endpoint": {"minilm-0": 0.0},
        "left_endpoints": False,
        "seconds_pod_not_ready": {"minilm-0": 12.5},
        "pod_ready_timeline": [],
        "restarts": {"minilm-0/engine-primary": 3, "minilm-0/gms": 0},
    }
    page = write_report(result, tmp_path)[0].read_text()
    assert "<h2>The cluster</h2>" in page
    assert "<td>left_endpoints</td><td>False</td>" in page
    assert "minilm-0/engine-primary&#x27;: 3" in page


def test_a_json_without_series_draws_what_it_can(tmp_path: Path) -> None:
    files = write_report(synthetic(with_series=False), tmp_path)
    assert [f.name for f in files] == ["index.html", "stalls.png", "gaps.png", "phases.png"]
    for f in files[1:]:
        _check_png(f)
    assert "no per-request series" in files[0].read_text()
    # a drill from before streams were timed: no stalls to draw, and the page says so
    old = synthetic(with_series=False)
    for r in old["rounds"]:
        r.pop("stalls_s", None)
    for key in ("stall_s", "tpot_s", "streams_caught"):
        old["summary"].pop(key)
    files = write_report(old, tmp_path / "old")
    assert [f.name for f in files] == ["index.html", "gaps.png", "phases.png"]
    assert "did not time its streams" in files[0].read_text()


def test_phases_stack_up_to_the_measured_times() -> None:
    p = phases(_round(1, 2.0, 0.050))
    assert p["detection"] == pytest.approx(11.0)
    assert p["wake"] == pytest.approx(20.0)
    assert sum(p[k] for k in ("detection", "wake", "serve")) == pytest.approx(65.0)  # served
    assert sum(p.values()) == pytest.approx(410.0)  # re-arm
    # nothing measured: zeros, not an error
    assert phases({"index": 2, "error": "pod not armed"}) == dict.fromkeys(p, 0.0)


def test_the_series_keeps_failures_and_kill_windows_within_its_limit() -> None:
    origin = 1000.0
    samples = [
        Sample(origin + n * 0.01, origin + n * 0.01 + 0.05, n != 4321, kind=KINDS[n % 2].name)
        for n in range(10_000)
    ]
    kill = origin + 50.0
    series = request_series(samples, KINDS, origin, [kill], limit=1000)
    rows = series["rows"]
    assert series["total"] == 10_000 and len(rows) <= 1000
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert [r for r in rows if not r[3]] == [[43.21, 0.05, 1, 0]]
    # all of the window around the kill (-1 s .. +3 s) is there: ~400 requests
    window = [r for r in rows if r[0] + r[1] >= 49.0 and r[0] <= 53.0]
    assert len(window) == sum(1 for s in samples if s.end >= kill - 1 and s.start <= kill + 3)
    assert {r[2] for r in rows} == {0, 1}
    # a short drill is kept whole
    assert len(request_series(samples[:500], KINDS, origin, [kill])["rows"]) == 500


def test_a_long_drill_is_folded_into_counts_and_a_bounded_series() -> None:
    """What the drill does round by round: requests that ended before the next
    kill are folded into a Tally; the counts are exact, what it holds bounded."""
    origin, limit = 1000.0, 500
    kills = [origin + 10.0 * k for k in range(1, 20)]
    samples = []
    for n in range(20_000):  # 100 requests a second for 200 s
        start = origin + n * 0.01
        ok = n % 997 != 0
        digest = "odd" if n in (5, 6, 7) else f"answer-{n % 2}"
        samples.append(
            Sample(
                start,
                start + 0.03,
                ok,
                digest if ok else "",
                "" if ok else "HTTP 503",
                KINDS[n % 2].name,
            )
        )
    tally = Tally(limit)
    # folded as a drill folds: at each kill, what ended 1.5 s before it
    done = 0
    for k in [*kills, float("inf")]:
        upto = next((i for i, s in enumerate(samples) if s.end >= k - 1.5), len(samples))
        tally.add(samples[done:upto], [x for x in kills if x < k])
        done = upto
        assert len(tally.near) + len(tally.rest) <= 3 * limit
    failed = [s for s in samples if not s.ok]
    assert tally.requests == 20_000 and tally.failed == len(failed) == 21
    assert tally.errors == {"HTTP 503": 21}
    assert tally.by_kind == {"chat-stream": 10_000, "chat": 10_000}
    assert tally.wrong_answers() == 3  # the three odd answers, whichever kind
    series = tally.series(KINDS, origin, kills)
    assert series["total"] == 20_000 and len(series["rows"]) <= limit
    assert sum(1 for r in series["rows"] if not r[3]) >= 1
    # the steady stretches are thinned evenly: rows spread over the whole drill
    starts = [r[0] for r in series["rows"]]
    assert min(starts) < 10 and max(starts) > 190
