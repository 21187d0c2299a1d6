"""A `vllm` failover's adoption by mapping the pool's pages, against today's copy.

The issue's first way to take the copy off `vllm`'s failover is vLLM's own
KV cache over the pool's memory, so that adopting the dead engine's blocks
maps them instead of copying them. Nothing of it is built. This measures,
before anyone builds it, what the mapping itself would cost on this machine
against what the copy costs now, on the same memory, in one process,
alternating:

- **copy** (the baseline): today's load, `vllm_kvmove.Mover.move` from the
  pool's layout into vLLM-CPU's paged cache, summing the pool's block
  checksums as it copies (what a failover runs).
- **map**: the same positions, where the pool would hold them in vLLM's
  own layout (one 192 KiB block of 128 positions a layer, page-aligned), put
  over the cache's blocks with one ``mmap(MAP_PRIVATE | MAP_FIXED)`` of the
  pool's memfd each: copy-on-write, so the new engine's writes never reach
  the dead one's sealed bytes (a page is copied at its first write only),
  then ``madvise(MADV_POPULATE_READ)``, so the first step takes no fault
  per page it reads. Each call also frees the cache's anonymous pages it
  replaces, as it would in vLLM.
- **map, then every byte read once**: the adopted blocks' checksums must
  still be read before a token is served from them (the claim's promise);
  a read of every mapped byte (numpy's sum of it as 64-bit words) is the
  floor of that pass.

- **every byte read in place**: where vLLM's cache would be the pool
  itself (both engines' caches over the same memory, and a continuation
  handed the dead engine's own block ids), an adoption neither maps nor
  copies: the checksums' read is what is left.

Beside them: a map that populates with ``MAP_POPULATE`` (on a private
writable mapping it faults for writing, which copies every page), one that
populates nothing (a fault per page as the pass reads it), and the freeing
of the cache's pages alone. It also counts the mappings an adoption adds to
the process (Linux refuses more than ``vm.max_map_count``, 65,530 by
default): here one a layer, as a layer's blocks lie in order in the memfd
and in the cache; in a pool whose blocks do not, one a block.

SmolLM2-135M's shape (30 layers, 3 KV heads of 64, float32), 4,000
positions (189 MB in whole blocks) by default. Prints p50s and the ratios to the copy, and
writes ``bench/results/kv_map.json``.

    .venv/bin/python bench/kv_map.py [--positions 4000] [--repeats 9]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, summary, write_results

from understudy.engine_shim.adapters.vllm_kvmove import mover
from understudy.engine_shim.kvpool import BlockSums
from understudy.engine_shim.memadvise import MADV_DONTNEED, MADV_POPULATE_READ, advise
from understudy.gms.backends.memfd import MAP_FIXED, MAP_POPULATE, _do_mmap

LAYERS, HEADS, DIM, BS = 30, 3, 64, 128  # vLLM-CPU's blocks of 128 positions
BLOCK = HEADS * BS * 2 * DIM * 4  # one layer's block: 196,608 bytes, 48 pages
RW = mmap.PROT_READ | mmap.PROT_WRITE


class Cache:
    """vLLM-CPU's cache of one layer ``[blocks, heads, BS, 2 * DIM]``, on
    anonymous pages of its own (page-aligned, as a mapped cache would be)."""

    def __init__(self, blocks: int) -> None:
        self.size = blocks * BLOCK
        self.address = _do_mmap(None, self.size, RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
        self.reset()

    def reset(self) -> None:
        """Anonymous pages again, each written once (vLLM's cache before a
        failover): whatever was mapped over them is gone."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED
        _do_mmap(self.address, self.size, RW, flags, -1)
        self.array().fill(1)

    def array(self) -> np.ndarray:
        raw = (ctypes.c_char * self.size).from_address(self.address)
        return np.frombuffer(raw, np.float32).reshape(-1, HEADS, BS, 2 * DIM)


def map_block(fd: int, at: int, offset: int, populate: str) -> None:
    """One block of the pool's memfd over the cache's block at ``at``,
    copy-on-write, its page tables filled as ``populate`` says: "read"
    (``MADV_POPULATE_READ``: the pool's pages, write-protected), "write"
    (``MAP_POPULATE``, which on a private writable mapping faults for
    writing: a private copy of every page), or "" (none: a fault per page
    at its first read)."""
    flags = mmap.MAP_PRIVATE | MAP_FIXED | (MAP_POPULATE if populate == "write" else 0)
    _do_mmap(at, BLOCK, RW, flags, fd, offset)
    if populate == "read":
        advise(at, BLOCK, MADV_POPULATE_READ)


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def max_map_count() -> int:
    return int(Path("/proc/sys/vm/max_map_count").read_text())


