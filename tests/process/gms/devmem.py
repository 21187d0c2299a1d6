"""Bytes in and out of GMS allocations on either backend.

host: through the mapping itself (a numpy array over the address). cuda: a
device pointer is not a host pointer (on a GPU, and in the CUDA driver double,
whose device ranges have no host access), so bytes travel by the driver's
copies, cuMemcpyHtoD and cuMemcpyDtoH, in the calling thread's context.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from understudy.gms.client import Allocation, GmsClient

MULT = np.uint64(0x9E3779B97F4A7C15)
CHUNK = 8 << 20  # uint64 words per step (64 MiB)


class DeviceCopyError(RuntimeError):
    """A driver copy failed (e.g. CUDA_ERROR_ILLEGAL_ADDRESS: no write access)."""


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _check(result: Any, what: str) -> None:
    drv = _driver()
    if result != drv.CUresult.CUDA_SUCCESS:
        raise DeviceCopyError(f"{what}: {result.name}")


def pattern(start: int, n: int, seed: int) -> np.ndarray:
    return (np.arange(start, start + n, dtype=np.uint64) * MULT) ^ np.uint64(seed)


def write(client: GmsClient, address: int, data: bytes | np.ndarray) -> None:
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data.view(np.uint8)
    if client.backend == "cuda":
        (res,) = _driver().cuMemcpyHtoD(address, buf, buf.nbytes)
        _check(res, "cuMemcpyHtoD")
    else:
        dst = (ctypes.c_uint8 * buf.nbytes).from_address(address)
        np.copyto(np.ctypeslib.as_array(dst), buf)


def read(client: GmsClient, address: int, n: int) -> np.ndarray:
    if client.backend == "cuda":
        out = np.empty(n, dtype=np.uint8)
        (res,) = _driver().cuMemcpyDtoH(out, address, n)
        _check(res, "cuMemcpyDtoH")
        return out
    src = (ctypes.c_uint8 * n).from_address(address)
    return np.ctypeslib.as_array(src).copy()


def fill(client: GmsClient, a: Allocation, seed: int, address: int | None = None) -> None:
    """Word i of the allocation becomes (i * MULT) ^ seed."""
    base = a.address if address is None else address
    words = a.size // 8
    for i in range(0, words, CHUNK):
        n = min(CHUNK, words - i)
        write(client, base + i * 8, pattern(i, n, seed))


def verify(client: GmsClient, a: Allocation, seed: int, address: int | None = None) -> bool:
    base = a.address if address is None else address
    words = a.size // 8
    for i in range(0, words, CHUNK):
        n = min(CHUNK, words - i)
        got = read(client, base + i * 8, n * 8).view(np.uint64)
        if not np.array_equal(got, pattern(i, n, seed)):
            return False
    return True


def mem_info() -> tuple[int, int]:
    """(free, total) of the current context's device (cuda)."""
    res, free, total = _driver().cuMemGetInfo()
    _check(res, "cuMemGetInfo")
    return int(free), int(total)
