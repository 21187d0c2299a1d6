"""An engine that crashes writes no core unless asked: the kernel writes the
core before the dying process closes its files, so the lock's release (the
start of the failover) would wait for it (engine_shim/crash.py)."""

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
    "from understudy.engine_shim.crash import no_core_dumps\n"
    "no_core_dumps()\n"
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


STATE = (
    "import ctypes, ctypes.util, resource\n"
    "from understudy.engine_shim.crash import no_core_dumps\n"
    "no_core_dumps()\n"
    "libc = ctypes.CDLL(ctypes.util.find_library('c'))\n"
    "print(resource.getrlimit(resource.RLIMIT_CORE)[0], libc.prctl(3, 0, 0, 0, 0))\n"
)


@pytest.mark.parametrize("keep", [False, True])
def test_the_engine_is_not_dumpable_unless_asked(keep: bool) -> None:
    """What the kernel looks at, on any node: a core size limit of 0 and a
    process that is not dumpable (PR_GET_DUMPABLE, 3), which also stops a
    core piped to a collector (systemd-coredump, apport), where the crash
    test below cannot look. Asked to keep cores, the engine changes neither."""
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    env = {"UNDERSTUDY_CORE_DUMPS": "on"} if keep else {}
    proc = subprocess.run(
        [sys.executable, "-c", STATE],
        env={**os.environ, **env},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (hard, hard)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    limit, dumpable = map(int, proc.stdout.split())
    assert (limit, dumpable) == ((hard, 1) if keep else (0, 0))


def test_a_crashing_engine_leaves_no_core_unless_asked(tmp_path: Path) -> None:
    pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
    no_limit = resource.getrlimit(resource.RLIMIT_CORE)[1] == 0
    if pattern.startswith("|") or "/" in pattern or no_limit:
        # The test above still checks what the kernel decides by.
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
