"""A restarted engine's start-up runs at a lower CPU priority, on its own thread,
and the threads that serve keep the normal one (mainloop.run_yielding)."""

from __future__ import annotations

import os
import threading

import pytest

from understudy.engine_shim.mainloop import STARTUP_NICE, run_yielding


def _priority() -> tuple[int, int]:
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_work_runs_lower_and_the_caller_and_later_threads_do_not() -> None:
    before = _priority()
    seen: list[tuple[int, int]] = []
    run_yielding(lambda: seen.append(_priority()), "start-up")
    assert seen == [(os.SCHED_BATCH, max(before[1], STARTUP_NICE))]
    assert _priority() == before
    later: list[tuple[int, int]] = []  # a thread the caller starts after (the batcher)
    thread = threading.Thread(target=lambda: later.append(_priority()))
    thread.start()
    thread.join()
    assert later == [before]


def test_what_the_work_raises_reaches_the_caller() -> None:
    def fail() -> None:
        raise RuntimeError("no weights")

    with pytest.raises(RuntimeError, match="no weights"):
        run_yielding(fail, "start-up")
