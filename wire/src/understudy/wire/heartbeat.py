"""An engine's heartbeat, written and read (the record is ``serving``'s).

Every engine rewrites one fixed-size record from its event loop several
times a second; the front and the lock server read it to tell a live engine
from a hung or dead one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from understudy.wire.serving import BEAT_RECORD, Beat, pack_beat, unpack_beat


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
        os.pwrite(self._fd, pack_beat(self._seq, self.pid, epoch, time.monotonic_ns()), 0)

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
            raw = os.pread(fd, BEAT_RECORD.size, 0)
            if len(raw) != BEAT_RECORD.size:
                return None
            beat = unpack_beat(raw)
            if beat is not None:
                return beat
        return None
    finally:
        os.close(fd)
