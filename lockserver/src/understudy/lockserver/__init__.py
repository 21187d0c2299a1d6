"""The pod's global lock: the connection is the lock, and its grant wakes a standby.

Public API for engines: ``acquire`` (blocks; returns a ``HeldLock`` whose open
connection holds the lock, watched by a monitor thread) and ``status``.
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

__all__ = [
    "Address",
    "HeldLock",
    "LockError",
    "LockRefused",
    "LockTimeout",
    "LockUnavailable",
    "acquire",
    "status",
]
