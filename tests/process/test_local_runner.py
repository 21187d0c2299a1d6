"""The local runner as a new user meets it: a pod that cannot start says why, fast."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from localpod import free_port_block
from procs import understudy, wait_for

pytestmark = pytest.mark.process


def test_a_crash_looping_engine_is_reported_with_its_last_error_line(
    tmp_path: Path, shm_path: Path
) -> None:
    run = shm_path
    base = free_port_block(16)
    t0 = time.monotonic()
    proc = subprocess.run(
        understudy(
            "local",
            "up",
            "--detach",
            "--dir",
            str(run),
            "--engine",
            "reference",
            "--model",
            str(tmp_path / "no-such-model"),
            "--port",
            str(base),
            "--status-port",
            str(base + 4),
            "--metrics-port",
            str(base + 12),
            "--ready-timeout",
            "120",
        ),
        capture_output=True,
        text=True,
        timeout=150,
    )
    took = time.monotonic() - t0
    try:
        assert proc.returncode == 1, proc.stderr
        # One line per failing engine, naming the container, its exits and the
        # adapter's own reason, well before the 120 s ready timeout.
        assert re.search(r"engine-(primary|shadow-1) keeps failing \(2 exits", proc.stderr)
        assert "no model.safetensors there" in proc.stderr
        assert "the pod was stopped" in proc.stderr
        assert took < 60, took
    finally:
        subprocess.run(understudy("local", "down", "--dir", str(run)), capture_output=True)


def test_the_kubelet_back_off_spaces_restarts(tmp_path: Path, shm_path: Path) -> None:
    """Default policy: first restart at once, then 10 s: after ~4 s of a crash loop
    the engine has exited exactly twice, not dozens of times."""
    run = shm_path
    base = free_port_block(16)
    sup = subprocess.Popen(
        understudy(
            "local",
            "up",
            "--dir",
            str(run),
            "--engine",
            "reference",
            "--model",
            str(tmp_path / "no-such-model"),
            "--port",
            str(base),
            "--status-port",
            str(base + 4),
            "--metrics-port",
            str(base + 12),
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        from understudy.tools.local import read_state

        def twice() -> dict | None:
            try:
                c = read_state(run)["containers"]["engine-primary"]
            except (OSError, ValueError, KeyError):
                return None
            return c if c["failures"] >= 2 else None

        primary = wait_for(twice, 60, 0.1, what="two failed starts")
        # Restarted once at once; the second exit waits 10 s for its restart.
        assert primary["restarts"] == 1, primary
        assert 0 < primary["back_off_s"] <= 10, primary
        time.sleep(2)
        assert read_state(run)["containers"]["engine-primary"]["restarts"] == 1
    finally:
        sup.terminate()
        _, err = sup.communicate(timeout=30)
    assert re.search(r"engine-(primary|shadow-1) keeps failing", err), err[-2000:]
