"""The front's witness: a process that shares the front's descriptor table.

The lock server keeps a copy of every client connection (``connhold``), but
a copy is made after the ``accept``: between the two, the front alone held
the connection, and a front killed there reset its client. On a loaded node
the front is often preempted at the ``accept``'s return, and a drill's kill
landed in that window about once in 35 (docs/connections.md).

No ``accept`` can put a connection in two processes at once, but two
processes can share one descriptor table: ``clone(CLONE_FILES)`` without
``exec``. A descriptor the front's ``accept`` makes is the witness's from
the same instant, and the kernel closes what the table holds only when the
last process sharing it is gone. So the witness sleeps until the front has
died (``PR_SET_PDEATHSIG``), then hands every client connection still in
the table to the keeper, as ``hold`` messages on the dead front's own keeper
socket (the keeper is still reading that socket's session, and reads it to
its end before it answers the next front's ``adopt``), and exits. The keeper
keeps the ones it does not hold yet (it compares sockets by inode), and the
next front adopts them: a connection whose record the front had written
under its own id gets it back (the record names its socket's inode), one
with no record is served from its first byte, and the kernel's byte counts
refuse one that was read from (``connlog.plan``).

Why a raw ``clone`` and so much care: ``exec`` unshares the table, so the
witness must stay a copy of the front's Python process; and until the front
is dead, anything the witness closed would close the front's descriptor.
The witness is therefore made before the front has any thread (no lock is
held in the copy), turns the garbage collector off at once, and runs nothing
but a ``sigwait`` until the front's death. It leaves the front's process
group, so the respawner's ``killpg`` of the dead front does not take it, and
it ends itself after ``_DEADLINE_S`` (``SIGALRM``) whatever happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import platform
import signal
import socket
import stat
from pathlib import Path

from understudy.wire import connhold, uds
from understudy.wire.obs import log_event, setup_logging

log = logging.getLogger("understudy.front.witness")

_CLONE_FILES = 0x400
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
_PR_SET_PDEATHSIG = 1
_WAKE = signal.SIGUSR2  # the front's death, delivered to the witness
_DEADLINE_S = 5  # from the front's death: a witness stuck past this ends itself


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def start(run_dir: Path, port: int) -> int | None:
    """Make this front's witness; its pid (None: none was made, and why is logged).

    Call it before any thread starts: the witness is a copy of this process
    in which only the calling thread goes on."""
    nr = _SYS_CLONE.get(platform.machine())
    threads = _threads()
    if nr is None or threads != 1:
        log_event(
            log, "witness_unmade", logging.WARNING, machine=platform.machine(),
            threads=threads,
            consequence="a front killed between an accept and the keeper's copy resets "
            "that client",
        )  # fmt: skip
        return None
    parent = os.getpid()
    # PyDLL keeps the GIL across the call: the copy goes on holding it.
    libc = ctypes.PyDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    zero = ctypes.c_long(0)
    pid = int(libc.syscall(ctypes.c_long(nr), ctypes.c_long(_CLONE_FILES | signal.SIGCHLD),
                           zero, zero, zero, zero))  # fmt: skip
    if pid == 0:
        _witness(parent, run_dir, port)  # never returns
    if pid < 0:
        err = ctypes.get_errno()
        log_event(log, "witness_unmade", logging.WARNING, error=os.strerror(err))
        return None
    with contextlib.suppress(OSError):  # the witness does the same (whichever runs first)
        os.setpgid(pid, pid)
    return pid


def _witness(parent: int, run_dir: Path, port: int) -> None:
    """The witness's whole life."""
    gc.disable()  # a cycle collected now could close one of the front's descriptors
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_BLOCK, {_WAKE})
        libc = ctypes.PyDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(_WAKE), 0, 0, 0)
        if os.getppid() == parent:  # else the front died before the prctl
            signal.sigwait({_WAKE})
        # The front is gone: from here on the table is the witness's alone.
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
        signal.alarm(_DEADLINE_S)
        setup_logging()
        handed = hand_over(run_dir / connhold.CONNS_SOCKET, port, parent)
        if handed:
            log_event(log, "witness_kept", front=parent, connections=handed)
    finally:
        os._exit(0)


def hand_over(keeper: Path, port: int, front: int) -> int:
    """Give the keeper, on the table's keeper socket, every client connection
    of ``port`` in this process's table; how many were given."""
    conns: dict[int, int] = {}  # inode -> descriptor, one each (the front may hold dups)
    session: socket.socket | None = None
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if not stat.S_ISSOCK(st.st_mode):
                continue
            sock = socket.socket(fileno=fd)
            try:
                if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_SEQPACKET:
                    if sock.getpeername() == str(keeper):
                        session = socket.socket(fileno=os.dup(fd))
                elif _client_of(sock, port):
                    conns.setdefault(st.st_ino, fd)
            finally:
                sock.detach()
    if session is None or not conns:
        return 0
    session.settimeout(1.0)
    given = 0
    for fd in conns.values():
        try:
            session.sendmsg([connhold.encode("hold", id=f"w{front}-{fd}")], [uds.rights(fd)])
        except OSError as exc:
            log_event(log, "witness_failed", logging.ERROR, front=front, error=str(exc))
            break
        given += 1
    return given


def _client_of(sock: socket.socket, port: int) -> bool:
    """Whether ``sock`` is a client's connection accepted on ``port``."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return False  # the listening socket
    sock.getpeername()  # OSError: not connected
    local_port: int = sock.getsockname()[1]
    return local_port == port
