"""The respawner: ``understudy respawn -- CMD ...`` runs CMD as a child and
starts it again in place when it dies, by the restart policy of
``understudy.respawner.restart``.

Why: kubelet restarts a container that exits with CrashLoopBackOff (10 s,
doubling to 5 min, reset after 10 min of running), so on a stock node the
second engine death within ten minutes leaves the pod without a standby for
10 s or more, and the next death is an outage. With the respawner as the
container's process, a death costs a process start (docs/pod.md). The dead
process still dies whole: its lock connection closes (the lock is the
connection), its mappings and its memory go with it, and whatever it forked
is killed with its process group. The respawner holds no lock, no GMS
session and no socket of the child's; it imports nothing but the standard
library, ``understudy.wire`` (the child's side of its contract, ``wire.respawn``,
and logging) and its policy.

The thin shell around the pure policy:

- fork and exec CMD in a process group of its own, with ``PR_SET_PDEATHSIG``
  (the child dies with the respawner) and two variables: ``UNDERSTUDY_NOTIFY_FD``,
  the write end of a pipe on which the child says it started
  (``wire.respawn.notify_ready``, ``READY=1`` as systemd's sd_notify), and
  ``UNDERSTUDY_RESTARTS``, how many children came before it;
- SIGTERM and SIGINT go to the child, and the respawner exits with its code
  once it has ended; SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are passed on as
  they come;
- every child that ends is reaped at once, and so is any orphan: the
  respawner is a child subreaper (``PR_SET_CHILD_SUBREAPER``), which a
  container's init must be when the pod does not share one PID namespace;
- when the child ends, the rest of its process group is SIGKILLed;
- ``--listen NAME=HOST:PORT`` (socket activation, as systemd's): the
  respawner binds the port once and every child inherits the listening
  socket (``UNDERSTUDY_LISTEN_FDS``: ``NAME=FD,…``; ``wire.respawn.inherited_socket``).
  The port never closes while a child restarts: a connection waits in the
  kernel's backlog for the next child instead of being refused. That is what
  keeps kubelet's probes of the status port passing through a restart in
  place; only connections the dead child had accepted are reset.

One loop, no threads: ``select`` on the signal wake-up pipe and the child's
notify pipe, with the back-off deadline as the timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from understudy.respawner import restart
from understudy.wire.obs import log_event
from understudy.wire.respawn import (
    GO_FD,
    LISTEN_FDS,
    NOTIFY_FD,
    READY,
    RESTARTS,
    go_line,
    listen_fds,
)

log = logging.getLogger("understudy.respawn")

_STOP = (signal.SIGTERM, signal.SIGINT)
_PASS_ON = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def listen(spec: str) -> tuple[str, socket.socket]:
    """``NAME=HOST:PORT`` -> (name, a TCP socket listening there)."""
    name, sep, address = spec.partition("=")
    host, _, port = address.rpartition(":")
    if not sep or not name or not port.isdigit():
        raise ValueError(f"--listen wants NAME=HOST:PORT, got {spec!r}")
    sock = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]") or "0.0.0.0", int(port)))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return name, sock


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the code, or 128 + the signal."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


@dataclass(slots=True)
class _Proc:
    """A process the respawner started: the child, or the spare."""

    pid: int
    notify: int | None  # read end of its notify pipe (READY)
    go: int | None = None  # write end of a spare's go pipe
    code: int | None = None  # its exit code, once reaped

    def close(self) -> None:
        for fd in (self.notify, self.go):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.notify = self.go = None


class Respawner:
    def __init__(
        self,
        argv: Sequence[str],
        policy: restart.Policy,
        listeners: Sequence[tuple[str, socket.socket]] = (),
    ) -> None:
        if not argv:
            raise ValueError("respawn needs a command")
        self.argv = list(argv)
        self.policy = policy
        self.listeners = list(listeners)  # bound once, inherited by every child
        self.child: _Proc | None = None
        self.spare: _Proc | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.state: restart.RestartState | None = None

    # --- children -------------------------------------------------------------

    def _spawn(self, extra: dict[str, str], keep: list[int]) -> int:
        """fork + exec the command with ``extra`` in its environment and ``keep``
        inherited; in a process group of its own, dying with the respawner."""
        env = {**os.environ, **extra}
        if self.listeners:
            env[LISTEN_FDS] = listen_fds((n, s.fileno()) for n, s in self.listeners)
            keep = [*keep, *(s.fileno() for _, s in self.listeners)]
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: a few plain steps, then exec
            try:
                signal.set_wakeup_fd(-1)
                os.setpgid(0, 0)
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != parent:  # the respawner died before prctl
                    os._exit(1)
                for fd in keep:
                    os.set_inheritable(fd, True)
                os.execvpe(self.argv[0], self.argv, env)
            except BaseException as exc:  # exec failed: a start failure
                with contextlib.suppress(Exception):
                    os.write(2, f"respawn: cannot run {self.argv[0]}: {exc}\n".encode())
            finally:
                os._exit(127)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # also here: no race with a signal to the group
        return pid

    def _start(self, number: int) -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        pid = self._spawn({NOTIFY_FD: str(w), RESTARTS: str(number)}, [w])
        os.close(w)
        self.child = _Proc(pid, r)
        log_event(log, "child_started", pid=pid, restarts=number, command=self.argv[0])

    def _start_spare(self) -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        pid = self._spawn({NOTIFY_FD: str(w), GO_FD: str(go_r)}, [w, go_r])
        os.close(w)
        os.close(go_r)
        self.spare = _Proc(pid, r, go_w)
        log_event(log, "spare_started", pid=pid)

    def _go(self, number: int) -> None:
        """The spare becomes the child."""
        spare, self.spare = self.spare, None
        assert spare is not None and spare.go is not None
        with contextlib.suppress(OSError):  # it died meanwhile: reaped as the child
            os.write(spare.go, go_line(number))
        os.close(spare.go)
        spare.go = None
        self.child = spare
        log_event(log, "spare_promoted", pid=spare.pid, restarts=number)

    def _stop_spare(self) -> None:
        if self.spare is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.spare.pid, signal.SIGKILL)

    def _signal_child(self, sig: int) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, sig)

    def _reap(self) -> None:
        """Collect every ended process; the child's and the spare's codes are kept."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ours = [p for p in (self.child, self.spare) if p is not None and p.pid == pid]
            if not ours:
                log_event(log, "reaped", logging.DEBUG, pid=pid, code=exit_code(status))
                continue
            ours[0].code = exit_code(status)
            # What the dead process left behind in its group dies with it, as a
            # container's processes do when its main process ends.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _said_ready(self) -> bool:
        """Whether the child said READY (its pipe is closed after that, or at EOF)."""
        child = self.child
        if child is None or child.notify is None:
            return False
        try:
            data = os.read(child.notify, 4096)
        except BlockingIOError:
            return False
        if not data or READY.strip() in data:
            os.close(child.notify)
            child.notify = None
        return READY.strip() in data

    # --- the loop -------------------------------------------------------------

    def _feed(self, event: restart.Event, now: float) -> int | None:
        assert self.state is not None
        try:
            self.state, actions = restart.step(self.state, event, now)
        except restart.InvalidTransition as exc:  # never end an init on our own bug
            log_event(log, "invalid_transition", logging.ERROR, error=exc)
            return None
        return self._do(actions)

    def _do(self, actions: list[restart.Action]) -> int | None:
        code: int | None = None
        for action in actions:
            match action:
                case restart.Start(restarts=number):
                    self._start(number)
                case restart.StartSpare():
                    self._start_spare()
                case restart.Go(restarts=number):
                    self._go(number)
                case restart.StopSpare():
                    self._stop_spare()
                case restart.Signal(signal=sig):
                    self._signal_child(sig)
                case restart.ArmTimer():
                    pass  # the loop's select waits until state.deadline
                case restart.Exit(code=c, reason=reason):
                    level = logging.INFO if c == 0 else logging.ERROR
                    log_event(log, "exit", level, code=c, reason=reason)
                    code = c
                case restart.Note(event=event, fields=fields):
                    pid = self.child.pid if self.child is not None else None
                    log_event(log, event, **dict(fields), child=pid)
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
        if self._said_ready():
            events.append(restart.Ready())
        for sig in self._signals():
            if sig in _STOP:
                events.append(restart.Stop(sig))
            elif sig in _PASS_ON:
                self._signal_child(sig)
        self._reap()
        if self.spare is not None and self.spare.code is not None:
            events.append(restart.SpareExited(self.spare.code))
            self.spare.close()
            self.spare = None
        if self.child is not None and self.child.code is not None:
            events.append(restart.Exited(self.child.code))
            self.child.close()
            self.child = None
        deadline = self.state.deadline if self.state else None
        if deadline is not None and now >= deadline:
            events.append(restart.TimerFired())
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
            notify = self.child.notify if self.child is not None else None
            fds = [self._wake_r] + ([notify] if notify is not None else [])
            select.select(fds, [], [], timeout)
            now = time.monotonic()
            for event in self._events(now):
                code = self._feed(event, now)
                if code is not None:
                    break
        self._stop_spare()
        return code
