"""``host`` backend: Linux shared memory (memfd), shared by fd.

Server: one ``memfd_create`` per allocation, sized with ``ftruncate`` to the
granularity (pages are only allocated when first written), sealed against
growing and shrinking so no client can truncate it under the others (which
would SIGBUS them). RO sessions receive an fd re-opened ``O_RDONLY``, so the
kernel refuses a writable shared mapping of it.

Client: mirrors CUDA VMM. ``reserve`` takes address space with
``mmap(NULL, size, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``;
``map`` puts the memfd over it with ``MAP_SHARED|MAP_FIXED``; ``unmap``
replaces it with a fresh ``PROT_NONE`` anonymous mapping (the reservation
stays, the shared pages are no longer referenced); ``map`` again at the same
address after a wake. RO mappings are ``PROT_READ``: a write faults (SIGSEGV).
They are also populated (``MAP_POPULATE``): the kernel fills in the page
tables of the committed pages in one pass, as ``cuMemMap`` leaves a GPU
mapping whole, so the first request after a wake does not take a page fault
per 4 KiB of weights (about 23,000 for MiniLM).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os

from understudy.gms.backends.base import BackendUnavailable
from understudy.gms.layout import DEFAULT_GRANULARITY

# Linux generic values (x86_64 and arm64 agree); Python's mmap module lacks them.
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MAP_POPULATE = 0x8000
PROT_NONE = 0
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_mprotect = _libc.mprotect
_mprotect.restype = ctypes.c_int
_mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _bytes_at(address: int, nbytes: int) -> memoryview:
    """The mapped bytes at ``address``, as ``Allocation.view()`` sees them: the
    host backend's copies go through the mapping itself."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _do_mmap(
    address: int | None, size: int, prot: int, flags: int, fd: int, offset: int = 0
) -> int:
    got = _mmap(address, size, prot, flags, fd, offset)
    if got is None or got == MAP_FAILED:
        raise _oserror("mmap")
    if address is not None and got != address:
        raise OSError(f"mmap returned {got:#x}, not the fixed address {address:#x}")
    return int(got)


class MemfdBackend:
    """Server side: allocations are memfds."""

    name = "host"

    def __init__(self, device: int, granularity: int | None = None) -> None:
        if not hasattr(os, "memfd_create"):
            raise BackendUnavailable("host backend needs memfd_create (Linux)")
        self.device = device
        self.granularity = granularity or DEFAULT_GRANULARITY
        self._fds: dict[int, int] = {}
        self._ro_fds: dict[int, int] = {}  # one read-only description per allocation

    def create(self, alloc_id: int, size: int) -> None:
        name = f"understudy-gms-{os.getpid()}-{self.device}-{alloc_id}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
        except BaseException:
            os.close(fd)
            raise
        self._fds[alloc_id] = fd

    def export(self, alloc_id: int, writable: bool) -> int:
        fd = self._fds[alloc_id]
        if writable:
            return os.dup(fd)
        # A separate open file description, read-only: mmap(PROT_WRITE, MAP_SHARED)
        # of it fails. Opened once; every RO export is a dup of it.
        ro = self._ro_fds.get(alloc_id)
        if ro is None:
            ro = self._ro_fds[alloc_id] = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        return os.dup(ro)

    def adopt(self, alloc_id: int, size: int, fd: int) -> None:
        """An engine's kept memfd. Checked: a memfd of at least ``size`` bytes
        (never an arbitrary file a peer sends). Kept as this allocation's only
        description: an adopted layout is committed, so it is exported read-only."""
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith("/memfd:"):
                raise ValueError(f"not a memfd: {target}")
            have = os.fstat(fd).st_size
            if have < size:
                raise ValueError(f"memfd of {have} bytes for an allocation of {size}")
        except BaseException:
            os.close(fd)
            raise
        self._fds[alloc_id] = fd
        self._ro_fds[alloc_id] = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)

    def release(self, alloc_id: int) -> None:
        for fds in (self._fds, self._ro_fds):
            fd = fds.pop(alloc_id, None)
            if fd is not None:
                os.close(fd)

    def close(self) -> None:
        for alloc_id in list(self._fds):
            self.release(alloc_id)


class HostMapper:
    """Client side: reservations and fixed shared mappings. Each mapping keeps
    its memfd open too, so the memory can be sent back to a restarted server."""

    name = "host"

    def __init__(self) -> None:
        self._kept: dict[int, int] = {}  # address -> the memfd mapped there
        self._parked: set[int] = set()  # RO mappings kept through a sleep

    def reserve(self, size: int, granularity: int) -> int:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        return _do_mmap(None, size, PROT_NONE, flags, -1)

    def map(
        self, fd: int, address: int, size: int, writable: bool, populate: bool | None = None
    ) -> None:
        if address in self._parked:
            self._parked.discard(address)
            if not writable and _same_file(fd, self._kept[address]):
                return  # kept asleep, and still the server's memory: in place
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # Only RO mappings are of committed memory; populating a fresh RW one
        # would allocate every page before the writer needs it (so would a
        # KV pool's read-only view: a read of a hole allocates it).
        present = (not writable) if populate is None else populate
        flags = mmap.MAP_SHARED | MAP_FIXED | (MAP_POPULATE if present else 0)
        _do_mmap(address, size, prot, flags, fd)
        self._close_kept(address)
        self._kept[address] = os.dup(fd)

    def export(self, address: int) -> int:
        return os.dup(self._kept[address])

    def _close_kept(self, address: int) -> None:
        fd = self._kept.pop(address, None)
        if fd is not None:
            os.close(fd)

    def protect_readonly(self, address: int, size: int) -> None:
        if _mprotect(address, size, mmap.PROT_READ) != 0:
            raise _oserror("mprotect")

    def write(self, address: int, data: memoryview) -> None:
        _bytes_at(address, data.nbytes)[:] = data

    def read(self, address: int, nbytes: int) -> bytes:
        return bytes(_bytes_at(address, nbytes))

    def unmap(self, address: int, size: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
        _do_mmap(address, size, PROT_NONE, flags, -1)
        self._close_kept(address)
        self._parked.discard(address)

    def park(self, address: int, size: int) -> None:
        """Kept: host memory is GMS's, shared; a sleeping engine's read-only
        mapping of it holds page tables, no memory, and saves the wake from
        populating them again (538 MB of SmolLM2: 131,000 entries, ~60 ms of
        a failover here). ``map`` keeps it only if GMS hands over the same
        memfd (a restarted GMS that loaded the weights afresh does not)."""
        self._parked.add(address)

    def free(self, address: int, size: int) -> None:
        if _munmap(address, size) != 0:
            raise _oserror("munmap")
