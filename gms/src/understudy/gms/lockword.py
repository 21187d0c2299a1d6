"""What the pod's lock server says about its holder, read from its own record.

The lock server persists ``{holder, epoch, ...}`` before it sends any grant,
and clears ``holder`` (keeping ``epoch``) on release (``wire.lockrecord``,
the one format its writer and other processes of the pod share). GMS reads it
to check that a request for the KV pool comes from the holder, under the
holder's epoch: the lock server's word, taken from where the lock server
itself keeps it, without a connection to it (GMS must serve whether or not
the lock server is up, and imports nothing of it).

No record (no lock server on this node, or it never granted) or none whole is
no word: the caller falls back to the epoch as a fencing token (never older
than the newest seen).
"""

from __future__ import annotations

from pathlib import Path

from understudy.gms.fsm import LockWord
from understudy.wire import lockrecord


def read_lock_word(path: Path | None) -> tuple[LockWord | None, str]:
    """(the word, why there is none)."""
    if path is None:
        return None, "no lock record configured"
    record, why = lockrecord.read_newest(path)
    if record is None:
        return None, why
    return LockWord(record.holder, record.epoch), ""
