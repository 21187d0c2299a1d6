"""What a front leaves behind when it dies: how many clients were waiting on it.

The serving socket outlives the front (``understudy.wire.handover``), so a
connection that arrives while no front runs waits in the kernel's queue and
loses nothing. What a front's death does lose is the requests inside it: the
connections it had accepted and not yet answered, whose clients see them
close. The front keeps that number, as it changes, in a small record shared
with its successor (a page of ``front.ledger`` in the pod's run directory,
mapped into memory: a store, not a system call, per change), together with
the pod's running total. The next front reads it when it starts: its
predecessor's busy connections are the requests lost, added to the total.

Its idle connections (kept alive between requests) die with it too, and a
client may have written its next request into one the front had not read
yet: the front cannot count that request, so the record keeps the idle
connections apart (``idle``), and the next front counts them as what they
are, connections closed while a request may have been on its way in.

The record is ``seq, pid, busy, idle, lost, starts, idle_total, seq``: a
reader that finds the two sequence numbers apart read a record its writer
died in the middle of writing (or one of an older layout), and counts
nothing for it (it says so).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

LEDGER = "front.ledger"
_RECORD = struct.Struct("<QqqqqqqQ")


@dataclass(frozen=True, slots=True)
class Predecessor:
    pid: int  # 0: there was none
    busy: int  # its connections with a client waiting, when it stopped writing
    lost: int  # the pod's total before this start
    starts: int  # fronts started in this pod before this one
    torn: bool = False  # its last record was half-written: its busy count is unknown
    idle: int = 0  # its kept-alive connections between requests
    idle_lost: int = 0  # the pod's total of those before this start


class Ledger:
    """This front's record; ``take_over`` first, then ``busy`` at every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(fd).st_size < mmap.PAGESIZE:
                os.ftruncate(fd, mmap.PAGESIZE)
            self._map = mmap.mmap(fd, mmap.PAGESIZE)
        finally:
            os.close(fd)  # the mapping keeps the page
        self._seq = 0
        self.pid = os.getpid()
        self.lost = 0
        self.idle_lost = 0
        self.starts = 0

    def take_over(self, adopted: int = 0) -> Predecessor:
        """Read the predecessor's record and start this front's: its busy
        connections join the lost total, but for the ``adopted`` ones (its
        connections the lock server kept open, which this front finishes:
        ``connhold``), taken from its busy ones first."""
        seq, pid, busy, idle, lost, starts, idle_lost, seq2 = _RECORD.unpack_from(self._map, 0)
        torn = seq != seq2
        before = Predecessor(pid, busy, lost, starts, torn, idle, idle_lost)
        self._seq = max(seq, seq2)
        counted = pid and not torn
        kept_busy = min(busy, adopted)
        kept_idle = min(idle, adopted - kept_busy)
        self.lost = lost + (busy - kept_busy if counted else 0)
        self.idle_lost = idle_lost + (idle - kept_idle if counted else 0)
        self.starts = starts + 1
        self.busy(0, 0)
        return before

    def busy(self, n: int, idle: int) -> None:
        """This front's connections now: ``n`` with a client waiting, ``idle`` between requests."""
        self._seq += 1
        _RECORD.pack_into(
            self._map, 0, self._seq, self.pid, n, idle, self.lost, self.starts, self.idle_lost,
            self._seq,
        )  # fmt: skip

    def close(self) -> None:
        self._map.close()
