"""Which processes the drill counts as serving (``drill_target.unix_listeners``):
a live process listening in the directory, and not a killed one whose
teardown still holds the socket. A killed engine's teardown runs at
``SCHED_IDLE`` (the lock server puts it there), so on a busy node it can hold
its files, the serving socket among them, for a second after the kill: the
drill's one-server check saw two listeners there, one of them dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import wait_for

from understudy.tools.drill_target import exiting, unix_listeners

pytestmark = pytest.mark.process

# Listens, then holds 1 GiB of its own memory, every page touched: a
# teardown with pages to give back.
_SERVER = """
import mmap, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen()
mem = mmap.mmap(-1, 1 << 30)
for at in range(0, len(mem), mmap.PAGESIZE):
    mem[at] = 1
print("ready", flush=True)
time.sleep(600)
"""
_HOG = "while True: pass"


def _start(code: str, *args: str, cpu: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    os.sched_setaffinity(proc.pid, {cpu})
    return proc


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in reversed(started):  # the busy one first: the teardown then runs
        proc.kill()
        proc.wait(timeout=60)


def _holds_socket(pid: int) -> bool:
    with_fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd).startswith("socket:[") for fd in with_fds.iterdir())
    except OSError:
        return False


def test_a_killed_process_still_holding_its_socket_is_not_a_listener(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    cpu = min(os.sched_getaffinity(0))
    server = _start(_SERVER, str(tmp_path / "engine.sock"), cpu=cpu)
    procs.append(server)
    assert server.stdout is not None and server.stdout.readline() == "ready\n"
    assert unix_listeners(tmp_path) == {server.pid}
    assert not exiting(server.pid)

    # Its teardown starved as on a busy node: at SCHED_IDLE, behind a busy
    # process on its own CPU.
    procs.append(_start(_HOG, cpu=cpu))
    time.sleep(0.2)
    server.send_signal(signal.SIGKILL)
    os.sched_setscheduler(server.pid, os.SCHED_IDLE, os.sched_param(0))
    wait_for(lambda: exiting(server.pid), 10, what="the kill taken")
    assert _holds_socket(server.pid), "its teardown ended before the check: nothing shown"
    assert unix_listeners(tmp_path) == set()
    procs[1].kill()
    server.wait(timeout=60)
    assert exiting(server.pid)  # gone
