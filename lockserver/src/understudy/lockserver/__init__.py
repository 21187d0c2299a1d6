"""The pod's global lock (seed 002, Decisions 4 and 8): the connection is the lock.

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
