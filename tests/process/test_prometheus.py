"""A real Prometheus scrapes a real local pod through a kill drill; then every
panel query of every dashboard and every alert expression is evaluated
against it (docs/monitoring.md).

Debian's Prometheus runs on loopback with the pod's four kinds of metrics
endpoints as targets (lock server, GMS, front, each engine), every 200 ms,
with the target labels the chart's PodMonitor gives (``namespace``, ``pod``,
``understudy_dev_instance``) and the alert rules loaded. After a drill of
real SIGKILLs:

- every dashboard query parses, and every query of the pod dashboard returns
  data (a value that is not NaN somewhere in the drill's time range), except
  the few listed in ``EXEMPT`` with the reason;
- every alert rule loads, evaluates without error, and the outage alerts are
  quiet after the drill (the pod served all along);
- the durable handover count equals the drill's kills, and the gap
  histogram's p99 agrees with the drill's own p99 within bucket resolution.

The operator dashboard's queries can only parse here (no operator runs
locally): the cluster tier scrapes the operator.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import localpod
import pytest
import yaml
from monitoring_tools import DASHBOARDS, RULES, tool
from procs import Proc, understudy, wait_for

from understudy.engine_shim.mainloop import PHASE_BUCKETS
from understudy.front.metrics import GAP_BUCKETS
from understudy.lockserver.tally import REARM_BUCKETS

pytestmark = [pytest.mark.process, pytest.mark.slow]

# The assigned port range of this test: the pod at 19100 (serving), 19104-5
# (engine status), 19112-14 (lock server, GMS, front); Prometheus at 19190.
POD_BASE = 19100
PROMETHEUS_PORT = 19190
SCRAPE = "200ms"
# KILL hands the lock straight to the standby; STOP hangs the engine, which
# the front detects by its heartbeat and holds requests meanwhile: together
# they feed every failover panel (hold time only comes from the hang).
KILLS = 6
SIGNALS = "KILL,STOP"
LABELS = {"namespace": "local", "pod": "local-0", "understudy_dev_instance": "local"}

# (dashboard uid, panel title, refId) -> why no data is the right answer here.
EXEMPT = {
    ("understudy-failover", "Migrated requests", "B"): (
        "failed migrations: a passing drill has none (the series appears with the first)"
    ),
}
EXEMPT_DASHBOARDS = {
    "understudy-fleet": "the operator does not run in a local pod; the cluster tier scrapes it",
    "understudy-gateway": "a local pod has no gateway (local up --pods N runs one); "
    "tests/monitoring/test_metric_names.py checks its names against the gateway's exposition",
}
# Fed only where the drill's front held a request (`_held`): one that arrives
# between a hung engine's revocation and the next engine's grant. A hang's
# own requests are cut at its revocation and retried; where the front learns
# of the grant in the same read they find a route at once, and a drill of 8
# clients then holds none (CI, 2026-12-07: 3 hangs, nothing held).
FED_BY_HOLDS = {("understudy-failover", "Hold time")}
# Outage alerts that must be quiet after a drill the pod passed.
QUIET = ("UnderstudyNoActiveEngine", "UnderstudySplitBrain", "UnderstudyGmsDown")


def _api(path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    return body


def _prometheus(tmp: Path, pod: localpod.LocalPod) -> Proc:
    engines = [f"127.0.0.1:{p}" for p in pod.status_ports]
    jobs = {
        "lockserver": [f"127.0.0.1:{POD_BASE + 12}"],
        "gms": [f"127.0.0.1:{POD_BASE + 13}"],
        "front": [f"127.0.0.1:{pod.front_port}"],
        "engines": engines,
    }
    config = {
        "global": {
            "scrape_interval": SCRAPE,
            "scrape_timeout": SCRAPE,
            "evaluation_interval": "1s",
        },
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets, "labels": LABELS}]}
            for job, targets in jobs.items()
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    proc = Proc(
        [
            tool("prometheus"),
            f"--config.file={path}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}",
            "--storage.tsdb.retention.time=1h",
        ],
        log=tmp / "prometheus.log",
    )

    def all_up() -> bool:
        try:
            targets = _api("targets")["data"]["activeTargets"]
        except (OSError, ValueError):  # not listening yet, or 503 while it starts
            return False
        return len(targets) == 3 + len(engines) and all(t["health"] == "up" for t in targets)

    try:
        wait_for(all_up, 60, 0.2, what="Prometheus scraping every target of the pod")
    except BaseException:
        proc.stop()  # not the caller's yet: nobody else would stop it
        raise
    return proc


def _substitute(expr: str, range_s: int, rate_s: int) -> str:
    out = expr.replace("$__rate_interval", f"{rate_s}s").replace("$__range", f"{range_s}s")
    # every template variable at its "All" value, as the dashboards set it
    return re.sub(r"\$\{?(namespace|gpuinstance|pod|job|instance)\}?", ".+", out)


def _targets(board: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (p["title"], t["refId"], t)
        for p in board["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]


def _has_data(result: list[dict[str, Any]]) -> bool:
    """Some sample that is a number (histogram_quantile over no events is NaN)."""
    for series in result:
        samples = series.get("values") or [series["value"]]
        if any(not math.isnan(float(v)) for _, v in samples):
            return True
    return False


def _bucket(value: float, bounds: tuple[float, ...]) -> tuple[float, float]:
    lo = 0.0
    for hi in bounds:
        if value <= hi:
            return lo, hi
        lo = hi
    return lo, math.inf


@pytest.mark.timeout(900)
def test_every_panel_and_alert_against_a_real_prometheus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool("prometheus")  # installed before the pod starts: apt may take a while
    monkeypatch.setattr(localpod, "free_port_block", lambda n: POD_BASE)
    pod = localpod.LocalPod(engine="reference")
    prometheus: Proc | None = None
    try:
        pod.wait_armed(180)
        started = time.time()
        prometheus = _prometheus(tmp_path, pod)
        report = tmp_path / "drill.json"
        drill = subprocess.run(
            understudy(
                "drill", "--dir", str(pod.dir), "--kills", str(KILLS),
                "--signal", SIGNALS, "--clients", "8", "--output", str(report),
            ),
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert drill.returncode == 0, drill.stdout[-3000:] + drill.stderr[-3000:]
        time.sleep(3)  # the last round's re-arm and samples: scraped a few times over
        _check(json.loads(report.read_text()), started)
    finally:
        if prometheus is not None:
            prometheus.stop()
        pod.close()


def _lint_exposition() -> None:
    """Every target's /metrics passes promtool's metric lint (names, units,
    _total counters, help text)."""
    for target in _api("targets")["data"]["activeTargets"]:
        url = target["scrapeUrl"]
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read()
        proc = subprocess.run(
            [tool("promtool"), "check", "metrics"], input=text, capture_output=True
        )
        assert proc.returncode == 0 and not proc.stdout and not proc.stderr, (
            url,
            proc.stdout.decode() + proc.stderr.decode(),
        )


def _check(drill: dict[str, Any], started: float) -> None:
    _lint_exposition()
    end = time.time()
    range_s = math.ceil(end - started) + 5
    _check_dashboards(started, end, range_s)
    _check_rules(end)
    _check_counts(drill, end, range_s)


def _held(end: float) -> int:
    """The requests the front held in the drill (its counter starts at 0)."""
    body = _api("query", query="max(understudy_front_held_requests_total)", time=str(end))
    assert body["status"] == "success", body
    return max((int(float(r["value"][1])) for r in body["data"]["result"]), default=0)


def _check_dashboards(started: float, end: float, range_s: int) -> None:
    """Every dashboard variable has values and every panel query data the drill fed."""
    rate_s = 2  # Grafana's $__rate_interval at a 200 ms scrape and a 1 s step
    held = _held(end)
    missing: list[str] = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        uid = board["uid"]
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                expr = re.sub(r"^label_values\((.*), *\w+\)$", r"\1", var["query"])
                expr = _substitute(expr, range_s, rate_s)
                body = _api("series", **{"match[]": expr, "start": str(started)})
                assert body["status"] == "success", (uid, var["name"], body)
                if uid not in EXEMPT_DASHBOARDS:
                    assert body["data"], f"{uid}: variable {var['name']} has no values"
        for title, ref, target in _targets(board):
            expr = _substitute(target["expr"], range_s, rate_s)
            if target.get("instant"):
                body = _api("query", query=expr, time=str(end))
            else:
                body = _api("query_range", query=expr, start=str(started), end=str(end), step="1")
            assert body["status"] == "success", (uid, title, ref, expr, body)
            exempt = EXEMPT_DASHBOARDS.get(uid) or EXEMPT.get((uid, title, ref))
            fed = held > 0 or (uid, title) not in FED_BY_HOLDS
            if not exempt and not _has_data(body["data"]["result"]):
                if fed:
                    missing.append(f"{uid} / {title} / {ref}: {expr}")
            elif not exempt and not fed:  # no request held, yet a hold time
                missing.append(f"{uid} / {title} / {ref} has data, with no request held")
    assert not missing, (
        f"queries the drill should have fed returned nothing ({held} requests held):\n"
        + "\n".join(missing)
    )


def _check_rules(end: float) -> None:
    """The alert rules: loaded, evaluated by Prometheus without error, and each
    expression answers a query; the outage alerts are quiet."""
    groups = _api("rules")["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    expected = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert set(rules) == expected
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
        body = _api("query", query=rule["query"], time=str(end))
        assert body["status"] == "success", (name, body)
        if name in QUIET:
            assert body["data"]["result"] == [], (name, body["data"]["result"])
            assert rule["state"] == "inactive", (name, rule["state"])


def _check_counts(drill: dict[str, Any], end: float, range_s: int) -> None:
    """The durable failover count is the drill's (one handover per kill), and
    each p99 Prometheus estimates agrees with the drill's own measurement."""
    sel = ", ".join(f'{k}="{v}"' for k, v in LABELS.items())
    value = _api("query", query=f"sum(understudy_lock_handovers_total{{{sel}}})", time=str(end))
    assert float(value["data"]["result"][0]["value"][1]) == KILLS
    gaps = _api(
        "query", query=f"sum(understudy_front_failover_gap_seconds_count{{{sel}}})", time=str(end)
    )
    assert float(gaps["data"]["result"][0]["value"][1]) == KILLS

    # p99s: Prometheus's estimate from each histogram against the drill's own
    # measurement of the same thing, within the resolution of the buckets
    # they fall in. The gap (front), detection (front: route lost to grant;
    # the drill: kill to grant) and grant -> Active (the new engine).
    checks = [
        ("understudy_front_failover_gap_seconds", "", "gap_s", GAP_BUCKETS, 0.0),
        ("understudy_front_detection_seconds", "", "kill_to_grant_s", GAP_BUCKETS, 0.0),
        (
            "understudy_failover_duration_seconds",
            'phase="grant_to_active", ',
            "grant_to_active_s",
            PHASE_BUCKETS,
            0.0,
        ),
        # The lock times a re-arm from the old holder's release: for a hang,
        # the front's kill, which comes up to the pod's hang-after (1 s) plus a
        # heartbeat check after the drill's SIGSTOP, where the drill starts.
        ("understudy_lock_rearm_seconds", "", "rearm_s", REARM_BUCKETS, 1.25),
    ]
    for metric, extra, key, bounds, slack in checks:
        body = _api(
            "query",
            query="histogram_quantile(0.99, sum by (le) (increase("
            f"{metric}_bucket{{{extra}{sel}}}[{range_s}s])))",
            time=str(end),
        )
        estimate = float(body["data"]["result"][0]["value"][1])
        measured = drill["summary"][key]["p99"]
        lo, hi = _bucket(measured, bounds)
        elo, ehi = _bucket(estimate, bounds)
        # Each is known to its bucket only (the estimate is interpolated
        # inside its own), and two values a few ms apart across a bucket's
        # edge (the drill times kill -> grant, the front route lost -> grant)
        # read up to both buckets' widths apart: a hang's 0.98 s measured
        # against 1.49 estimated in (1, 1.5] (CI, 2026-12-05), where one
        # width (0.5) had been allowed.
        tolerance = (hi - lo) + (ehi - elo) + slack
        print(f"{key} p99: drill {measured * 1000:.1f} ms, Prometheus {estimate * 1000:.1f} ms")
        assert abs(estimate - measured) <= tolerance, (key, estimate, measured, (lo, hi))
    print(f"drill summary: {json.dumps(drill['summary'])}")
