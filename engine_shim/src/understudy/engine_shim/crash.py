"""A crashing engine dies at once: no core file, no library's crash report.

The lock is the engine's connection, and its end is what starts the failover;
the kernel closes a dying process's files only once the process is gone. Two
things kept a crashed engine's lock held after its death:

- the core file, which the kernel writes before it closes the files:
  gigabytes for an LLM engine (SIGSEGV to the next grant took 2.0-3.1 s for
  a vLLM engine on the cluster, against 0.12 s for SIGKILL), and left in the
  pod. A zero size limit alone does not stop a core piped to a collector
  (systemd-coredump, apport); a process that is not dumpable writes none.
- a native crash handler a library installs: tvm-ffi, which vLLM imports,
  prints a symbolized backtrace of every thread on SIGSEGV before the process
  dies (1.3-2.2 s here; 79-85 ms from SIGSEGV to the socket's end without it).

``UNDERSTUDY_CORE_DUMPS=on`` keeps both, to debug a crash (a process that is
not dumpable also refuses a debugger).
"""

from __future__ import annotations

import os
import signal

_PR_SET_DUMPABLE = 4
# The signals a crash raises; a handler of a library's delays the death.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT)


def keep_reports() -> bool:
    """Whether the operator asked for cores and crash reports."""
    return os.environ.get("UNDERSTUDY_CORE_DUMPS", "off") == "on"


def no_core_dumps() -> None:
    """No core file on a crash: a core size limit of 0 and not dumpable. Called
    first thing in the engine's process."""
    if keep_reports():
        return
    import ctypes
    import ctypes.util
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def die_at_once() -> int:
    """Give the crash signals back their default action where native code
    installed a handler; how many it reset. Called once the engine has loaded
    everything it imports (before Standby), whichever adapter it runs."""
    if keep_reports():
        return 0
    caught = caught_signals()
    reset = 0
    for sig in CRASH_SIGNALS:
        # Python cannot see a handler installed by native code (getsignal
        # still says SIG_DFL): the kernel's view is /proc's.
        if sig in caught and not callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)
            reset += 1
    return reset


def caught_signals() -> set[int]:
    """The signals this process has a handler for (SigCgt of /proc/self/status)."""
    with open("/proc/self/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}
