"""GPU Memory Service: one server per (device, tag) owns the weight
allocations, hands them out as fds, and decides who may write them, so that a
primary and its standby engine share one copy of the weights.

Public names (what the engine shim uses): the client and its errors, and the
lock modes. Servers, the supervisor and the CLI are imported by module.
"""

from understudy.gms.client import (
    Allocation,
    GmsClient,
    GmsConnectionLost,
    GmsRefused,
    GmsTimeoutError,
    StaleMemoryLayoutError,
    query_state,
)
from understudy.gms.messages import GmsError, Granted, LockState, Mode

__all__ = [
    "Allocation",
    "GmsClient",
    "GmsConnectionLost",
    "GmsError",
    "GmsRefused",
    "GmsTimeoutError",
    "Granted",
    "LockState",
    "Mode",
    "StaleMemoryLayoutError",
    "query_state",
]
