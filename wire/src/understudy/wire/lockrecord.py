"""The lock server's persisted record, as bytes: the one format shared by its
writer (``understudy.lockserver.statefile``) and by readers in other
processes of the pod (GMS checks who holds the lock, and under which epoch,
from the record itself: it must decide whether or not the lock server is up,
and imports nothing of it).

The record ``{seq, holder, epoch, ...}`` is kept in **two copies**,
``PATH.a`` and ``PATH.b``, each a JSON object followed by the CRC-32 of its
bytes on a line of its own. Each copy is replaced whole (temp file, fsync,
rename), so a reader never sees a torn copy, only a damaged one; the newest
whole copy (highest ``seq``) is the record. Why two copies, and when they
differ: ``lockserver/statefile.py``.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

COPIES = ("a", "b")
TRAILER = b"\ncrc32 "


@dataclass(frozen=True, slots=True)
class Record:
    """A whole copy: its number, the holder (None: free) and the epoch, and
    every field it carries (``data``) for the writer's own extras."""

    seq: int
    holder: str | None
    epoch: int
    data: dict[str, object] = field(default_factory=dict, compare=False)


def copy_paths(path: Path) -> tuple[Path, Path]:
    a, b = (path.with_name(f"{path.name}.{c}") for c in COPIES)
    return a, b


def encode(seq: int, record: dict[str, object]) -> bytes:
    """One copy's bytes: the record as JSON, then its checksum."""
    body = json.dumps({"seq": seq, **record}).encode()
    return body + TRAILER + f"{zlib.crc32(body):08x}".encode() + b"\n"


def parse(raw: bytes) -> Record | str:
    """A copy's record, or why it is damaged (pure)."""
    body, sep, trailer = raw.rpartition(TRAILER)
    if not sep:
        return "no checksum"
    if trailer.rstrip(b"\n") != f"{zlib.crc32(body):08x}".encode():
        return "checksum mismatch"
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        seq, holder, epoch = data["seq"], data["holder"], data["epoch"]
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ValueError("seq must be a non-negative integer")
        if holder is not None and (not isinstance(holder, str) or not holder):
            raise ValueError("holder must be a non-empty string or null")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError("epoch must be a non-negative integer")
    except (ValueError, KeyError, TypeError) as exc:
        return f"unparsable: {exc}"
    return Record(seq, holder, epoch, data)


def read_newest(path: Path) -> tuple[Record | None, str]:
    """The newest whole copy at ``path`` (no lock needed: copies are replaced
    by rename), or None and why: no copy at all, or none whole."""
    found: list[Record] = []
    why: list[str] = []
    for copy in copy_paths(path):
        try:
            raw = copy.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            why.append(f"{copy.name}: unreadable: {exc}")
            continue
        parsed = parse(raw)
        if isinstance(parsed, Record):
            found.append(parsed)
        else:
            why.append(f"{copy.name}: {parsed}")
    if found:
        return max(found, key=lambda r: r.seq), ""
    return None, "; ".join(why) or f"no lock record at {path}"
