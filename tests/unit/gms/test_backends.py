"""Backends in one process: memfd allocations, fixed mappings at kept addresses,
read-only fds, and the cuda backend's single-line failure without a driver."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

import pytest

from understudy.gms.backends import BackendUnavailable, make_mapper, make_server_backend
from understudy.gms.backends.memfd import HostMapper, MemfdBackend

MiB = 1 << 20


def test_memfd_create_export_map_unmap_remap_same_address() -> None:
    backend = MemfdBackend(device=0)
    mapper = HostMapper()
    backend.create(0, 2 * MiB)
    address = mapper.reserve(2 * MiB, backend.granularity)
    fd = backend.export(0, writable=True)
    mapper.map(fd, address, 2 * MiB, writable=True)
    os.close(fd)
    buf = (ctypes.c_char * 16).from_address(address)
    buf[:5] = b"hello"
    mapper.unmap(address, 2 * MiB)  # the reservation stays; the pages are not ours now
    fd = backend.export(0, writable=False)
    mapper.map(fd, address, 2 * MiB, writable=False)
    os.close(fd)
    assert bytes(buf[:5]) == b"hello"  # same address, same bytes, through the old view
    mapper.unmap(address, 2 * MiB)
    mapper.free(address, 2 * MiB)
    backend.close()


def _mapped_at(address: int) -> str:
    """The name of what /proc/self/maps shows at ``address`` ("" if anonymous)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"nothing mapped at {address:#x}")


def test_a_parked_host_mapping_stays_through_sleep_and_only_for_the_same_memory() -> None:
    """Sleep keeps a host RO mapping (GMS's shared memory: page tables, no
    memory); wake keeps it only if GMS hands the same memfd back, and maps
    the one it hands otherwise (a restarted GMS that loaded afresh)."""
    backend = MemfdBackend(device=0)
    mapper = HostMapper()
    backend.create(0, 2 * MiB)
    backend.create(1, 2 * MiB)
    for alloc, text in ((0, b"first"), (1, b"other")):
        fd = backend.export(alloc, writable=True)
        os.pwrite(fd, text, 0)
        os.close(fd)
    address = mapper.reserve(2 * MiB, backend.granularity)
    buf = (ctypes.c_char * 16).from_address(address)
    try:
        fd = backend.export(0, writable=False)
        mapper.map(fd, address, 2 * MiB, writable=False)
        os.close(fd)
        mapper.park(address, 2 * MiB)
        assert _mapped_at(address).startswith("/memfd:") and bytes(buf[:5]) == b"first"
        fd = backend.export(0, writable=False)  # wake, the same memory
        mapper.map(fd, address, 2 * MiB, writable=False)
        os.close(fd)
        assert bytes(buf[:5]) == b"first"
        mapper.park(address, 2 * MiB)
        fd = backend.export(1, writable=False)  # wake, other memory at the address
        mapper.map(fd, address, 2 * MiB, writable=False)
        os.close(fd)
        assert bytes(buf[:5]) == b"other"
        mapper.unmap(address, 2 * MiB)  # a real unmap still gives it all back
        assert _mapped_at(address) == ""
    finally:
        mapper.free(address, 2 * MiB)
        backend.close()


def test_read_only_export_cannot_be_mapped_writable() -> None:
    backend = MemfdBackend(device=0)
    mapper = HostMapper()
    backend.create(0, MiB)
    address = mapper.reserve(MiB, backend.granularity)
    fd = backend.export(0, writable=False)
    try:
        with pytest.raises(PermissionError):
            mapper.map(fd, address, MiB, writable=True)
    finally:
        os.close(fd)
        mapper.free(address, MiB)
        backend.close()


def test_memfd_is_sealed_against_resizing() -> None:
    backend = MemfdBackend(device=0)
    backend.create(0, MiB)
    fd = backend.export(0, writable=True)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # would SIGBUS every mapper
    finally:
        os.close(fd)
        backend.close()


def test_release_closes_the_servers_fd() -> None:
    backend = MemfdBackend(device=3)
    backend.create(7, MiB)
    name = f"understudy-gms-{os.getpid()}-3-7"

    def held() -> bool:
        links = []
        for p in list(Path("/proc/self/fd").iterdir()):
            with contextlib.suppress(OSError):
                links.append(str(p.readlink()))
        return any(name in link for link in links)

    assert held()
    backend.release(7)
    assert not held()


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="an NVIDIA driver is present")
def test_cuda_without_a_driver_is_one_clear_line() -> None:
    for make in (lambda: make_server_backend("cuda", 0), lambda: make_mapper("cuda", 0)):
        with pytest.raises(BackendUnavailable) as info:
            make()
        text = str(info.value)
        assert text.startswith("cuda backend:") and "\n" not in text


def test_unknown_backend() -> None:
    with pytest.raises(BackendUnavailable):
        make_server_backend("tpu", 0)
