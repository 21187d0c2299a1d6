"""The dashboards: generated from code (committed JSON is current) and clean
under Grafana's dashboard linter."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from monitoring_tools import DASHBOARDS, ROOT

# The first test to ask for a tool may install it (apt) or build it (Go).
pytestmark = pytest.mark.timeout(900)

GENERATOR = ROOT / "hack" / "monitoring" / "dashboards.py"
FILES = sorted(DASHBOARDS.glob("*.json"))


def _generator() -> dict[str, Any]:
    return runpy.run_path(str(GENERATOR))


def test_committed_dashboards_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_check_mode_catches_a_stale_file(tmp_path: Path) -> None:
    gen = _generator()
    assert gen["main"](["--out", str(tmp_path)]) == 0
    assert gen["main"](["--check", "--out", str(tmp_path)]) == 0
    first = sorted(tmp_path.glob("*.json"))[0]
    first.write_text(first.read_text().replace("Understudy", "Understudi"))
    assert gen["main"](["--check", "--out", str(tmp_path)]) == 1


def test_dashboards_have_uids_and_variables() -> None:
    boards = {json.loads(f.read_text())["uid"]: json.loads(f.read_text()) for f in FILES}
    assert set(boards) == {"understudy-failover", "understudy-fleet", "understudy-gateway"}
    for uid in ("understudy-failover", "understudy-gateway"):  # the label contract's five
        names = [v["name"] for v in boards[uid]["templating"]["list"]]
        assert names == ["datasource", "namespace", "gpuinstance", "pod", "job", "instance"]
    for board in boards.values():
        for panel in board["panels"]:
            if panel["type"] != "row":
                assert panel["targets"], panel["title"]


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_dashboard_linter_is_clean(tool: Callable[[str], str], path: Path) -> None:
    proc = subprocess.run(
        [tool("dashboard-linter"), "lint", "--strict", str(path)], capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "❌" not in out and "⚠" not in out, out


def test_dashboard_linter_can_fail(tool: Callable[[str], str], tmp_path: Path) -> None:
    board = json.loads(FILES[0].read_text())
    panel = next(p for p in board["panels"] if p["type"] == "timeseries")
    panel["targets"][0]["expr"] = "sum(rate(understudy_lock_grants_total[5m]))"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(board))
    proc = subprocess.run(
        [tool("dashboard-linter"), "lint", "--strict", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "job selector not found" in proc.stdout + proc.stderr
