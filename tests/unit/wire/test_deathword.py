"""The death word (wire.deathword) with real processes, kill -9 and a real kernel.

What the lock server relies on: the word says "owner died" once its process
ends, and before the process's sockets close (Linux handles a thread's
robust list at the start of its exit, and closes its files after its memory
is gone); never while it lives; and a watcher is woken, not left polling.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.wire import deathword

pytestmark = pytest.mark.skipif(not deathword.supported(), reason="Linux on x86-64 or arm64 only")


def _child(path: Path, peer: socket.socket, touch_mib: int, then: str) -> None:
    """In a forked child: memory to tear down, the word armed, then wait or exit."""
    try:
        memory = bytearray(touch_mib << 20)
        for i in range(0, len(memory), 4096):
            memory[i] = 1
        deathword.arm(path)
        peer.send(b"armed")
        if then == "exit":
            peer.recv(1)
            os._exit(0)
        threading.Event().wait()
    finally:
        os._exit(1)


@contextlib.contextmanager
def _spawn(
    path: Path, touch_mib: int = 0, then: str = "wait"
) -> Iterator[tuple[int, socket.socket]]:
    """A child process with its word armed: (its pid, our end of a socket it holds)."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        _child(path, theirs, touch_mib, then)
    theirs.close()
    try:
        assert ours.recv(5) == b"armed"
        yield pid, ours
    finally:
        ours.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.fixture
def word(tmp_path: Path) -> Path:
    return deathword.word_path(tmp_path / "serve" / "engine-a.beat")


def test_the_word_names_its_living_thread_and_says_dead_before_the_sockets_close(
    word: Path,
) -> None:
    with _spawn(word, touch_mib=512) as (pid, peer):
        alive = deathword.read(word)
        assert alive is not None and not deathword.dead(alive)
        assert alive & deathword.FUTEX_WAITERS and alive & deathword.FUTEX_TID_MASK
        time.sleep(0.2)
        assert not deathword.dead(deathword.read(word))  # a living process: never
        os.kill(pid, signal.SIGKILL)
        assert peer.recv(1) == b""  # the kernel closed its sockets...
        assert deathword.dead(deathword.read(word))  # ...after it marked the word


def test_a_watcher_is_woken_once_at_a_kill_and_does_not_spin_while_it_waits(word: Path) -> None:
    with _spawn(word, touch_mib=256) as (pid, peer):
        calls: list[float] = []
        woken = threading.Event()

        def died() -> None:
            calls.append(time.monotonic())
            woken.set()

        started = time.process_time()
        thread = deathword.watch(word, died, threading.Event())
        assert thread is not None
        time.sleep(1.0)
        assert time.process_time() - started < 0.3, "the watcher polls instead of sleeping"
        assert not calls
        os.kill(pid, signal.SIGKILL)
        assert woken.wait(5)
        assert peer.recv(1) == b""
        thread.join(5)
        assert not thread.is_alive() and len(calls) == 1


def test_a_clean_exit_ends_the_word_too(word: Path) -> None:
    with _spawn(word, then="exit") as (_, peer):
        woken = threading.Event()
        assert deathword.watch(word, woken.set, threading.Event()) is not None
        peer.send(b"x")
        assert woken.wait(5)


def test_a_stopped_watch_never_calls_back(word: Path) -> None:
    with _spawn(word) as (pid, _):
        stop, calls = threading.Event(), []
        thread = deathword.watch(word, lambda: calls.append(1), stop, poll_s=0.05)
        assert thread is not None
        stop.set()
        thread.join(5)
        assert not thread.is_alive()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        assert calls == []


def test_no_word_or_a_bad_one_is_no_watch_and_no_verdict(tmp_path: Path, word: Path) -> None:
    never = threading.Event()
    assert deathword.watch(word, never.set, never) is None  # no file
    assert deathword.read(word) is None and not deathword.dead(None)
    word.parent.mkdir(parents=True)
    word.write_bytes(b"\0\0")  # short
    assert deathword.watch(word, never.set, never) is None
    assert deathword.read(word) is None
    word.write_bytes(bytes(deathword.WORD_BYTES))  # zeros: nobody armed it
    assert deathword.watch(word, never.set, never) is None
    assert not deathword.dead(deathword.read(word))


def test_arming_replaces_a_dead_engines_word_and_cleans_up_on_close(word: Path) -> None:
    word.parent.mkdir(parents=True)
    word.write_bytes((deathword.FUTEX_OWNER_DIED).to_bytes(4, "little") + bytes(60))
    assert deathword.dead(deathword.read(word))
    with _spawn(word):
        assert not deathword.dead(deathword.read(word))
    armed = deathword.arm(word)  # in this process: its thread lives with the test run
    assert deathword.read(word) == armed.thread.native_id | deathword.FUTEX_WAITERS
    armed.close()
    assert not word.exists()


def test_every_watcher_is_woken_not_only_the_one_the_kernel_wakes(word: Path) -> None:
    """The kernel wakes one waiter of a dead owner's word; the lock server and
    the front both wait on it. With a poll of 30 s, a watcher left asleep
    would miss the 5 s below."""
    with _spawn(word) as (pid, _):
        woken = [threading.Event() for _ in range(3)]
        for event in woken:
            assert deathword.watch(word, event.set, threading.Event(), poll_s=30) is not None
        time.sleep(0.3)  # all three asleep in the kernel
        os.kill(pid, signal.SIGKILL)
        assert all(event.wait(5) for event in woken)
