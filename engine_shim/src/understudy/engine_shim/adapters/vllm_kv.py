"""The KV cache of a CPU standby: its pages given back, its addresses kept.

vLLM allocates the KV cache when it builds its engine core (one buffer, a
view of it bound into every attention layer and the model runner) and never
again. On a GPU, sleep mode does what a standby needs: ``sleep(level=1)``
releases the cache's physical memory and keeps its virtual addresses (CUDA
VMM), ``wake_up()`` backs the same addresses with fresh memory, and every
tensor and binding stays valid. vLLM-CPU has no sleep mode; this module is
its stand-in, with the same effect through the kernel:

- ``release``: ``madvise(MADV_DONTNEED)`` over the cache's whole pages. The
  kernel frees them at once (the process's RSS and PSS drop by the cache's
  size); the mapping stays, and a page touched again reads as zeros, as the
  freshly allocated cache did.
- ``restore``: nothing is needed for correctness (the pages come back, zeroed,
  on first touch: the kernel's own lazy allocation, as ``torch.empty`` or
  ``np.zeros`` get it); ``populate`` commits them at once
  (``MADV_POPULATE_WRITE``), for a deployment that would rather pay for the
  whole cache at wake than a page fault per 4 KiB during the first requests.

What was cached is gone, so the caller must also forget it (vLLM's
``reset_prefix_cache``): a prefix hit on a released block would read zeros.

The functions taking a ``worker`` run through vLLM's ``collective_rpc``, in
whichever process holds the model runner (this one: the engine runs
in-process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from typing import Any, Final

MADV_DONTNEED: Final = 4
MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14
PAGE: Final = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def pages(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside ``[address, address + nbytes)``: (start, length).
    Only those are released: a page the cache shares with another allocation
    at either end is left alone."""
    start = -(-address // PAGE) * PAGE
    end = (address + nbytes) // PAGE * PAGE
    return start, max(0, end - start)


def _advise(start: int, length: int, advice: int) -> None:
    if length and _madvise(start, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}) of {length} bytes: {os.strerror(err)}")


def storages(tensors: Iterable[Any]) -> list[tuple[int, int]]:
    """The distinct buffers under ``tensors`` (views share one): (address, bytes)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[int(storage.data_ptr())] = int(storage.nbytes())
    return sorted(seen.items())


def _kv_tensors(worker: Any) -> list[Any]:
    caches = list(worker.model_runner.kv_caches)
    if not caches:
        raise RuntimeError("vLLM's model runner holds no KV cache")
    return caches


def release(worker: Any) -> int:
    """Give the KV cache's pages back to the kernel; the bytes released."""
    total = 0
    for address, nbytes in storages(_kv_tensors(worker)):
        start, length = pages(address, nbytes)
        _advise(start, length, MADV_DONTNEED)
        total += length
    return total


def populate(worker: Any) -> int:
    """Commit the KV cache's pages now rather than on first touch; the bytes."""
    total = 0
    for address, nbytes in storages(_kv_tensors(worker)):
        start, length = pages(address, nbytes)
        _advise(start, length, MADV_POPULATE_WRITE)
        total += length
    return total


def kv_bytes(worker: Any) -> int:
    """The KV cache's size (its buffers, however many views share them)."""
    return sum(n for _, n in storages(_kv_tensors(worker)))
