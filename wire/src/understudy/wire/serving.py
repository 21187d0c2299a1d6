"""Where an Active engine serves, and how it says it is alive: the contract
between an engine and the pod's front door.

- **Serving socket.** An engine listens on a Unix socket in the pod's run
  directory, and only while it is Active: ``serve/<engine id>.sock``. The
  front learns the Active engine's id and epoch from the lock, so it can only
  ever connect to the socket of the engine that holds the lock now.
- **Heartbeat.** Every engine rewrites a small record
  (``serve/<engine id>.beat``) from its event loop several times a second:
  its pid, its epoch and the monotonic clock. A record that stops moving
  while the process lives means a hung engine (stopped, deadlocked, stuck in
  a native call); the front kills it so that its death, the pod's only fence,
  hands the lock on. The monotonic clock is the same for every process on a
  node, so the front can compare it with its own.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

SERVE_DIR = "serve"
# seq, pid, epoch, monotonic ns, seq again: a reader that sees the two
# sequence numbers differ read a record half-written and tries again.
_RECORD = struct.Struct("<QqqqQ")


def _safe(engine_id: str) -> str:
    # Engine ids are "<container name>/<random suffix>"; a path needs no slash.
    return engine_id.replace("/", ".")


def serving_socket(run_dir: Path, engine_id: str) -> Path:
    return run_dir / SERVE_DIR / f"{_safe(engine_id)}.sock"


def heartbeat_path(run_dir: Path, engine_id: str) -> Path:
    return run_dir / SERVE_DIR / f"{_safe(engine_id)}.beat"


@dataclass(frozen=True, slots=True)
class Beat:
    pid: int
    epoch: int  # 0 until the engine holds the lock
    monotonic: float  # seconds, the writer's time.monotonic()


class HeartbeatWriter:
    """One fixed-size record rewritten in place (no allocation, no rename)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._seq = 0
        self.pid = os.getpid()

    def beat(self, epoch: int) -> None:
        self._seq += 1
        now = time.monotonic_ns()
        os.pwrite(self._fd, _RECORD.pack(self._seq, self.pid, epoch, now, self._seq), 0)

    def close(self) -> None:
        os.close(self._fd)


def read_beat(path: Path) -> Beat | None:
    """The last record, or None if there is none (yet) or it stays torn."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for _ in range(3):
            raw = os.pread(fd, _RECORD.size, 0)
            if len(raw) != _RECORD.size:
                return None
            seq, pid, epoch, ns, seq2 = _RECORD.unpack(raw)
            if seq == seq2:
                return Beat(pid, epoch, ns / 1e9)
        return None
    finally:
        os.close(fd)
