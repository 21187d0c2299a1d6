"""The router's view of real engine processes: their CPU time, from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from understudy.front.router import PodEngines


def test_cpu_ticks_advance_while_a_process_works_and_stop_when_it_is_stopped(
    tmp_path: Path,
) -> None:
    engines = PodEngines(tmp_path)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = engines.cpu_ticks(busy.pid)
        assert first is not None
        deadline = time.monotonic() + 10
        while (engines.cpu_ticks(busy.pid) or 0) <= first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (engines.cpu_ticks(busy.pid) or 0) > first
        os.kill(busy.pid, signal.SIGSTOP)
        time.sleep(0.05)  # the stop takes effect
        stopped = engines.cpu_ticks(busy.pid)
        time.sleep(0.3)
        assert engines.cpu_ticks(busy.pid) == stopped
    finally:
        busy.kill()
        busy.wait()
    assert engines.cpu_ticks(busy.pid) is None  # reaped: no such process
