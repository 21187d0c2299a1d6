"""The pod's global lock: the connection is the lock, and its grant wakes a standby.

Public API for engines: ``acquire`` (blocks; returns a ``HeldLock`` whose open
connection holds the lock, watched by a monitor thread) and ``status``; for
the pod's front door, ``watch`` (asyncio: the holder now and at every change).
"""

from understudy.lockserver.client import (
    Address,
    HeldLock,
    LockError,
    LockRefused,
    LockTimeout,
    LockUnavailable,
    acquire,
    status,
)
from understudy.lockserver.messages import Holder
from understudy.lockserver.watch import watch

__all__ = [
    "Address",
    "HeldLock",
    "Holder",
    "LockError",
    "LockRefused",
    "LockTimeout",
    "LockUnavailable",
    "acquire",
    "status",
    "watch",
]
