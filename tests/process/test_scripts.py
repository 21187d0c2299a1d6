"""The set-up scripts whose stdout is data: one path, nothing else.

hack/test captures `hack/setup`, `hack/vllm/venv` and `hack/cluster/up` with
$(...). A cold machine once put a build tool's progress line into the
captured kubeconfig path, and a daemon started by a script that kept the
caller's pipe open made $(...) wait forever; both failed CI only on a fresh
machine. These run the scripts as hack/test does.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process


def _captured(script: str, timeout: float) -> tuple[str, float]:
    """What `x=$(script)` would hold, and how long the capture took."""
    path = script if script.startswith("/") else str(ROOT / script)
    t0 = time.monotonic()
    # stderr not captured: hack/test leaves it on the terminal (or CI's log)
    proc = subprocess.run(
        ["bash", "-c", f'x=$("{path}") && printf %s "$x"'],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=timeout,
        check=True,
    )
    return proc.stdout, time.monotonic() - t0


def test_setup_prints_the_venv_and_nothing_else() -> None:
    out, _ = _captured("hack/setup", 300)
    assert "\n" not in out
    assert (Path(out) / "bin" / "python").exists()


def test_cluster_up_returns_its_kubeconfig_at_once_when_the_cluster_is_up() -> None:
    kubeconfig = Path("/var/lib/understudy/cluster/admin.kubeconfig")
    if os.geteuid() != 0 or not kubeconfig.exists():
        pytest.skip("needs root and hack/cluster's cluster (the cluster tier starts it)")
    out, took = _captured("hack/cluster/up", 300)
    assert out == str(kubeconfig)
    # the cluster's daemons hold no pipe of ours: the capture ends with the script
    assert took < 60, took


def test_a_daemon_started_under_the_scripts_pattern_holds_no_pipe(tmp_path: Path) -> None:
    # The pattern the three scripts share, with a daemon: the capture must end
    # when the script does, not when the daemon does.
    script = tmp_path / "s"
    script.write_text('main() { sleep 30 & echo noise; }\nmain "$@" >&2\necho data\n')
    script.chmod(0o755)
    out, took = _captured(str(script), 60)
    assert out == "data"
    assert took < 10, took
