"""The vllm engine's KV moves in C (`vllm_kvmove`), against vLLM-CPU's layout
read with numpy: a block's keys transposed (head_dim rows of block_size
positions), then its values row by row, per head (`vllm_kvconn.kv_views`;
tests/vllm checks that reading against vLLM's own cache kernel, and the
connector's copies through this mover and through torch's)."""

from __future__ import annotations

import numpy as np
import pytest

from understudy.engine_shim.adapters.vllm_kvmove import mover

pytestmark = pytest.mark.skipif(mover is None, reason="the package was built without _kvmove")

LAYERS, HEADS, DIM, BS, BLOCKS, MAX_LEN = 3, 2, 64, 128, 16, 1024


def views(cache: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A layer's keys and values as [block, head, offset, dim]."""
    halves = cache.reshape(BLOCKS, HEADS, 2, BS * DIM)
    keys = halves[:, :, 0].reshape(BLOCKS, HEADS, DIM, BS).transpose(0, 1, 3, 2)
    return keys, halves[:, :, 1].reshape(BLOCKS, HEADS, BS, DIM)


# Where a cache starts: a load into caches 32-byte aligned (vLLM's, torch's
# allocations) streams its stores; at 16 bytes past that it stores plainly
# (bench/kv_move.py times the two).
ALIGNED = pytest.mark.parametrize("at", [0, 16], ids=["streamed", "plain"])


def zeros(shape: tuple[int, ...], at: int = 0) -> np.ndarray:
    """float32 zeros whose first byte is ``at`` bytes past a 64-byte boundary."""
    count = int(np.prod(shape))
    raw = np.zeros(count + 32, np.float32)
    first = (at - raw.ctypes.data) % 64 // 4
    out = raw[first : first + count].reshape(shape)
    assert out.ctypes.data % 64 == at
    return out


def setup(at: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    pool = rng.random((2, LAYERS, 2, HEADS, MAX_LEN, DIM), dtype=np.float32) + 1  # never 0
    caches = [zeros((BLOCKS, HEADS, BS, 2 * DIM), at) for _ in range(LAYERS)]
    addresses = np.array([c.ctypes.data for c in caches], dtype=np.uintp)
    return pool[0], pool[1], caches, addresses


@pytest.mark.parametrize(
    "table",
    [list(range(5, 13)), [9, 2, 14, 0, 7, 11, 3, 5], [1, 2, 3, 8, 9, 10, 4, 5]],
    ids=["consecutive", "scattered", "runs"],
)
@pytest.mark.parametrize(
    "span", [(0, 1000), (5, 300), (130, 131), (256, 512), (3, 1020), (7, 7), (8, 155)]
)
@ALIGNED
def test_a_load_then_a_save_moves_exactly_the_positions_asked(
    table: list[int], span: tuple[int, int], at: int
) -> None:
    """Every position of ``span`` arrives at its block and offset, keys and
    values, each layer and head, with its bits; nothing else is written; and
    a save back into another slot gives the same rows."""
    assert mover is not None
    keys, values, caches, addresses = setup(at)
    start, end = span
    mover.move(keys[:, 1], values[:, 1], addresses, BLOCKS, BS, table, start, end, into_pool=False)
    for layer, cache in enumerate(caches):
        k, v = views(cache)
        for p in range(start, end):
            block, off = table[p // BS], p % BS
            assert np.array_equal(k[block, :, off], keys[layer, 1, :, p]), (layer, p)
            assert np.array_equal(v[block, :, off], values[layer, 1, :, p]), (layer, p)
        assert np.count_nonzero(cache) == (end - start) * HEADS * DIM * 2
    keys[:, 0], values[:, 0] = 0, 0
    mover.move(keys[:, 0], values[:, 0], addresses, BLOCKS, BS, table, start, end, into_pool=True)
    assert np.array_equal(keys[:, 0, :, start:end], keys[:, 1, :, start:end])
    assert np.array_equal(values[:, 0, :, start:end], values[:, 1, :, start:end])
    assert (
        np.count_nonzero(keys[:, 0])
        == np.count_nonzero(values[:, 0])
        == keys[:, 0, :, start:end].size
    )


@pytest.mark.parametrize(
    ("table", "span", "blocks"),
    [
        ([0, 1, 99], (0, 300), BLOCKS),  # a block id past the cache
        ([0, -1], (0, 200), BLOCKS),  # a negative one
        ([0, 1], (0, 257), BLOCKS),  # positions past the table
    ],
)
def test_a_move_out_of_range_is_refused_before_anything_is_written(
    table: list[int], span: tuple[int, int], blocks: int
) -> None:
    assert mover is not None
    keys, values, caches, addresses = setup()
    with pytest.raises(ValueError, match="KV move"):
        mover.move(keys[:, 0], values[:, 0], addresses, blocks, BS, table, *span, into_pool=False)
    assert not any(c.any() for c in caches)


def test_a_save_into_a_read_only_pool_or_past_a_slot_is_refused() -> None:
    assert mover is not None
    keys, values, caches, addresses = setup()
    table = list(range(8))
    with pytest.raises(ValueError, match="not the move's layout"):
        mover.move(
            keys[:, 0], values[:, 0], addresses, BLOCKS, BS, table, 0, MAX_LEN + 1, into_pool=False
        )
    values.flags.writeable = False
    with pytest.raises(ValueError, match="not the move's layout"):
        mover.move(keys[:, 0], values[:, 0], addresses, BLOCKS, BS, table, 0, 10, into_pool=True)
    assert not any(c.any() for c in caches) and values.all()


# --- a failover's load sums the adopted blocks' checksums as it copies them ------


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("length", "table"), [(16, [3]), (300, [4, 0, 9]), (1000, list(range(8)))])
@ALIGNED
def test_a_load_sums_the_pools_block_checksums_as_it_copies_them(
    d: int, length: int, table: list[int], at: int
) -> None:
    """Each whole block's sum is the pool's own checksum of it (kvlog's
    block_checksum), over every layer and head, keys and values; the cache
    gets what it gets without sums; a changed word changes its block's sum only."""
    from concurrent.futures import Future

    from understudy.engine_shim import kvlog, kvpool
    from understudy.engine_shim.kvpool import KvPool

    assert mover is not None
    spec = kvlog.PoolSpec(
        "m", layers=LAYERS, kv_heads=HEADS, head_dim=d, dtype="float32", slots=2, max_len=1024
    )
    pool = KvPool(memoryview(bytearray(spec.pool_bytes)), spec, 1)
    rng = np.random.default_rng(d)
    pool.k[...] = rng.standard_normal(pool.k.shape, dtype=np.float32)
    pool.v[...] = rng.standard_normal(pool.v.shape, dtype=np.float32)
    slot, blocks = 1, length // 16

    def load(sums: kvpool.BlockSums | None) -> list[np.ndarray]:
        caches = [zeros((BLOCKS, HEADS, BS, 2 * d), at) for _ in range(LAYERS)]
        addresses = np.array([c.ctypes.data for c in caches], dtype=np.uintp)
        k, v = pool.rk[:, slot], pool.rv[:, slot]
        mover.move(k, v, addresses, BLOCKS, BS, table, 0, length, into_pool=False, sums=sums)
        return caches

    checking = kvpool.Checking(slot, blocks * 16, length, 0, 16, Future())
    summed = pool.block_sums(checking)
    caches = load(summed)
    assert all(np.array_equal(a, b) for a, b in zip(caches, load(None), strict=True))
    assert summed.total.tolist() == [pool.checksum(slot, b, 16) for b in range(blocks)]
    pool.k[2, slot, 1, 16 * (blocks - 1) + 3].view(np.uint32)[5] ^= 1
    again = pool.block_sums(checking)
    load(again)
    assert again.total.tolist()[:-1] == summed.total.tolist()[:-1]
    assert again.total[-1] != summed.total[-1]
    assert again.total[-1] == pool.checksum(slot, blocks - 1, 16)


def test_sums_for_a_save_or_from_inside_a_block_or_past_the_end_are_refused() -> None:
    from concurrent.futures import Future

    from understudy.engine_shim import kvpool
    from understudy.engine_shim.kvlog import PoolSpec
    from understudy.engine_shim.kvpool import KvPool

    assert mover is not None
    spec = PoolSpec(
        "m", layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype="float32", slots=2, max_len=MAX_LEN
    )
    pool = KvPool(memoryview(bytearray(spec.pool_bytes)), spec, 1)
    keys, values, caches, addresses = setup()
    sums = pool.block_sums(kvpool.Checking(0, 64, 64, 0, 16, Future()))
    table = list(range(8))
    fewer = kvpool.BlockSums(sums.rows[:, :1].copy(), sums.cols[:, :1].copy(), sums.total)
    cases = [
        (0, 64, False, fewer, "not the move's layout"),  # weights of 1 layer of 3
        (0, 64, True, sums, "KV move"),  # a save
        (8, 64, False, sums, "KV move"),  # from inside a block
        (0, 48, False, sums, "KV move"),  # blocks past the end
    ]
    for start, end, into_pool, given, match in cases:
        with pytest.raises(ValueError, match=match):
            k, v = keys[:, 0], values[:, 0]
            mover.move(
                k, v, addresses, BLOCKS, BS, table, start, end, into_pool=into_pool, sums=given
            )
    assert not any(c.any() for c in caches) and not sums.total.any()
    assert np.count_nonzero(keys[:, 0]) == keys[:, 0].size  # the save wrote nothing either
