"""Real processes for tests: start ``understudy`` subcommands, read their JSON
lines, wait for conditions, kill them for real. No mocks of our components."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PYTHON = sys.executable


def wait_for(
    cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or cond}")
        time.sleep(interval)


# What a poll of the cluster may raise while the objects it reads are still
# being created (a missing key, an empty list, a kubectl error): "not yet".
TRANSIENT = (AssertionError, KeyError, IndexError, StopIteration, TypeError, ValueError, OSError)


def wait_settled(what: str, fn: Callable[[], Any], timeout: float = 180, every: float = 1) -> Any:
    """Poll ``fn`` until it returns something truthy, treating TRANSIENT errors as
    "not yet"; on timeout the last value seen is in the message, and the last
    error where the last call raised (a CI run's "last: None" could not tell a
    condition never written from an object kubectl could not read)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            last, error = fn(), None
            if last:
                return last
        except TRANSIENT as exc:
            error = exc
        time.sleep(every)
    raised = f"; it raised {error!r:.800}" if error is not None else ""
    raise AssertionError(f"timed out waiting for {what} (last: {last!r}{raised})")


@contextlib.contextmanager
def shm_dir(prefix: str = "us-") -> Iterator[Path]:
    """A new directory on /dev/shm, removed with all in it afterwards: Unix
    socket paths under it stay short (108 bytes at most), and it is tmpfs, as
    the pod's emptyDir is. (Left behind, a run of the tests added a dozen.)"""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Proc:
    """A subprocess whose stdout lines are collected by a thread."""

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.args = args
        self.lines: queue.Queue[str] = queue.Queue()
        self.all_lines: list[str] = []
        self._log = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.all_lines.append(line)
            self.lines.put(line)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def json_line(self, timeout: float = 10.0) -> dict[str, Any]:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise TimeoutError(f"no output from {self.args} within {timeout}s") from None

    def no_line(self, within: float) -> bool:
        try:
            line = self.lines.get(timeout=within)
        except queue.Empty:
            return True
        self.lines.put(line)
        return False

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(10)

    def wait(self, timeout: float = 10.0) -> int:
        return self.popen.wait(timeout)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, wait_s: float = 5.0) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.kill9()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def understudy(*args: str) -> list[str]:
    return [PYTHON, "-m", "understudy.cli", *args]


Outcomes = list[tuple[float, BaseException | None]]


@contextlib.contextmanager
def asking(ask: Callable[[int, int], object], clients: int, join_s: float = 120) -> Any:
    """``clients`` threads calling ``ask(client, n)`` over and over until the
    block ends; yields each call's start (monotonic) and its failure (None:
    it returned), as they come."""
    outcomes: Outcomes = []
    stop = threading.Event()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ask(i, n)
                outcomes.append((t0, None))
            except BaseException as exc:  # every failure is counted
                outcomes.append((t0, exc))
            n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        yield outcomes
    finally:
        stop.set()
        for t in threads:
            t.join(join_s)
