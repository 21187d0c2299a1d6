"""What the monitoring tests share (tests/monitoring and the real-Prometheus
process test): the committed artefacts' paths and the external tools."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "charts" / "understudy" / "rules" / "understudy.rules.yaml"
DASHBOARDS = ROOT / "charts" / "understudy" / "dashboards"
DOC = ROOT / "docs" / "monitoring.md"


@functools.cache
def tool(name: str) -> str:
    """The path of ``promtool``, ``prometheus`` or ``dashboard-linter`` from
    hack/monitoring/tools (apt or a Go build on first use, as root); a clear
    failure, not a skip, where it cannot be had."""
    proc = subprocess.run(
        [str(ROOT / "hack" / "monitoring" / "tools"), name],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"hack/monitoring/tools {name} failed:\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]
