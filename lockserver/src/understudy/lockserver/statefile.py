"""The lock's persisted record ``{holder, epoch, granted_at, counters}``, read on restart.

Written on every grant and cleared (holder null, epoch kept) on release.
Atomic: write a temp file, fsync it, rename over the record, fsync the
directory — all under an exclusive ``flock`` on a sibling lock file, so two
writers (a restarting server overlapping its predecessor) never interleave.
A record that cannot be parsed is reported as corrupt, never as "no holder":
the caller must then assume an unknown holder may be alive.

``counters`` is the durable failover tally (``tally``), written with every
grant and release. It is optional (files written before it existed have
none: the counts start at zero), and a tally that cannot be read costs only
the counts, never the holder: the record stays valid and the detail is
reported.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from understudy.lockserver import tally
from understudy.lockserver.fsm import PersistedRecord


@dataclass(frozen=True, slots=True)
class ReadResult:
    record: PersistedRecord | None  # None: no file (first boot)
    corrupt: bool
    detail: str = ""
    counters: tally.Tally | None = None  # None: none kept (or unreadable)
    counters_detail: str = ""  # why kept counters could not be read


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def read(path: Path) -> ReadResult:
    with _locked(path):
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return ReadResult(None, corrupt=False)
        except OSError as exc:
            return ReadResult(None, corrupt=True, detail=f"unreadable: {exc}")
    return parse(raw)


def parse(raw: bytes) -> ReadResult:
    try:
        data = json.loads(raw)
        holder = data["holder"]
        epoch = data["epoch"]
        if holder is not None and (not isinstance(holder, str) or not holder):
            raise ValueError("holder must be a non-empty string or null")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError("epoch must be a non-negative integer")
    except (ValueError, KeyError, TypeError) as exc:
        return ReadResult(None, corrupt=True, detail=f"unparsable: {exc}")
    counters, why = None, ""
    if "counters" in data:
        try:
            counters = tally.from_json(data["counters"])
        except ValueError as exc:
            why = f"counters unparsable: {exc}"
    record = PersistedRecord(holder=holder, epoch=epoch)
    return ReadResult(record, corrupt=False, counters=counters, counters_detail=why)


def write(
    path: Path,
    holder: str | None,
    epoch: int,
    now_wall: float,
    counters: tally.Tally | None = None,
) -> None:
    granted_at = (
        dt.datetime.fromtimestamp(now_wall, dt.UTC).isoformat(timespec="milliseconds")
        if holder is not None
        else None
    )
    record: dict[str, object] = {"holder": holder, "epoch": epoch, "granted_at": granted_at}
    if counters is not None:
        record["counters"] = tally.to_json(counters)
    body = json.dumps(record).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _locked(path):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(body)
                while view:  # a full volume may take part of it, then refuse
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError:
            # The old record stays whole (the rename never happened); only the
            # temporary file goes.
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def keep_copy(path: Path, now_wall: float) -> Path | None:
    """Copy a corrupt record aside for forensics.

    A copy, not a move: if the server crashed again before writing a new
    record, a missing file would read as "first boot" and let a second engine
    be granted while the first may be alive. The corrupt original keeps the
    next start in a reconnect window too.
    """
    target = path.with_name(f"{path.name}.corrupt-{int(now_wall)}")
    try:
        target.write_bytes(path.read_bytes())
    except OSError:
        return None
    return target
