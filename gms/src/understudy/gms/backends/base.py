"""The memory-backend interface, server side and client side.

A server backend owns physical allocations and exports each as a file
descriptor; a client mapper turns such an fd into memory at an address it
chose (a reservation), and can drop the memory while keeping the address
reserved, so that a later ``map`` at the same address makes old pointers and
views valid again (an engine sleeps and wakes without rebuilding them).
"""

from __future__ import annotations

from typing import Protocol

from understudy.gms.messages import GmsError


class BackendUnavailable(GmsError):
    """The backend cannot work here (no driver, no device); one line of text."""


class ServerBackend(Protocol):
    name: str
    device: int
    granularity: int

    def create(self, alloc_id: int, size: int) -> None:
        """Create ``size`` bytes (already aligned) under ``alloc_id``."""

    def export(self, alloc_id: int, writable: bool) -> int:
        """A new fd for the allocation; the caller closes it once sent."""

    def adopt(self, alloc_id: int, size: int, fd: int) -> None:
        """Take ``fd`` (an export a client kept, sent back after a restart of
        this server) as allocation ``alloc_id`` of ``size`` bytes. The fd is
        the backend's from now on, also when this raises."""

    def release(self, alloc_id: int) -> None:
        """Drop the server's reference (memory is freed when no one maps it)."""

    def close(self) -> None:
        """Release everything."""


class ClientMapper(Protocol):
    name: str

    def reserve(self, size: int, granularity: int) -> int:
        """Reserve ``size`` bytes of address space; returns the address."""

    def map(
        self, fd: int, address: int, size: int, writable: bool, populate: bool | None = None
    ) -> None:
        """Map the allocation behind ``fd`` at ``address`` (reserved). ``fd``
        stays the caller's (it may be closed right after). ``populate``: have
        its pages present now (host memory; default: read-only mappings,
        which are of committed memory, are)."""

    def protect_readonly(self, address: int, size: int) -> None:
        """Make a mapping read-only (after commit)."""

    def write(self, address: int, data: memoryview) -> None:
        """Copy ``data`` (format ``B``) from host memory into the memory mapped
        read-write at ``address``; the bytes are in place when it returns."""

    def read(self, address: int, nbytes: int) -> bytes:
        """A host copy of ``nbytes`` of the memory mapped at ``address``."""

    def export(self, address: int) -> int:
        """A new fd for the memory mapped at ``address``, which a restarted
        server can adopt (re-adoption); the caller closes it once sent."""

    def unmap(self, address: int, size: int) -> None:
        """Drop the mapping and its reference to the memory; keep the reservation."""

    def park(self, address: int, size: int) -> None:
        """Sleep: what a sleeping engine does with the RO mapping at
        ``address``: unmap it, or keep it where keeping it holds nothing that
        a sleeping engine must give back; ``map`` of the same memory at the
        same address then finds it in place."""

    def free(self, address: int, size: int) -> None:
        """Give the (unmapped) reservation back."""
