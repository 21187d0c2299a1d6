"""The lock's persisted record ``{seq, holder, epoch, granted_at, counters}``, read on restart.

Written on every grant and cleared (holder null, epoch kept) on release,
into **two copies**, ``PATH.a`` and ``PATH.b``, each one checksummed
(CRC-32 of the record, on a line of its own after it). On a restart the
newest valid copy (highest ``seq``) wins, so one damaged copy (a torn or
corrupted write, a flipped bit, a file overwritten by mistake) costs
nothing: the other holds the same record.

Both copies get every record, one after the other, before the grant is
sent. Writing them alternately (one copy per record, as a journal's double
buffer does) would guard against a torn write only, and every write here is
already whole (a temp file, fsync, rename): what remains is damage after the
fact, and with alternating copies a damaged newest copy would send the
server back to the grant before it, whose epoch could then be issued twice.
The copies differ only after a crash between the two writes, and then the
newer one is whole.

Each copy is written atomically (temp file, fsync, rename; one fsync of the
directory after both), all under an exclusive ``flock`` on a sibling lock
file, so two writers (a restarting server overlapping its predecessor) never
interleave. A record that cannot be read from either copy is reported as
corrupt, never as "no holder": the caller must then assume an unknown holder
may be alive.

``counters`` is the durable failover tally (``tally``), written with every
grant and release. A tally that cannot be read costs only the counts, never
the holder: the record stays valid and the detail is reported.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from understudy.lockserver import tally
from understudy.lockserver.fsm import PersistedRecord
from understudy.wire import lockrecord
from understudy.wire.lockrecord import copy_paths, encode

__all__ = ["Copy", "ReadResult", "StateFile", "copy_paths", "encode", "judge", "keep_copy", "read"]


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy as read: its record, or why it has none."""

    path: Path
    seq: int | None = None  # None: missing or damaged
    record: PersistedRecord | None = None
    raw: bytes = b""
    data: dict[str, object] | None = None
    damage: str = ""  # why a present copy is unusable ("" if whole or missing)


@dataclass(frozen=True, slots=True)
class ReadResult:
    record: PersistedRecord | None  # None: no copy at all (first boot), or corrupt
    corrupt: bool  # copies exist, but none is whole
    detail: str = ""
    counters: tally.Tally | None = None  # None: none kept (or unreadable)
    counters_detail: str = ""  # why kept counters could not be read
    seq: int = 0  # of the record read; the next write uses a higher one
    # Copies found damaged although another was whole: (path, why). The
    # server reports them and writes them whole again (``raw``: the bytes of
    # the copy that won).
    damaged: tuple[tuple[Path, str], ...] = ()
    raw: bytes = b""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def parse_copy(path: Path, raw: bytes) -> Copy:
    """Check one copy's checksum and fields (pure; the format: ``wire.lockrecord``)."""
    parsed = lockrecord.parse(raw)
    if isinstance(parsed, str):
        return Copy(path, raw=raw, damage=parsed)
    return Copy(path, parsed.seq, PersistedRecord(parsed.holder, parsed.epoch), raw, parsed.data)


def _read_copy(path: Path) -> Copy:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Copy(path)
    except OSError as exc:
        return Copy(path, damage=f"unreadable: {exc}")
    return parse_copy(path, raw)


def read(path: Path) -> ReadResult:
    with _locked(path):
        copies = [_read_copy(p) for p in copy_paths(path)]
    return judge(copies)


def judge(copies: list[Copy]) -> ReadResult:
    """The newest whole copy wins (pure)."""
    whole = [c for c in copies if c.seq is not None]
    damaged = tuple((c.path, c.damage) for c in copies if c.damage)
    if not whole:
        if not damaged:
            return ReadResult(None, corrupt=False)
        detail = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        return ReadResult(None, corrupt=True, detail=detail, damaged=damaged)
    best = max(whole, key=lambda c: c.seq or 0)
    assert best.data is not None and best.seq is not None
    counters, why = None, ""
    if "counters" in best.data:
        try:
            counters = tally.from_json(best.data["counters"])
        except ValueError as exc:
            why = f"counters unparsable: {exc}"
    return ReadResult(
        best.record,
        corrupt=False,
        counters=counters,
        counters_detail=why,
        seq=best.seq,
        damaged=damaged,
        raw=best.raw,
    )


class StateFile:
    """The two copies at ``PATH.a`` and ``PATH.b``; ``write`` numbers every
    record above the last one read or written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seq = 0

    def read(self) -> ReadResult:
        result = read(self.path)
        self.seq = max(self.seq, result.seq)
        return result

    def write(
        self,
        holder: str | None,
        epoch: int,
        now_wall: float,
        counters: tally.Tally | None = None,
    ) -> None:
        """Both copies, each whole or not at all; raises OSError (a full or
        broken volume) with the previous record still whole in at least one."""
        granted_at = (
            dt.datetime.fromtimestamp(now_wall, dt.UTC).isoformat(timespec="milliseconds")
            if holder is not None
            else None
        )
        record: dict[str, object] = {"holder": holder, "epoch": epoch, "granted_at": granted_at}
        if counters is not None:
            record["counters"] = tally.to_json(counters)
        # A number is never reused, even by a write that failed half-way: the
        # copy it may have left must not tie with the next record.
        self.seq += 1
        data = encode(self.seq, record)
        with _locked(self.path):
            for copy in copy_paths(self.path):
                _replace(copy, data)
            _sync_dir(self.path.parent)

    def repair(self, result: ReadResult) -> None:
        """Write the damaged copies whole again, with the record that was read."""
        if not result.damaged or not result.raw:
            return
        with _locked(self.path):
            for path, _ in result.damaged:
                _replace(path, result.raw)
            _sync_dir(self.path.parent)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:  # a full volume may take part of it, then refuse
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError:
        # The old copy stays whole (the rename never happened); only the
        # temporary file goes.
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _sync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def keep_copy(path: Path, now_wall: float) -> Path | None:
    """Copy a damaged copy aside for forensics.

    A copy, not a move: if the server crashed again before writing a new
    record, a missing file would read as "first boot". The damaged original
    keeps the next start judging it damaged too.
    """
    target = path.with_name(f"{path.name}.corrupt-{int(now_wall)}")
    try:
        target.write_bytes(path.read_bytes())
    except OSError:
        return None
    return target
