"""The alert rules: promtool checks them and runs their unit tests, and every
alert is shown both firing and staying quiet, with a runbook section."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from monitoring_tools import DOC, RULES

# The first test to ask for a tool may install it (apt) or build it (Go).
pytestmark = pytest.mark.timeout(900)

TESTS = Path(__file__).parent / "rules"


def _alerts() -> list[dict[str, object]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_rules(tool: Callable[[str], str]) -> None:
    proc = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in proc.stdout


def test_promtool_unit_tests_pass(tool: Callable[[str], str]) -> None:
    files = sorted(TESTS.glob("*.test.yaml"))
    assert files
    proc = subprocess.run(
        [tool("promtool"), "test", "rules", *map(str, files)],
        capture_output=True,
        text=True,
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_fails_a_wrong_expectation(tool: Callable[[str], str], tmp_path: Path) -> None:
    """The unit tests can fail: an alert expected quiet that fires is reported."""
    bad = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "30s",
        "tests": [
            {
                "interval": "30s",
                "input_series": [
                    {
                        "series": 'understudy_front_routing{namespace="a", '
                        'understudy_dev_instance="b", pod="c"}',
                        "values": "0x10",
                    }
                ],
                "alert_rule_test": [
                    {"eval_time": "4m", "alertname": "UnderstudyNoActiveEngine", "exp_alerts": []}
                ],
            }
        ],
    }
    path = tmp_path / "bad.test.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = subprocess.run(
        [tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "UnderstudyNoActiveEngine" in proc.stdout + proc.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in TESTS.glob("*.test.yaml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {str(a["alert"]) for a in _alerts()}
    assert names - firing == set(), "alerts never shown firing"
    assert names - quiet == set(), "alerts never shown quiet"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_alert_has_a_runbook_section() -> None:
    doc = DOC.read_text()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", doc, flags=re.M)}
    for alert in _alerts():
        annotations = alert["annotations"]
        assert isinstance(annotations, dict)
        url = annotations["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/monitoring.md", url
        assert anchor in anchors, f"{alert['alert']}: no section #{anchor} in {DOC}"
        assert alert["labels"]["severity"] in ("critical", "warning")  # type: ignore[index]
