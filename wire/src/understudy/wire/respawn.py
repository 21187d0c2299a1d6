"""``understudy respawn -- CMD ...``: run CMD as a child and start it again in
place when it dies, by the restart policy of ``understudy.wire.restart``.

Why: kubelet restarts a container that exits with CrashLoopBackOff (10 s,
doubling to 5 min, reset after 10 min of running), so on a stock node the
second engine death within ten minutes leaves the pod without a standby for
10 s or more, and the next death is an outage. With the respawner as the
container's process, a death costs a process start (docs/pod.md). The dead
process still dies whole: its lock connection closes (the lock is the
connection), its mappings and its memory go with it, and whatever it forked
is killed with its process group. The respawner holds no lock, no GMS
session and no socket of the child's; it imports nothing but the standard
library and this package.

The thin shell around the pure policy:

- fork and exec CMD in a process group of its own, with ``PR_SET_PDEATHSIG``
  (the child dies with the respawner) and two variables: ``UNDERSTUDY_NOTIFY_FD``,
  the write end of a pipe on which the child says it started
  (:func:`notify_ready`, ``READY=1`` as systemd's sd_notify), and
  ``UNDERSTUDY_RESTARTS``, how many children came before it;
- SIGTERM and SIGINT go to the child, and the respawner exits with its code
  once it has ended; SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are passed on as
  they come;
- every child that ends is reaped at once, and so is any orphan: the
  respawner is a child subreaper (``PR_SET_CHILD_SUBREAPER``), which a
  container's init must be when the pod does not share one PID namespace;
- when the child ends, the rest of its process group is SIGKILLed.

One loop, no threads: ``select`` on the signal wake-up pipe and the child's
notify pipe, with the back-off deadline as the timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import assert_never

from understudy.wire import restart
from understudy.wire.obs import log_event, setup_logging

log = logging.getLogger("understudy.respawn")

NOTIFY_FD = "UNDERSTUDY_NOTIFY_FD"
RESTARTS = "UNDERSTUDY_RESTARTS"
READY = b"READY=1\n"

_STOP = (signal.SIGTERM, signal.SIGINT)
_PASS_ON = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


# --------------------------------------------------------- the child's side --


def notify_ready() -> bool:
    """Tell the respawner (if any) that this process started: call it once,
    when the process has proved it can start (an engine in Standby, a front
    that listens). Returns whether there was a respawner to tell."""
    fd = os.environ.pop(NOTIFY_FD, None)
    if not fd:
        return False
    try:
        os.write(int(fd), READY)
    except (OSError, ValueError):
        return False
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.close(int(fd))
    return True


def restarts() -> int:
    """How many processes the respawner started before this one (0 without one)."""
    try:
        return int(os.environ.get(RESTARTS, "0"))
    except ValueError:
        return 0


# ------------------------------------------------------------------ the shell --


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the code, or 128 + the signal."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


class Respawner:
    def __init__(self, argv: Sequence[str], policy: restart.Policy) -> None:
        if not argv:
            raise ValueError("respawn needs a command")
        self.argv = list(argv)
        self.policy = policy
        self.child: int | None = None
        self._notify: int | None = None  # read end of the child's notify pipe
        self._exited: int | None = None  # the child's exit code, once reaped
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.state: restart.RestartState | None = None

    # --- children -------------------------------------------------------------

    def _start(self, number: int) -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        env = {**os.environ, NOTIFY_FD: str(w), RESTARTS: str(number)}
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: only async-signal-safe-ish steps, then exec
            try:
                signal.set_wakeup_fd(-1)
                os.setpgid(0, 0)
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != parent:  # the respawner died before prctl
                    os._exit(1)
                os.set_inheritable(w, True)
                os.execvpe(self.argv[0], self.argv, env)
            except BaseException as exc:  # exec failed: a start failure
                with contextlib.suppress(Exception):
                    os.write(2, f"respawn: cannot run {self.argv[0]}: {exc}\n".encode())
            finally:
                os._exit(127)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # also here: no race with a signal to the group
        os.close(w)
        self.child, self._notify, self._exited = pid, r, None
        log_event(log, "child_started", pid=pid, restarts=number, command=self.argv[0])

    def _signal_child(self, sig: int) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, sig)

    def _reap(self) -> None:
        """Collect every ended child; the tracked one's end becomes ``_exited``."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid != self.child:
                log_event(log, "reaped", logging.DEBUG, pid=pid, code=exit_code(status))
                continue
            self._exited = exit_code(status)
            # What the dead child left behind in its group dies with it, as a
            # container's processes do when its main process ends.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _read_notify(self) -> bool:
        """Whether the child said READY (the pipe is closed after that, or at EOF)."""
        if self._notify is None:
            return False
        try:
            data = os.read(self._notify, 4096)
        except BlockingIOError:
            return False
        if not data or READY.strip() in data:
            os.close(self._notify)
            self._notify = None
        return READY.strip() in data

    # --- the loop -------------------------------------------------------------

    def _feed(self, event: restart.Event, now: float) -> int | None:
        assert self.state is not None
        try:
            self.state, actions = restart.step(self.state, event, now)
        except restart.InvalidTransition as exc:  # never end PID 1 on our own bug
            log_event(log, "invalid_transition", logging.ERROR, error=exc)
            return None
        return self._do(actions)

    def _do(self, actions: list[restart.Action]) -> int | None:
        code: int | None = None
        for action in actions:
            match action:
                case restart.Start(restarts=number):
                    self._start(number)
                case restart.Signal(signal=sig):
                    self._signal_child(sig)
                case restart.ArmTimer():
                    pass  # the loop's select waits until state.deadline
                case restart.Exit(code=c, reason=reason):
                    level = logging.INFO if c == 0 else logging.ERROR
                    log_event(log, "exit", level, code=c, reason=reason)
                    code = c
                case restart.Note(event=event, fields=fields):
                    log_event(log, event, **dict(fields), child=self.child)
                case _:
                    assert_never(action)
        return code

    def _signals(self) -> list[int]:
        try:
            data = os.read(self._wake_r, 4096)
        except BlockingIOError:
            return []
        return list(data)

    def _events(self, now: float) -> list[restart.Event]:
        events: list[restart.Event] = []
        # The notify pipe before the child's end: a child that said READY and
        # then died had started, whatever order the two were noticed in.
        if self._notify is not None and self._read_notify():
            events.append(restart.Ready())
        for sig in self._signals():
            if sig in _STOP:
                events.append(restart.Stop(sig))
            elif sig in _PASS_ON:
                self._signal_child(sig)
        self._reap()
        if self._exited is not None and self.child is not None:
            events.append(restart.Exited(self._exited))
            self.child = None
            if self._notify is not None:
                os.close(self._notify)
                self._notify = None
        deadline = self.state.deadline if self.state else None
        if deadline is not None and now >= deadline:
            events.append(restart.BackoffOver())
        return events

    def run(self) -> int:
        with contextlib.suppress(OSError):
            _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        for sig in (*_STOP, *_PASS_ON, signal.SIGCHLD):
            signal.signal(sig, lambda *_: None)  # the wake-up fd carries the number
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self.state, actions = restart.initial(time.monotonic(), self.policy)
        code = self._do(actions)
        while code is None:
            deadline = self.state.deadline
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            fds = [self._wake_r] + ([self._notify] if self._notify is not None else [])
            select.select(fds, [], [], timeout)
            now = time.monotonic()
            for event in self._events(now):
                code = self._feed(event, now)
                if code is not None:
                    break
        return code


# -------------------------------------------------------------------- the CLI --


def _policy(args: argparse.Namespace) -> restart.Policy:
    return restart.Policy(args.backoff_initial, args.backoff_max, args.give_up_after)


def cmd_respawn(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("understudy respawn: no command (respawn [OPTIONS] -- CMD ...)", file=sys.stderr)
        return 2
    setup_logging()
    return Respawner(argv, _policy(args)).run()


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = restart.Policy()
    p = sub.add_parser(
        "respawn",
        help="run a command and start it again in place when it dies (a container's "
        "init; docs/pod.md)",
    )
    p.add_argument(
        "--backoff-initial",
        type=float,
        default=d.initial_s,
        help="seconds before the first restart of a command that failed to start",
    )
    p.add_argument("--backoff-max", type=float, default=d.max_s, help="cap of that back-off")
    p.add_argument(
        "--give-up-after",
        type=int,
        default=d.give_up_after,
        help="start failures in a row after which respawn exits with the command's code",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG ...]")
    p.set_defaults(func=cmd_respawn)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="understudy")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["respawn", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
