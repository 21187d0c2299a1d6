"""What the pod's lock server says about its holder, read from its own record.

The lock server writes ``{holder, epoch, ...}`` atomically (a rename) before it
sends any grant, and clears ``holder`` (keeping ``epoch``) on release
(docs/pod.md, the lock state file). GMS reads the two fields to check that a
request for the KV pool comes from the holder, under the holder's epoch: the
lock server's word, taken from where the lock server itself keeps it, without
a connection to it (GMS must serve whether or not the lock server is up, and
imports nothing of it).

No record (no lock server on this node, or it never granted) or one that
cannot be read is no word: the caller falls back to the epoch as a fencing
token (never older than the newest seen).
"""

from __future__ import annotations

import json
from pathlib import Path

from understudy.gms.fsm import LockWord

DEFAULT_LOCK_STATE = Path("/run/understudy/lock.state")


def read_lock_word(path: Path | None) -> tuple[LockWord | None, str]:
    """(the word, why there is none)."""
    if path is None:
        return None, "no lock record configured"
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, f"no lock record at {path}"
    except (OSError, ValueError) as exc:
        return None, f"lock record {path} unreadable: {exc}"
    holder = data.get("holder") if isinstance(data, dict) else None
    epoch = data.get("epoch") if isinstance(data, dict) else None
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        return None, f"lock record {path} has no epoch"
    if holder is not None and (not isinstance(holder, str) or not holder):
        return None, f"lock record {path} has a bad holder"
    return LockWord(holder, epoch), ""
