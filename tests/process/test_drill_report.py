"""``understudy drill --report``: a short real drill (a local llama pod, three
kills, mixed signals) writes its HTML page and PNG charts; every chart decodes
and has a sane size, the page shows each, the JSON carries every request, and
the same report is drawn again from that JSON without a pod."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from localpod import LocalPod
from matplotlib.image import imread
from procs import understudy

from understudy.tools.report import CHARTS

pytestmark = [pytest.mark.process, pytest.mark.slow]


def _drill(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        understudy("drill", *args), capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(420)
def test_a_real_drill_draws_its_report(tmp_path: Path) -> None:
    pod = LocalPod(engine="llama")
    try:
        pod.wait_armed(180)
        out, saved = tmp_path / "report", tmp_path / "drill.json"
        run = _drill(
            "--dir",
            str(pod.dir),
            "--kills",
            "3",
            "--signal",
            "KILL,SEGV",
            "--clients",
            "6",
            "--max-tokens",
            "48",  # tiny-llama's 8 tokens came within 5 ms: a kill caught none at times
            "--report",
            str(out),
            "--output",
            str(saved),
        )
    finally:
        pod.close()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(saved.read_text())
    assert result["summary"]["failovers_ok"] == 3
    # the summary leads with a stream's stall at a kill against the same
    # streams' time between tokens; "no request completed" follows, renamed
    s = result["summary"]
    assert s["streams_caught"] == s["stall_s"]["n"] >= 1, s
    assert s["tpot_s"]["n"] >= s["streams_caught"], s
    assert 0 < s["stall_s"]["p50"] <= s["stall_s"]["max"] < 30, s
    assert sum(len(r["stalls_s"]) for r in result["rounds"]) == s["streams_caught"]
    summary_text = run.stdout[run.stdout.index("\ndrill: ") :]
    assert summary_text.startswith("\ndrill: a stream's stall at a kill"), summary_text[:300]
    assert "longest time with no request completed" in summary_text
    assert "client-observed" not in run.stdout
    for name in CHARTS:
        path = out / name
        assert path.exists(), f"{name} missing: {run.stderr[-2000:]}"
        assert 5_000 < path.stat().st_size < 200_000, (name, path.stat().st_size)
        height, width = imread(path).shape[:2]  # decodes
        assert 800 <= width <= 2000 and 300 <= height <= 1200, (name, width, height)
    page = (out / "index.html").read_text()
    assert sorted(re.findall(r'<img src="([^"]+)"', page)) == sorted(CHARTS)
    assert "PASS" in page
    assert page.index('<p class="headline">A stream&#x27;s stall at a kill') < page.index("<table>")

    # every request is in the JSON (a short drill is not thinned), both kinds
    # of stream, and every round says when its kill was sent
    series = result["series"]
    assert series["total"] == result["summary"]["requests"] == len(series["rows"])
    assert {k["streaming"] for k in series["kinds"]} == {True, False}
    assert {series["kinds"][r[2]]["streaming"] for r in series["rows"]} == {True, False}
    kills = [r["kill_at_s"] for r in result["rounds"]]
    assert all(k > 0 for k in kills) and kills == sorted(kills)
    assert result["host"]["cpus"] >= 1

    # drawn again from the saved JSON, no pod: the same page and charts
    again = tmp_path / "again"
    redo = _drill("--from", str(saved), "--report", str(again), timeout=120)
    assert redo.returncode == 0, redo.stderr
    assert sorted(p.name for p in again.iterdir()) == sorted(["index.html", *CHARTS])
    assert (again / "index.html").read_text() == page
    for name in CHARTS:
        assert imread(again / name).shape == imread(out / name).shape


def test_drawing_what_is_not_a_kill_drill_is_refused(tmp_path: Path) -> None:
    sidecar = tmp_path / "sidecar.json"  # what `drill --sidecar gms --output` writes
    sidecar.write_text(json.dumps({"sidecar": "gms", "failover": True, "recovered_s": 4.9}))
    run = _drill("--from", str(sidecar), "--report", str(tmp_path / "r"), timeout=60)
    assert run.returncode == 2 and "not the JSON of a kill drill" in run.stderr
    assert not (tmp_path / "r").exists()
    run = _drill("--from", str(sidecar), timeout=60)
    assert run.returncode == 2 and "--from needs --report" in run.stderr


def test_without_matplotlib_the_drill_says_what_to_install(tmp_path: Path) -> None:
    # the CLI as a user without the [report] extra runs it: matplotlib unimportable
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        "sys.argv = ['understudy', *sys.argv[1:]]; "
        "runpy.run_module('understudy.cli', run_name='__main__')"
    )
    run = subprocess.run(
        [understudy("x")[0], "-c", code, "drill", "--kills", "1", "--report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "pip install 'understudy-tools[report]'" in run.stderr
    assert list(tmp_path.iterdir()) == []  # refused before anything ran
