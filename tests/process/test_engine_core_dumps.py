"""An engine that crashes writes no core unless asked: the kernel writes the
core before the dying process closes its files, so the lock's release (the
start of the failover) would wait for it (engine_shim/cli.py)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

CRASH = (
    "import os, signal\n"
    "from understudy.engine_shim.cli import _no_core_dumps\n"
    "_no_core_dumps()\n"
    "os.kill(os.getpid(), signal.SIGSEGV)\n"
)


def _crash(cwd: Path, **env: str) -> tuple[int, list[str]]:
    """Run the crash with the core limit raised to its hard limit; the return
    code and the files it left in ``cwd``."""
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    proc = subprocess.run(
        [sys.executable, "-c", CRASH],
        cwd=cwd,
        env={**os.environ, **env},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (hard, hard)),
        timeout=120,
        check=False,
    )
    return proc.returncode, sorted(os.listdir(cwd))


def test_a_crashing_engine_leaves_no_core_unless_asked(tmp_path: Path) -> None:
    pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
    no_limit = resource.getrlimit(resource.RLIMIT_CORE)[1] == 0
    if pattern.startswith("|") or "/" in pattern or no_limit:
        pytest.skip(f"cores are not written to the crash's directory here ({pattern!r})")
    off, on = tmp_path / "off", tmp_path / "on"
    off.mkdir()
    on.mkdir()
    code, files = _crash(off)
    assert code == -signal.SIGSEGV and files == []
    # The same crash, asked to keep its core: the kernel writes one, which is
    # what the default spares the failover.
    code, files = _crash(on, UNDERSTUDY_CORE_DUMPS="on")
    assert code == -signal.SIGSEGV and any(f.startswith("core") for f in files), files