class Adoption:
    """One failover's positions, in the pool's layout of today (for the
    copy) and in vLLM's own, in a memfd (for the maps), and the caches
    both adopt into: blocks ``1..used`` of each layer."""

    def __init__(self, positions: int) -> None:
        self.n = positions
        self.used = -(-positions // BS)  # the blocks the positions fill
        self.table = list(range(1, self.used + 1))  # vLLM's free queue after block 0
        self.caches = [Cache(self.used + 1) for _ in range(LAYERS)]
        self.addresses = np.array([c.address for c in self.caches], dtype=np.uintp)
        rng = np.random.default_rng(0)
        shape = (LAYERS, HEADS, positions, DIM)
        self.keys = rng.standard_normal(shape, dtype=np.float32)
        self.values = rng.standard_normal(shape, dtype=np.float32)
        self.bytes = LAYERS * self.used * BLOCK
        self.fd = os.memfd_create("kv-map-bench", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.bytes)
        self.pool = np.frombuffer(mmap.mmap(self.fd, self.bytes), np.float32)
        self.pool[:] = rng.standard_normal(self.pool.size, dtype=np.float32)

    def copy(self) -> None:
        """Today's load, summing the checksums as a failover's does."""
        sums = BlockSums(
            np.ones((2, LAYERS, HEADS, 16), np.uint64),
            np.ones((2, LAYERS, HEADS, DIM // 2), np.uint64),
            np.zeros(self.n // 16, np.uint64),
        )
        mover.move(
            self.keys, self.values, self.addresses, self.used + 1, BS, self.table, 0, self.n,
            into_pool=False, sums=sums,
        )  # fmt: skip

    def map(self, populate: str = "read") -> None:
        for layer, cache in enumerate(self.caches):
            for i, block in enumerate(self.table):
                offset = (layer * self.used + i) * BLOCK
                map_block(self.fd, cache.address + block * BLOCK, offset, populate)

    def map_and_read(self, populate: str) -> None:
        """A map, then the pass the checksums need (its floor: a sum of
        every mapped byte as 64-bit words)."""
        self.map(populate)
        self.read()

    def read(self) -> None:
        for cache in self.caches:
            cache.array()[1 : self.used + 1].view(np.uint64).sum()

    def free(self) -> None:
        """The anonymous pages a map replaces, freed alone."""
        for cache in self.caches:
            advise(cache.address + BLOCK, self.used * BLOCK, MADV_DONTNEED)

    def reset(self) -> None:
        for cache in self.caches:
            cache.reset()

    def check(self) -> None:
        """What a map leaves is the pool's own bytes."""
        self.map()
        got = self.caches[-1].array()[self.table[-1]].ravel()
        last = ((LAYERS - 1) * self.used + self.used - 1) * (BLOCK // 4)
        assert np.array_equal(got, self.pool[last : last + got.size]), "not the pool's block"
        self.reset()


def timed(run: Callable[[], None], before: Callable[[], None]) -> float:
    before()
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def sample(a: Adoption, repeats: int) -> tuple[dict[str, list[float]], int]:
    """Each way, alternated (the same minutes for each), from a cache of
    anonymous pages each time; and the mappings one map adds."""
    ways: dict[str, Callable[[], None]] = {
        BASE: a.copy,
        "map (MADV_POPULATE_READ)": a.map,
        "map, then every byte read": lambda: a.map_and_read("read"),
        "map unpopulated, every byte read": lambda: a.map_and_read(""),
        "map, MAP_POPULATE (copies)": lambda: a.map("write"),
        "the cache's pages freed, alone": a.free,
        "every byte read in place (no map)": a.read,
    }
    samples: dict[str, list[float]] = {name: [] for name in ways}
    before = mappings()
    a.map()
    added = mappings() - before
    for _ in range(repeats):
        for name, run in ways.items():
            samples[name].append(timed(run, a.reset))
    a.check()
    return samples, added


BASE = "copy, summing (today's load)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if mover is None:
        print("the package was built without its C moves: nothing to time", file=sys.stderr)
        return 1
    load_at_start = os.getloadavg()[0]
    a = Adoption(args.positions)
    samples, added = sample(a, args.repeats)
    results = {name: summary(s) for name, s in samples.items()}
    print_table(f"adopting {a.n} positions ({a.bytes / 1e6:.0f} MB in vLLM's blocks)", results)
    ratios = {name: r["p50"] / results[BASE]["p50"] for name, r in results.items()}
    print("\nagainst the copy, p50:")
    for name, r in ratios.items():
        print(f"  {name:34} {r:.2f}x")
    print(f"\nmappings one adoption adds: {added} (vm.max_map_count {max_map_count()})")
    payload: dict[str, Any] = {
        "unit": "seconds",
        "positions": a.n,
        "blocks_mapped": LAYERS * a.used,
        "block_bytes": BLOCK,
        "mappings_added": added,
        "max_map_count": max_map_count(),
        "repeats": args.repeats,
        "load_at_start": load_at_start,
        "load_at_end": os.getloadavg()[0],
        "results": results,
        "over_copy_p50": ratios,
    }
    write_results("kv_map", payload, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
