"""A process's death, seen before Linux tears its memory down: a robust futex.

Why: the lock server sees its holder die when the holder's connection closes,
and Linux closes a killed process's files only after it has unmapped its
memory (``do_exit``: ``exit_mm`` before ``exit_files``). An engine maps the
model's weights and the KV pool and holds torch's and vLLM's heaps: SIGKILL
to EOF took 90-110 ms for a vLLM engine on SmolLM2 here (2.3 GB resident),
the largest single part of a failover (docs/performance.md). The kernel
handles a thread's *robust futex list* at the start of ``exit_mm``, before
the memory goes: a word on that list gets ``FUTEX_OWNER_DIED`` and a waiter
on it is woken at once.

- **The engine** (`arm`): a thread of its own writes its thread id and
  ``FUTEX_WAITERS`` into a 4-byte word in a small file of the pod's run
  directory (`word_path`, beside the engine's heartbeat), puts the word on
  its robust list (``set_robust_list``) and sleeps for the process's life.
  Only the end of the process (any end: a kill, a crash, an exit, an exec)
  ends that thread, so the word says "owner died" exactly when the process
  does.
- **The watcher** (`watch`, the lock server): waits on the same word
  (``FUTEX_WAIT`` on a shared mapping, in a thread) and only reads it.

It is a hint that comes first, never the only signal: the connection's EOF
stays what releases the lock when there is no word (an engine that did not
arm one, another OS, a word the watcher cannot map). Nothing here can make
a live process look dead: only the kernel sets ``FUTEX_OWNER_DIED``, and
only for the thread whose id is in the word.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

FUTEX_WAITERS: Final = 0x80000000
FUTEX_OWNER_DIED: Final = 0x40000000
FUTEX_TID_MASK: Final = 0x3FFFFFFF
_FUTEX_WAIT: Final = 0  # shared (no FUTEX_PRIVATE_FLAG): the word is in a shared file
_FUTEX_WAKE: Final = 1
_WAKE_ALL: Final = 2**31 - 1
_WAIT_AGAIN: Final = (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR)
_MAP_FAILED: Final = ctypes.c_void_p(-1).value
WORD_BYTES: Final = 64  # the file: the word, then zeros (one cache line)

# (futex, set_robust_list) by machine: the syscalls Python has no wrapper for.
_SYSCALLS: Final = {"x86_64": (202, 273), "aarch64": (98, 99), "arm64": (98, 99)}


class _RobustList(ctypes.Structure):
    pass


_RobustList._fields_ = [("next", ctypes.POINTER(_RobustList))]


class _RobustHead(ctypes.Structure):
    """``struct robust_list_head`` (linux/futex.h)."""

    _fields_ = [
        ("list", _RobustList),
        ("futex_offset", ctypes.c_long),
        ("list_op_pending", ctypes.POINTER(_RobustList)),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@dataclass(frozen=True, slots=True)
class _Sys:
    call: Callable[..., int]  # syscall(2)
    futex: int
    set_robust_list: int
    mmap: Callable[..., int | None]
    munmap: Callable[..., int]


@functools.cache
def _sys() -> _Sys | None:
    numbers = _SYSCALLS.get(platform.machine())
    if platform.system() != "Linux" or numbers is None:
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    )  # fmt: skip
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return _Sys(libc.syscall, *numbers, libc.mmap, libc.munmap)


def supported() -> bool:
    return _sys() is not None


def word_path(heartbeat: Path) -> Path:
    """The word's file for the engine whose heartbeat is ``heartbeat``."""
    return heartbeat.with_suffix(".dies")


