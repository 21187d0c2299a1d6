"""CPU priority that yields to the engine that serves: whether a process may
take a lowered priority back, and a dead process's teardown put behind the
rest for a while (SCHED_IDLE).

Why the teardown: Linux frees a killed process's memory in that process's
own context, at its own priority. A killed engine with 1 GiB touched took
63-85 ms from SIGKILL to reaped here, on one of the pod's cores, while the
next engine wakes and runs its first step on the same cores. Where the lock
goes on at the death word (``--grant-at-death``: the next engine needs none
of that memory), nothing waits for the teardown, so it can wait for idle CPU
for the first steps (`TEARDOWN_IDLE_S`), and then finish at its own priority
again: under a saturated CPU an idle thread gets ~0.3 % of it (CFS weight 3
against 1024), and the respawner restarts the engine only once it is reaped.
A local failover's kill -> next token went 7-10 ms shorter at 16 tokens and
9-17 ms at 4,000, on both engines (alternated runs; docs/performance.md,
2026-12-06, afternoon).

Only where the priority can be put back (`may_restore`: CAP_SYS_NICE;
sched(7): leaving SCHED_IDLE needs it). And a thread's policy weighs only
against the threads of its own group: the local runner keeps a pod's
processes in one (tools.local); in Kubernetes each engine is a container,
a cgroup of its own, which the policy of its threads does not cross.

Only threads already on their way out are touched: a thread in ``do_exit``
(``PF_EXITING``) or with SIGKILL pending. An ``exec`` also ends the death
word's thread, but the thread that execs has neither, so a process that
lives on keeps its priority. A pid from another PID namespace (a pod that
does not share its process namespace) names another process or none; it is
touched only if it too is dying.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Final

CAP_SYS_NICE: Final = 23  # capabilities(7)
PF_EXITING: Final = 0x00000004  # include/linux/sched.h
# A dead process's teardown waits for idle CPU this long at most: the wake
# and the continuations' first steps, not the engine's restart.
TEARDOWN_IDLE_S: Final = 1.0
_FLAGS_FIELD: Final = 6  # /proc/<pid>/stat, counted after the ")" that ends comm
_SIGKILL: Final = 1 << (signal.SIGKILL - 1)
_PROC: Final = Path("/proc")


def may_restore(status: str | None = None) -> bool:
    """Whether this process may put threads' priority back: CAP_SYS_NICE in
    its effective set (``status``: the text of /proc/self/status)."""
    if status is None:
        try:
            status = (_PROC / "self" / "status").read_text()
        except OSError:
            return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def in_exit(stat: str) -> bool:
    """Whether a thread is in ``do_exit`` (``PF_EXITING``), from its /proc
    ``stat`` text (its name may hold ")")."""
    fields = stat.rpartition(")")[2].split()
    return len(fields) > _FLAGS_FIELD and bool(int(fields[_FLAGS_FIELD]) & PF_EXITING)


def kill_pending(status: str) -> bool:
    """Whether SIGKILL is pending for a thread or its group, from its /proc
    ``status`` text: a group kill and an exec's ``de_thread`` post it to each
    thread, before the thread runs its exit."""
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL:
            return True
    return False


def idle_teardown(pid: int) -> list[int]:
    """Put each thread of ``pid`` that is on its way out under SCHED_IDLE;
    returns their ids (for `restore`). Raises PermissionError where the
    kernel refuses (the caller logs the lost hint); a thread or process
    already gone is skipped."""
    try:
        tids = [int(t) for t in os.listdir(_PROC / str(pid) / "task")]
    except (FileNotFoundError, ProcessLookupError):
        return []
    lowered = [tid for tid in tids if _dying(pid, tid)]
    for tid in lowered:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    return lowered


def restore(pid: int, tids: Iterable[int]) -> int:
    """Put ``tids`` (`idle_teardown`'s, of ``pid``) still on their way out
    back at SCHED_OTHER; returns how many were. Raises PermissionError
    without CAP_SYS_NICE."""
    restored = 0
    for tid in tids:
        if _dying(pid, tid):  # not an id reused since
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                restored += 1
    return restored


def _dying(pid: int, tid: int) -> bool:
    task = _PROC / str(pid) / "task" / str(tid)
    try:
        # status only where stat does not say it: a killed engine's threads
        # are mostly in their exit already.
        return in_exit((task / "stat").read_text()) or kill_pending((task / "status").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return False
