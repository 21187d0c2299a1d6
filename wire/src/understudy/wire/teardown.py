"""A dead process's teardown, put behind the work that serves (SCHED_IDLE).

Why: Linux frees a killed process's memory in that process's own context, at
its own priority. A killed engine with 1 GiB touched took 63-85 ms from
SIGKILL to reaped here, on one of the pod's cores, while the next engine
wakes and runs its first step on the same cores. Where the lock goes on at
the death word (``--grant-at-death``: the next engine needs none of that
memory), nothing waits for the teardown, so it can wait for idle CPU: a
local ``llama`` failover's kill -> next token went 72 -> 65 ms at 16 tokens
and 101 -> 91 ms at 4,000 (docs/performance.md, 2026-12-06).

Only threads already on their way out are touched: a thread in ``do_exit``
(``PF_EXITING``) or with SIGKILL pending. An ``exec`` also ends the death
word's thread, but the thread that execs has neither, so a process that
lives on keeps its priority. A pid from another PID namespace (a pod that
does not share its process namespace) names another process or none; it is
touched only if it too is dying. Refused (another user, no CAP_SYS_NICE) is
a lost hint, never a failure: the teardown then runs as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Final

PF_EXITING: Final = 0x00000004  # include/linux/sched.h
_FLAGS_FIELD: Final = 6  # /proc/<pid>/stat, counted after the ")" that ends comm
_SIGKILL: Final = 1 << (signal.SIGKILL - 1)
_PROC: Final = Path("/proc")


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


def idle_teardown(pid: int) -> int:
    """Put each thread of ``pid`` that is on its way out under SCHED_IDLE;
    returns how many were. Raises PermissionError where the kernel refuses
    (the caller logs the lost hint); a thread or process already gone is
    skipped."""
    lowered = 0
    try:
        tids = [int(t) for t in os.listdir(_PROC / str(pid) / "task")]
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for tid in tids:
        task = _PROC / str(pid) / "task" / str(tid)
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            # status only where stat does not say it: a killed engine's
            # threads are mostly in their exit already.
            if in_exit((task / "stat").read_text()) or kill_pending((task / "status").read_text()):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                lowered += 1
    return lowered
