"""Helpers for GMS process tests: real server processes, real client processes."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from procs import PYTHON, Proc, wait_for

from understudy.gms.client import query_state
from understudy.gms.config import socket_path

HERE = Path(__file__).parent


def gms_cli(*args: str) -> list[str]:
    return [PYTHON, "-m", "understudy.gms.cli", *args]


def answers(path: Path) -> bool:
    try:
        query_state(path, 0.5)
        return True
    except Exception:
        return False


class Agent(Proc):
    """A client process (agent.py) speaking JSON lines on its stdin/stdout."""

    def __init__(self, log: Path, script: str = "agent.py", *argv: str) -> None:
        self.args = [PYTHON, str(HERE / script), *argv]
        self.lines = queue.Queue()
        self.all_lines = []
        self._log = open(log, "ab")  # noqa: SIM115
        self.popen = subprocess.Popen(
            self.args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        first = self.json_line(30)
        assert first.get("ready") or first.get("event") == "ready", first

    def send(self, **doc: Any) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(doc) + "\n").encode())
        self.popen.stdin.flush()

    def __call__(self, op: str, wait: float = 60.0, **kw: Any) -> dict[str, Any]:
        self.send(op=op, **kw)
        while True:
            doc = self.json_line(wait)
            if "event" in doc:
                self.events.append(doc)
                continue
            return doc

    @property
    def events(self) -> list[dict[str, Any]]:
        if not hasattr(self, "_events"):
            self._events: list[dict[str, Any]] = []
        return self._events

    def ok(self, op: str, **kw: Any) -> dict[str, Any]:
        doc = self(op, **kw)
        assert doc["ok"], doc
        return doc


class Engine(Agent):
    """engine.py: worker threads per device; collects its JSON events."""

    def __init__(self, log: Path) -> None:
        super().__init__(log, "engine.py")

    def next_event(self, timeout: float = 30.0) -> dict[str, Any]:
        doc = self.json_line(timeout)
        self.events.append(doc)
        return doc

    def wait_event(self, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """The first event (already seen or new) whose fields match ``match``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for doc in self.events[seen:]:
                if all(doc.get(k) == v for k, v in match.items()):
                    return doc
            seen = len(self.events)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no event {match} in {timeout}s; saw {self.events}")
            try:
                self.next_event(remaining)
            except TimeoutError:
                continue


class Gms:
    """Start/stop GMS server processes and client agents inside ``tmp_path``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.dir = tmp / "gms"
        self.dir.mkdir(mode=0o700, parents=True)
        self.procs: list[Proc] = []

    def path(self, device: int = 0) -> Path:
        return socket_path(self.dir, device)

    def server(self, device: int = 0, *extra: str) -> Proc:
        log = self.tmp / f"server{device}.log"
        proc = Proc(
            gms_cli("server", "--socket", str(self.path(device)), "--device", str(device), *extra),
            log=log,
        )
        self.procs.append(proc)
        wait_for(lambda: answers(self.path(device)) or not proc.alive(), 20, what="server socket")
        assert proc.alive(), log.read_text()
        return proc

    def agent(self, name: str = "agent") -> Agent:
        a = Agent(self.tmp / f"{name}{len(self.procs)}.log")
        self.procs.append(a)
        return a

    def engine(self, name: str = "engine") -> Engine:
        e = Engine(self.tmp / f"{name}{len(self.procs)}.log")
        self.procs.append(e)
        return e

    def state(self, device: int = 0) -> dict[str, Any]:
        return query_state(self.path(device), 5).model_dump(mode="json")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def memfd_holders(prefix: str) -> list[str]:
    """Every /proc/*/fd and /proc/*/maps entry naming a memfd that starts with ``prefix``."""
    found = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                try:
                    if prefix in str(fd.readlink()):
                        found.append(f"{pid_dir.name} fd {fd.name}")
                except OSError:
                    pass
            if prefix in (pid_dir / "maps").read_text():
                found.append(f"{pid_dir.name} maps")
        except OSError:
            continue
    return found


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gms_cli(*args), capture_output=True, text=True, timeout=timeout, check=False
    )


__all__ = ["Agent", "Gms", "answers", "gms_cli", "memfd_holders", "run_cli", "sys"]
