"""Page advice over real mappings (engine_shim.memadvise): a shared memory
mapping's pages are in this process's page tables after `populate` (its Rss
in /proc/self/smaps, which counts present entries), not before; `warm` does
it on a thread of its own; and the KV pool's sealed spans are exactly the
bytes its sealed positions hold, in the order its checksums read them."""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from understudy.engine_shim import kvlog, memadvise
from understudy.engine_shim.kvpool import KvPool

MiB = 1 << 20
PAGE = memadvise.PAGE


def _rss_of(address: int) -> int:
    """The Rss of the mapping that starts at ``address`` (bytes)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            for more in lines[i + 1 :]:
                if more.startswith("Rss:"):
                    return int(more.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.fixture
def shared() -> Iterator[tuple[mmap.mmap, int]]:
    """32 MiB of shared memory written through one mapping, and a fresh
    second mapping of it (its address): the pages exist, its entries do not."""
    fd = os.memfd_create("memadvise-test")
    os.ftruncate(fd, 32 * MiB)
    with mmap.mmap(fd, 32 * MiB) as writer:
        writer[:] = b"\x01" * (32 * MiB)
    fresh = mmap.mmap(fd, 32 * MiB)
    os.close(fd)
    address = np.frombuffer(fresh, np.uint8).ctypes.data
    yield fresh, address
    fresh.close()


def test_pages_and_covering_round_in_and_out() -> None:
    assert memadvise.pages(1, 3 * PAGE) == (PAGE, 2 * PAGE)  # whole pages inside
    assert memadvise.covering(1, 3 * PAGE) == (0, 4 * PAGE)  # every page touched
    assert memadvise.covering(PAGE, PAGE) == (PAGE, PAGE)
    assert memadvise.covering(PAGE + 5, 0) == (PAGE, 0)


def test_populate_fills_in_the_page_tables_of_the_spans_only(
    shared: tuple[mmap.mmap, int],
) -> None:
    _, address = shared
    assert _rss_of(address) < MiB  # nothing read yet through this mapping
    done = memadvise.populate([(address + 3, 4 * MiB), (address + 16 * MiB, 2 * MiB)])
    assert done == 4 * MiB + PAGE + 2 * MiB  # the first span's pages, rounded out
    assert 6 * MiB <= _rss_of(address) < 7 * MiB


def test_populate_stops_at_memory_that_is_not_mapped() -> None:
    with mmap.mmap(-1, 4 * PAGE) as m:
        address = np.frombuffer(m, np.uint8).ctypes.data
        m.close()  # its pages are gone; advice there fails, and populate stops
        assert memadvise.populate([(address, PAGE), (address, PAGE)]) == 0


def test_warm_populates_on_its_own_thread_and_says_so(
    shared: tuple[mmap.mmap, int], caplog: pytest.LogCaptureFixture
) -> None:
    _, address = shared
    with caplog.at_level(logging.INFO, logger="understudy.engine_shim.memadvise"):
        thread = memadvise.warm([([(address, 8 * MiB)], memadvise.MADV_POPULATE_READ)])
        thread.join(30)
    assert not thread.is_alive()
    assert _rss_of(address) >= 8 * MiB
    assert "event=kv_warmed" in caplog.text and "mib=8" in caplog.text


def test_the_sealed_spans_are_the_sealed_positions_in_the_checksums_order() -> None:
    spec = kvlog.PoolSpec(
        "m", layers=2, kv_heads=2, head_dim=8, dtype="float32", slots=3, max_len=64
    )
    pool = KvPool(memoryview(bytearray(spec.pool_bytes)), spec, 1)
    assert list(pool.sealed_spans()) == []  # nothing sealed: nothing to warm
    tokens = list(range(40))
    pool.claim(tokens, free=[2], prompt=40, chunk=16)
    pool.seal(2, tokens, 0, 40)  # blocks 0, 1 whole, block 2 with 8 positions
    row = spec.head_dim * spec.itemsize
    want = [
        (arr[layer, 2, head].ctypes.data, 40 * row)
        for arr in (pool.k, pool.v)
        for layer in range(2)
        for head in range(2)
    ]
    assert list(pool.sealed_spans()) == want
    # Their bytes are every sealed byte: mark them, and the checksums of the
    # slot are those of the marked memory alone.
    before = pool.checksums(2, [(0, 16), (1, 16), (2, 8)])
    for arr in (pool.k, pool.v):
        arr[:, 2, :, 40:] = 7.0  # outside the spans: not the checksums' business
        arr[:, :2] = 7.0
    assert pool.checksums(2, [(0, 16), (1, 16), (2, 8)]) == before
