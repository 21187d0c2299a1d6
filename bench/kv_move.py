"""A failover's KV load into vLLM-CPU's cache, streamed or stored plainly.

The `vllm` engine's failover copies the positions it adopts from the KV
pool into vLLM's paged cache (``vllm_kvmove.Mover.move``, C): the values row
by row, the keys transposed, the pool's block checksums summed as it goes.
Where every layer's cache is 32-byte aligned (torch's allocations are), the
load writes with streaming (non-temporal) stores; where one is not, with
plain ones. This times both on the same data, in one process, alternating:
caches 64-byte aligned, and the same caches 16 bytes past that.

SmolLM2-135M's shape (30 layers, 3 KV heads of 64, float32), 4,000
positions (184 MB) by default, vLLM-CPU's blocks of 128 positions (what it
runs here) and 16, each with and without the checksums, and numpy's copy
of as many bytes beside them (the floor of a copy on this core). It prints
p50s and the streamed / plain ratio, and writes
``bench/results/kv_move.json``.

    .venv/bin/python bench/kv_move.py [--positions 4000] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, summary, write_results

from understudy.engine_shim.adapters.vllm_kvmove import mover
from understudy.engine_shim.kvpool import BlockSums

LAYERS, HEADS, DIM = 30, 3, 64
STARTS = {"streamed": 0, "plain": 16}  # bytes past a 64-byte boundary


def at(shape: tuple[int, ...], offset: int) -> np.ndarray:
    """float32 zeros starting ``offset`` bytes past a 64-byte boundary."""
    count = int(np.prod(shape))
    raw = np.zeros(count + 32, np.float32)
    first = (offset - raw.ctypes.data) % 64 // 4
    return raw[first : first + count].reshape(shape)


def times(run: Callable[[], None], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return out


def loads(
    keys: np.ndarray, values: np.ndarray, bs: int, repeats: int, samples: dict[str, list[float]]
) -> None:
    """Time loads into caches of blocks of ``bs``, streamed and plain
    alternated, with the checksums and without; check what they wrote."""
    n = keys.shape[2]
    blocks = -(-n // bs) + 1
    caches = {
        name: [at((blocks, HEADS, bs, 2 * DIM), start) for _ in range(LAYERS)]
        for name, start in STARTS.items()
    }
    for name in STARTS:  # every page written once before it is timed
        for c in caches[name]:
            c.fill(1)
    table = list(range(1, blocks))
    rows = np.ones((2, LAYERS, HEADS, 16), np.uint64)
    cols = np.ones((2, LAYERS, HEADS, DIM // 2), np.uint64)
    for sums in (True, False):
        for _ in range(repeats):  # alternated: the same minutes for both
            for name in STARTS:
                addresses = np.array([c.ctypes.data for c in caches[name]], dtype=np.uintp)
                ck = BlockSums(rows, cols, np.zeros(n // 16, np.uint64)) if sums else None
                load = partial(
                    mover.move, keys, values, addresses, blocks, bs, table, 0, n,
                    into_pool=False, sums=ck,
                )  # fmt: skip
                label = f"blocks of {bs}, {'sums' if sums else 'no sums'}: {name}"
                samples.setdefault(label, []).extend(times(load, 1))
    for name in STARTS:  # the loads were exact, streamed or not
        # A block's keys transposed (head_dim rows of bs), then its values.
        halves = caches[name][-1].reshape(blocks, HEADS, 2, bs * DIM)[1:, -1]
        k = halves[:, 0].reshape(-1, DIM, bs).transpose(0, 2, 1).reshape(-1, DIM)
        assert np.array_equal(k[:n], keys[-1, -1]), name
        assert np.array_equal(halves[:, 1].reshape(-1, DIM)[:n], values[-1, -1]), name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if mover is None:
        print("the package was built without its C moves: nothing to time", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    shape = (LAYERS, HEADS, args.positions, DIM)
    keys = rng.standard_normal(shape, dtype=np.float32)
    values = rng.standard_normal(shape, dtype=np.float32)
    load_at_start = os.getloadavg()[0]
    samples: dict[str, list[float]] = {}
    for bs in (128, 16):
        loads(keys, values, bs, args.repeats, samples)
    source = np.concatenate([keys.ravel(), values.ravel()])
    target = np.ones_like(source)
    samples["numpy copy of as many bytes"] = times(lambda: np.copyto(target, source), args.repeats)
    results = {name: summary(s) for name, s in samples.items()}
    print_table(f"a load of {args.positions} positions ({source.nbytes / 1e6:.0f} MB)", results)
    ratios = {
        label.removesuffix(": streamed"): results[label]["p50"]
        / results[label.removesuffix("streamed") + "plain"]["p50"]
        for label in results
        if label.endswith(": streamed")
    }
    print("\nstreamed / plain, p50:")
    for label, r in ratios.items():
        print(f"  {label:28} {r:.2f}x")
    payload: dict[str, Any] = {
        "unit": "seconds",
        "positions": args.positions,
        "bytes": source.nbytes,
        "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM},
        "repeats": args.repeats,
        "load_at_start": load_at_start,
        "load_at_end": os.getloadavg()[0],
        "results": results,
        "streamed_over_plain_p50": ratios,
    }
    write_results("kv_move", payload, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