class Armed:
    """The engine's side: its word, kept for the process's life."""

    def __init__(self, path: Path, thread: threading.Thread) -> None:
        self.path = path
        self.thread = thread

    def close(self) -> None:
        """A clean exit: the file goes (the word would say so anyway)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def arm(path: Path, timeout_s: float = 5.0) -> Armed:
    """Put a word in ``path`` that the kernel marks when this process ends.

    Returns once the word holds the watching thread's id (OSError if the
    thread could not register it: the caller goes on without one)."""
    sys = _sys()
    if sys is None:
        raise OSError(errno.ENOSYS, f"robust futexes are not available on {platform.machine()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, WORD_BYTES)
        area = mmap.mmap(fd, WORD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    word = ctypes.c_uint32.from_buffer(area)
    ready = threading.Event()
    failed: list[OSError] = []

    def hold() -> None:
        # The list lives in this thread's frame, which never returns: the
        # kernel reads it when the thread ends, with the process.
        entry, head = _RobustList(), _RobustHead()
        entry.next = ctypes.pointer(head.list)
        head.list.next = ctypes.pointer(entry)
        head.futex_offset = ctypes.addressof(word) - ctypes.addressof(entry)
        word.value = threading.get_native_id() | FUTEX_WAITERS
        size = ctypes.c_size_t(ctypes.sizeof(head))
        if sys.call(ctypes.c_long(sys.set_robust_list), ctypes.byref(head), size) != 0:
            err = ctypes.get_errno()
            word.value = 0
            failed.append(OSError(err, f"set_robust_list: {os.strerror(err)}"))
            ready.set()
            return
        ready.set()
        threading.Event().wait()  # for the process's life

    thread = threading.Thread(target=hold, name="understudy-death-word", daemon=True)
    thread.start()
    if not ready.wait(timeout_s) or failed:
        tmp.unlink(missing_ok=True)  # never armed: no file left behind
        raise failed[0] if failed else OSError(errno.ETIMEDOUT, "the word's thread did not start")
    os.replace(tmp, path)  # armed before it is visible: a watcher never sees a bare file
    return Armed(path, thread)


def read(path: Path) -> int | None:
    """The word now, or None if there is no such file (or it is short)."""
    try:
        raw = path.read_bytes()[:4]
    except OSError:
        return None
    return int.from_bytes(raw, "little") if len(raw) == 4 else None


def dead(word: int | None) -> bool:
    return word is not None and bool(word & FUTEX_OWNER_DIED)


def watch(
    path: Path, on_death: Callable[[], None], stop: threading.Event, poll_s: float = 1.0
) -> threading.Thread | None:
    """A thread that calls ``on_death`` once, when the word in ``path`` says its
    process ended, unless ``stop`` is set first; None if there is no armed
    word to watch (the caller relies on its other signals).

    The wait wakes on the kernel's wake-up, and at least every ``poll_s``
    to look at ``stop``."""
    sys = _sys()
    if sys is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # Read-only, by libc's mmap: the watcher needs only read access to
        # the engine's file (Python's mmap gives ctypes no address of a
        # read-only mapping).
        at = sys.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        short = os.fstat(fd).st_size < 4
    finally:
        os.close(fd)
    if at is None or at == _MAP_FAILED:
        return None
    word = ctypes.c_uint32.from_address(at)
    if short or not word.value & (FUTEX_OWNER_DIED | FUTEX_TID_MASK):
        sys.munmap(at, mmap.PAGESIZE)
        return None  # not armed
    timeout = _Timespec(int(poll_s), int(poll_s % 1 * 1e9))

    def wait() -> None:
        try:
            while not stop.is_set():
                value = word.value
                if value & FUTEX_OWNER_DIED:
                    # The kernel wakes one waiter; the lock server and the
                    # front both wait: the first wakes the rest.
                    sys.call(
                        ctypes.c_long(sys.futex), ctypes.c_void_p(at), ctypes.c_int(_FUTEX_WAKE),
                        ctypes.c_int(_WAKE_ALL),
                    )  # fmt: skip
                    on_death()
                    return
                # Returns at the wake-up, at once if the word changed since
                # it was read (EAGAIN), or at the timeout. (Every argument
                # typed: a variadic call would pass an address as a C int.)
                got = sys.call(
                    ctypes.c_long(sys.futex), ctypes.c_void_p(at), ctypes.c_int(_FUTEX_WAIT),
                    ctypes.c_uint32(value), ctypes.byref(timeout), None, ctypes.c_int(0),
                )  # fmt: skip
                if got != 0 and ctypes.get_errno() not in _WAIT_AGAIN:
                    return  # a wait the kernel refuses: the other signals remain
        finally:
            sys.munmap(at, mmap.PAGESIZE)

    thread = threading.Thread(target=wait, name=f"understudy-watch-{path.name}", daemon=True)
    thread.start()
    return thread
