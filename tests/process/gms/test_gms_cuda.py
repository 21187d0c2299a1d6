"""The cuda backend on a real GPU (skipped without an NVIDIA driver and device).

UNVERIFIED here: written on a machine without a GPU.
"""

from __future__ import annotations

import subprocess
import textwrap
import time

import pytest
from gmsprocs import Gms
from procs import PYTHON, Proc

from understudy.gms.backends import BackendUnavailable
from understudy.gms.client import GmsClient, StaleMemoryLayoutError
from understudy.gms.messages import Granted, Mode

pytestmark = [pytest.mark.process, pytest.mark.gpu]

MiB = 1 << 20


def _gpu_reason() -> str | None:
    try:
        from understudy.gms.backends.cuda_vmm import CudaVmmBackend

        CudaVmmBackend(0).close()
    except BackendUnavailable as exc:
        return str(exc)
    return None


REASON = _gpu_reason()
if REASON is not None:
    pytestmark.append(pytest.mark.skip(reason=f"no usable GPU: {REASON}"))


def drv():  # type: ignore[no-untyped-def]
    from cuda.bindings import driver

    return driver


def h2d(address: int, data: bytes) -> None:
    (res,) = drv().cuMemcpyHtoD(address, data, len(data))
    assert res == drv().CUresult.CUDA_SUCCESS, res


def d2h(address: int, n: int) -> bytes:
    buf = bytearray(n)
    (res,) = drv().cuMemcpyDtoH(buf, address, n)
    assert res == drv().CUresult.CUDA_SUCCESS, res
    return bytes(buf)


def free_bytes() -> int:
    res, free, _total = drv().cuMemGetInfo()
    assert res == drv().CUresult.CUDA_SUCCESS
    return int(free)


READER = textwrap.dedent(
    """
        from cuda.bindings import driver
    from understudy.gms.client import GmsClient
    c = GmsClient.connect(sys.argv[1], "RO", 30)
    (a,) = c.import_all()
    buf = bytearray(16)
    (res,) = driver.cuMemcpyDtoH(buf, a.address, 16)
    print(bytes(buf).hex(), flush=True)
    c.close()
    """
)


def test_allocate_export_import_map_commit_unmap_remap(gms: Gms) -> None:
    gms.server(0, "--backend", "cuda")
    writer = GmsClient.connect(gms.path(0), Mode.RW_OR_RO, 30)
    assert writer.granted_mode is Granted.RW and writer.backend == "cuda"
    a = writer.allocate(5 * MiB)
    assert a.size % writer.granularity == 0
    h2d(a.address, b"understudy-gpu!!")
    digest = writer.commit()
    out = subprocess.run(
        [PYTHON, "-c", READER, str(gms.path(0))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip()) == b"understudy-gpu!!"
    address = a.address
    writer.unmap()
    writer.remap(30)
    assert writer.allocations[0].address == address and writer.layout_hash == digest
    assert d2h(address, 16) == b"understudy-gpu!!"
    writer.close()


def test_remap_against_a_different_layout_is_stale(gms: Gms) -> None:
    server = gms.server(0, "--backend", "cuda")
    c = GmsClient.connect(gms.path(0), Mode.RW, 30)
    c.allocate(2 * MiB)
    c.commit()
    c.unmap()
    server.kill9()
    gms.server(0, "--backend", "cuda")
    other = GmsClient.connect(gms.path(0), Mode.RW, 30)
    other.allocate(4 * MiB)
    other.commit()
    with pytest.raises(StaleMemoryLayoutError):
        c.remap(10)
    other.close()
    c.close()


HOLDER = textwrap.dedent(
    """
    import sys, time
    from understudy.gms.client import GmsClient
    c = GmsClient.connect(sys.argv[1], "RW", 30)
    c.allocate(int(sys.argv[2]))
    print("mapped", flush=True)
    time.sleep(600)
    """
)


def test_decision_7_memory_is_refcounted_across_processes(gms: Gms) -> None:
    """The server's release frees nothing while a client still maps the memory."""
    size = 512 * MiB
    from understudy.gms.backends.cuda_vmm import CudaVmmMapper

    CudaVmmMapper(0)  # gives this process a context, for cuMemGetInfo
    baseline = free_bytes()
    server = gms.server(0, "--backend", "cuda")
    holder = Proc([PYTHON, "-c", HOLDER, str(gms.path(0)), str(size)], log=gms.tmp / "holder.log")
    gms.procs.append(holder)
    assert holder.lines.get(timeout=120) == "mapped"
    used = baseline - free_bytes()
    assert used >= size
    server.kill9()  # the creator's handle is gone...
    time.sleep(1.0)
    assert baseline - free_bytes() >= size  # ...but the import keeps the memory alive
    holder.kill9()
    deadline = time.monotonic() + 10
    while baseline - free_bytes() >= size and time.monotonic() < deadline:
        time.sleep(0.1)
    assert baseline - free_bytes() < size  # freed with the last reference
