"""``madvise`` for the engine's memory: the page-level advice the KV pool and
vLLM-CPU's KV cache take (give back, back with huge pages, fill in now).

Python's ``mmap.madvise`` needs an ``mmap`` object; the engine's memory is
numpy's and torch's, known by address, so the call goes through libc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Final

from understudy.wire.obs import log_event

log = logging.getLogger("understudy.engine_shim.memadvise")

MADV_DONTNEED: Final = 4
MADV_FREE: Final = 8  # Linux >= 4.5, private anonymous memory only
MADV_HUGEPAGE: Final = 14
MADV_POPULATE_READ: Final = 22  # Linux >= 5.14
MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14
MADV_COLLAPSE: Final = 25  # Linux >= 6.1
PAGE: Final = mmap.PAGESIZE
HUGE: Final = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def pages(address: int, nbytes: int, page: int = PAGE) -> tuple[int, int]:
    """The whole pages inside ``[address, address + nbytes)``: (start, length).
    Advice that frees memory must stop there: a page shared with another
    allocation at either end is left alone."""
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


def covering(address: int, nbytes: int, page: int = PAGE) -> tuple[int, int]:
    """The pages that ``[address, address + nbytes)`` touches: (start, length).
    Advice that fills memory in may take them whole: the bytes around are
    the same mapping's (a pool, a cache tensor)."""
    start = address // page * page
    end = -(-(address + nbytes) // page) * page if nbytes else start
    return start, end - start


def advise(start: int, length: int, advice: int) -> None:
    """``madvise`` or OSError."""
    if length and _madvise(start, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}) of {length} bytes: {os.strerror(err)}")


def try_advise(start: int, length: int, advice: int) -> bool:
    """Best effort: an advice the kernel cannot follow (too old, a region it
    cannot collapse now) costs nothing but its benefit."""
    return bool(length) and _madvise(start, length, advice) == 0


def populate(spans: Iterable[tuple[int, int]], advice: int = MADV_POPULATE_READ) -> int:
    """Fill in the page tables of ``spans`` ((address, bytes)) now, in order,
    rather than at a fault per page on first touch; the bytes done. Best
    effort: a kernel without the advice (before 5.14) leaves the faults to
    the reader, as before."""
    done = 0
    for address, nbytes in spans:
        start, length = covering(address, nbytes)
        if not try_advise(start, length, advice):
            break
        done += length
    return done


Spans = Iterable[tuple[int, int]]  # (address, bytes)


def warm(work: Sequence[tuple[Spans, int]]) -> threading.Thread:
    """`populate` each ``(spans, advice)`` of ``work`` in order, on a thread of
    its own, started here; it logs ``kv_warmed`` with the bytes and seconds.

    Why a thread: at a failover, the new Active maps the KV pool and its
    first request reads the dead engine's positions at once (the claim's
    checksums, then vLLM's copy into its cache). Each first touch of a page
    is a fault: the checksums of 4,000 positions of SmolLM2 (184 MB) took
    46-63 ms on a fresh mapping against 20-27 ms on a populated one, and a
    copy into released cache pages 71-75 ms against 10-13 ms (a
    microbenchmark, 2 cores). Filled in by the kernel from the wake on, on
    the other core, while the engine wakes and the continuation comes in,
    the reader finds them mapped. A reader that overtakes it takes the
    faults itself: never wrong, but not always faster. A reader that writes
    the pages the thread is backing waits for them (vLLM-CPU zeroes the
    blocks it hands out before the step: in one 8-client drill round it
    waited 280 ms for a backing of 45 MiB that took 209 ms;
    docs/performance.md, 2026-12-02 evening).
    """

    def run() -> None:
        t0 = time.monotonic()
        done, parts = [], []
        for spans, advice in work:
            t = time.monotonic()
            done.append(populate(spans, advice))
            parts.append(f"{time.monotonic() - t:.4f}")
        log_event(
            log,
            "kv_warmed",
            mib=",".join(str(n >> 20) for n in done),
            seconds=round(time.monotonic() - t0, 4),
            parts=",".join(parts),
        )

    thread = threading.Thread(target=run, name="kv-warm", daemon=True)
    thread.start()
    return thread
