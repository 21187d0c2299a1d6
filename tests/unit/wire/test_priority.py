"""A dead process's teardown at SCHED_IDLE and back (wire.priority), with
real processes, kill -9 and a real /proc.

What the lock server relies on: every thread of a killed process is found on
its way out, however far its exit has gone, and put back; a living process
is never touched, lowered or restored.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.wire import priority

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")


@contextlib.contextmanager
def _child(touch_mib: int, threads: int) -> Iterator[int]:
    """A forked child with ``threads`` more threads and memory to tear down,
    ready when the pipe says so; killed and reaped at the end."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            memory = bytearray(touch_mib << 20)
            for i in range(0, len(memory), 4096):
                memory[i] = 1
            for _ in range(threads):
                threading.Thread(target=threading.Event().wait, daemon=True).start()
            os.write(w, b"r")
            threading.Event().wait()
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert os.read(r, 1) == b"r"
        yield pid
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_killed_process_tears_down_at_idle_priority_and_is_put_back() -> None:
    with _child(touch_mib=512, threads=3) as pid:
        os.kill(pid, signal.SIGKILL)
        # Not reaped until the context ends: the leader stays, in do_exit or
        # a zombie; the other threads may be in any part of their exit.
        lowered = priority.idle_teardown(pid)
        assert pid in lowered and len(lowered) <= 4
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        if priority.may_restore():
            assert 1 <= priority.restore(pid, lowered) <= len(lowered)
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER


def test_a_living_process_is_never_touched() -> None:
    with _child(touch_mib=0, threads=3) as pid:
        time.sleep(0.1)
        assert priority.idle_teardown(pid) == []
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert len(tids) == 4
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        # An id that is not on its way out (reused since) is not put back.
        assert priority.restore(pid, tids) == 0
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert {os.sched_getscheduler(t) for t in tids[1:]} == {os.SCHED_OTHER}


def test_a_process_already_gone_is_nothing_to_do() -> None:
    with _child(touch_mib=0, threads=0) as pid:
        pass
    assert priority.idle_teardown(pid) == []
    assert priority.restore(pid, [pid]) == 0


def _stat(flags: int, comm: str = "python") -> str:
    return f"4242 ({comm}) S 1 4242 4242 0 -1 {flags} 0 0 0 0 5 3 0 0 20 0 1 0"


def _status(pending: int = 0, shared: int = 0) -> str:
    return f"Name:\tpython\nSigQ:\t0/1\nSigPnd:\t{pending:016x}\nShdPnd:\t{shared:016x}\n"


def test_on_the_way_out_is_pf_exiting_or_a_pending_sigkill() -> None:
    assert not priority.in_exit(_stat(0x400040))  # a living thread's usual flags
    assert priority.in_exit(_stat(0x400040 | priority.PF_EXITING))
    # A name may hold ") " and digits: the fields are counted after the last ")".
    assert not priority.in_exit(_stat(0, comm="x) S 1 2 3 4 5 4 (y"))
    assert priority.in_exit(_stat(priority.PF_EXITING, comm="a) 4 4"))
    kill = 1 << (signal.SIGKILL - 1)
    assert priority.kill_pending(_status(pending=kill))  # a group kill, or an exec's de_thread
    assert priority.kill_pending(_status(shared=kill))
    assert not priority.kill_pending(_status(pending=1 << (signal.SIGTERM - 1)))
    # This very thread: alive.
    me = Path(f"/proc/self/task/{threading.get_native_id()}")
    assert not priority.in_exit((me / "stat").read_text())
    assert not priority.kill_pending((me / "status").read_text())
