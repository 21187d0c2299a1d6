"""Page advice over real mappings (engine_shim.memadvise): a shared memory
mapping's pages are in this process's page tables after `populate` (its Rss
in /proc/self/smaps, which counts present entries), not before."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from understudy.engine_shim import memadvise

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
