"""A restarted engine's start-up runs at a lower CPU priority, on its own thread,
and the threads that serve keep the normal one (mainloop.run_yielding)."""

from __future__ import annotations

import os
import threading

import pytest

from understudy.engine_shim.mainloop import (
    STARTUP_NICE,
    autogroup_nice,
    run_yielding,
    set_autogroup_nice,
)


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


@pytest.mark.skipif(autogroup_nice() != 0, reason="no autogroup at nice 0 (sched(7))")
def test_the_process_autogroup_yields_for_the_work_only() -> None:
    """A thread's nice counts only within its autogroup, and each local engine
    is a session (an autogroup) of its own: the whole process yields while
    the work runs, and is back at 0 for the threads that serve."""
    seen: list[int | None] = []
    try:
        run_yielding(lambda: seen.append(autogroup_nice()), "start-up")
        assert seen == [STARTUP_NICE]
        assert autogroup_nice() == 0
    finally:
        set_autogroup_nice(0, tries=100)
