"""A restarted engine's start-up runs at a lower CPU priority, on its own thread,
and the threads that serve keep the normal one (mainloop.run_yielding)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from understudy.engine_shim.cli import STARTUP_DEFER_S, defer_if_restarted
from understudy.engine_shim.mainloop import STARTUP_NICE, lowered_policy, run_yielding
from understudy.wire import respawn
from understudy.wire.priority import may_restore


def _priority() -> tuple[int, int]:
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_work_runs_lower_and_the_caller_and_later_threads_do_not() -> None:
    before = _priority()
    seen: list[tuple[int, int]] = []
    run_yielding(lambda: seen.append(_priority()), "start-up")
    assert seen == [(lowered_policy(), max(before[1], STARTUP_NICE))]
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


def test_after_its_time_the_work_runs_at_the_callers_priority_again() -> None:
    """A start-up longer than ``most_s`` gets its normal priority back (and so
    do the threads it started) where the process may raise it; unprivileged,
    it keeps yielding (sched(7))."""
    before = _priority()
    seen: list[tuple[int, int]] = []

    def work() -> None:
        seen.append(_priority())
        child: list[tuple[int, int]] = []
        started = threading.Event()
        release = threading.Event()

        def helper() -> None:  # a thread the start-up starts (an OpenMP team's)
            started.set()
            release.wait(5)
            child.append(_priority())

        t = threading.Thread(target=helper)
        t.start()
        started.wait(5)
        time.sleep(0.6)
        release.set()
        t.join()
        seen.append(_priority())
        seen.extend(child)

    run_yielding(work, "start-up", most_s=0.2)
    lowered = (lowered_policy(), max(before[1], STARTUP_NICE))
    assert seen[0] == lowered
    if os.geteuid() == 0:
        assert seen[1:] == [before, before]
    else:
        assert seen[1:] == [lowered, lowered]
    assert _priority() == before


def test_a_restarted_engine_starts_late_so_the_new_active_steps_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a failover the new Active's first steps take the CPU before the
    restarted engine's start-up begins, its imports included: a process the
    respawner started again waits `STARTUP_DEFER_S` first; a first start
    does not."""
    assert STARTUP_DEFER_S >= 0.5
    slept: list[float] = []
    monkeypatch.setenv(respawn.RESTARTS, "0")
    assert defer_if_restarted(slept.append) == 0 and slept == []
    monkeypatch.setenv(respawn.RESTARTS, "2")
    assert defer_if_restarted(slept.append) == STARTUP_DEFER_S and slept == [STARTUP_DEFER_S]


def test_with_a_clock_the_yield_is_timed_from_it_and_the_call_waits_for_it() -> None:
    """A spare's imports (engine cli): they yield for as long as the spare
    waits for its turn, however long, and ``most_s`` counts from the turn."""
    before = _priority()
    lowered = (lowered_policy(), max(before[1], STARTUP_NICE))
    seen: list[tuple[int, int]] = []
    done = threading.Event()
    turn = threading.Event()

    def work() -> None:
        time.sleep(0.5)  # past most_s: without the clock, restored by now (as root)
        seen.append(_priority())
        done.set()

    def clock() -> None:  # the turn comes after the work is done
        done.wait(5)
        turn.set()

    run_yielding(work, "spare-imports", most_s=0.1, clock=clock)
    assert turn.is_set() and seen == [lowered]
    assert _priority() == before

    late: list[tuple[int, int]] = []
    release = threading.Event()

    def long_work() -> None:  # the turn comes while it still runs
        release.wait(5)
        time.sleep(0.6)
        late.append(_priority())

    run_yielding(long_work, "spare-imports", most_s=0.2, clock=release.set)
    assert late == [before if os.geteuid() == 0 else lowered]


def test_a_restarts_deferral_counts_from_its_death(monkeypatch: pytest.MonkeyPatch) -> None:
    """A promoted spare still importing at its turn has spent its deferral
    importing (at the lower priority): what is left of it is waited, no more."""
    monkeypatch.setenv(respawn.RESTARTS, "1")
    slept: list[float] = []
    now = time.monotonic()
    assert defer_if_restarted(slept.append, since=now - STARTUP_DEFER_S - 1) == 0
    assert slept == []
    waited = defer_if_restarted(slept.append, since=now - STARTUP_DEFER_S / 4)
    assert STARTUP_DEFER_S / 2 < waited <= STARTUP_DEFER_S * 3 / 4 and slept == [waited]


def test_idle_only_where_the_priority_can_be_put_back() -> None:
    """SCHED_IDLE gives the Active engine's threads the CPU the instant they
    wake; a process without CAP_SYS_NICE could never leave it (sched(7)), so
    it yields with SCHED_BATCH at nice 10 instead."""
    root = "Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n"
    pod = "Name:\tpython\nCapEff:\t00000000a80425fb\n"  # a container's defaults
    assert may_restore(root) and lowered_policy(root) == os.SCHED_IDLE
    assert not may_restore(pod) and lowered_policy(pod) == os.SCHED_BATCH
    assert not may_restore("Name:\tpython\n")
    with open("/proc/self/status") as f:
        assert lowered_policy() == lowered_policy(f.read())
