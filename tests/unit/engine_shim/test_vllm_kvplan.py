"""The vLLM KV connector's plan (``vllm_kvplan``) over a real `KvPool` in memory.

The worker's copies are stood in for by writing what a save covers into the
pool's arena and sealing it, as ``vllm_kvconn`` does after vLLM's forward
pass; the planner itself never touches memory. vLLM's side of the same
(its scheduler, its cache, the copies) runs in tests/vllm and
tests/process/test_kv_failover.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from understudy.engine_shim import kvlog
from understudy.engine_shim.adapters.vllm_kvplan import Move, Planner, Ready
from understudy.engine_shim.adapters.vllm_kvpreload import Target, targets
from understudy.engine_shim.kvpool import KvPool

SPEC = kvlog.PoolSpec(
    model="m", layers=2, kv_heads=1, head_dim=4, dtype="float32", slots=2, max_len=128
)


def pool(memory: bytearray | None = None, epoch: int = 1) -> KvPool:
    mem = memory if memory is not None else bytearray(SPEC.pool_bytes)
    return KvPool(memoryview(mem), SPEC, epoch)


def write_and_seal(p: KvPool, m: Move) -> None:
    """What the worker does with a save: the positions' KV, then their seals."""
    for pos in range(m.start, m.end):
        value = np.float32(m.tokens[pos] + pos / 1000)
        p.k[:, m.slot, :, pos] = value
        p.v[:, m.slot, :, pos] = -value
    p.seal(m.slot, m.tokens, m.start, m.end)


IDS = list(range(100, 150))  # 50 ids


def served(finished: bool = True) -> Planner:
    """A planner whose request "a" (IDS) has run its prefill into a fresh pool."""
    planner = Planner(pool(), SPEC.max_len)
    planner.matched("a", IDS, 0)
    write_and_seal(planner.pool, planner.step([("a", 0, 50, [1], IDS)]).saves[0])
    if finished:
        planner.finished("a")
    return planner


def test_a_new_request_in_a_fresh_pool_loads_nothing_and_saves_what_each_step_computes() -> None:
    planner = Planner(pool(), SPEC.max_len)
    found, claim = planner.matched("a", IDS, 0)
    assert found == 0 and claim is not None and claim.start == 0
    planner.allocated("a", 0)
    plan = planner.step([("a", 0, 50, [7], IDS)])
    assert plan.loads == []
    assert [(m.start, m.end, m.block_ids) for m in plan.saves] == [(0, 50, (7,))]
    assert plan.saves[0].tokens == tuple(IDS)
    # A decode step: one position more, the block table grown.
    plan = planner.step([("a", 50, 1, [7, 9], [*IDS, 5])])
    assert [(m.start, m.end, m.block_ids) for m in plan.saves] == [(50, 51, (7, 9))]


def test_the_same_prefix_again_loads_past_vllms_own_hit_and_never_the_last_id() -> None:
    planner = served()
    # vLLM's own prefix cache already holds 16 positions (one of its blocks).
    found, claim = planner.matched("b", IDS, 16)
    assert claim is not None and claim.slot == 0
    assert claim.start == 49  # all but the last id: no chunk grid for vLLM
    assert found == 49 - 16
    planner.allocated("b", found)
    plan = planner.step([("b", 49, 1, [3, 4], IDS)])
    assert [(m.start, m.end) for m in plan.loads] == [(16, 49)]
    assert [(m.start, m.end) for m in plan.saves] == [(49, 50)]
    # The load happens once: the next step only saves.
    plan = planner.step([("b", 50, 1, [3, 4], [*IDS, 1])])
    assert plan.loads == [] and [(m.start, m.end) for m in plan.saves] == [(50, 51)]


def test_vllm_taking_fewer_positions_than_offered_loads_only_those() -> None:
    planner = served()
    found, _ = planner.matched("b", IDS, 0)
    assert found == 49
    planner.allocated("b", 32)  # vLLM trimmed the load to its own block boundary
    plan = planner.step([("b", 32, 18, [2, 3], IDS)])
    assert [(m.start, m.end) for m in plan.loads] == [(0, 32)]
    # The pool still holds 0..48: the save starts past them, whatever vLLM recomputed.
    assert [(m.start, m.end) for m in plan.saves] == [(49, 50)]


def test_a_request_asked_again_after_preemption_gets_what_the_pool_holds_of_it() -> None:
    planner = served(finished=False)
    # vLLM preempted it (its blocks freed) and asks again, with 60 ids by now.
    ids = [*IDS, *range(10)]
    found, claim = planner.matched("a", ids, 0)
    assert claim is None  # the same slot, not a new claim
    assert found == 50
    planner.allocated("a", 50)
    plan = planner.step([("a", 50, 10, [5, 6], ids)])
    assert [(m.start, m.end) for m in plan.loads] == [(0, 50)]
    assert [(m.start, m.end) for m in plan.saves] == [(50, 60)]


def test_with_every_slot_held_a_request_runs_without_the_pool() -> None:
    planner = Planner(pool(), SPEC.max_len)
    for rid in ("a", "b"):
        planner.matched(rid, IDS, 0)
    found, claim = planner.matched("c", IDS, 0)
    assert (found, claim) == (0, None)
    assert planner.holds("c") is None
    assert planner.step([("c", 0, 50, [1], IDS)]).saves == []
    planner.finished("a")  # a slot is free again
    _, claim = planner.matched("d", IDS, 0)
    assert claim is not None and planner.holds("d") == claim.slot


def test_positions_past_the_slot_are_never_saved_and_a_longer_request_gets_no_slot() -> None:
    planner = Planner(pool(), SPEC.max_len)
    assert planner.matched("long", list(range(129)), 0) == (0, None)
    planner.matched("a", IDS, 0)
    plan = planner.step([("a", 100, 40, [1, 2], list(range(140)))])
    assert [(m.start, m.end) for m in plan.saves] == [(0, 128)]


@pytest.mark.parametrize("epoch", [2, 3])
def test_the_next_engine_adopts_what_the_dead_one_saved(epoch: int) -> None:
    memory = bytearray(SPEC.pool_bytes)
    first = Planner(pool(memory, 1), SPEC.max_len)
    first.matched("a", IDS, 0)
    write_and_seal(first.pool, first.step([("a", 0, 50, [1], IDS)]).saves[0])
    # The engine dies here; the next one maps the same memory under its epoch.
    resumed = [*IDS, 7, 8]
    nxt = Planner(pool(memory, epoch), SPEC.max_len)
    found, claim = nxt.matched("a-continued", resumed, 0)
    # Every sealed position, the streamed ones past a chunk's boundary too:
    # vLLM computes only what a decode step would.
    assert claim is not None and claim.start == 50 and found == 50


def test_a_match_shorter_than_a_chunk_leaves_its_slot_to_the_stream_it_belongs_to() -> None:
    """A new request whose prompt a slot's stream began with, matched for less
    than a chunk (so it would reuse nothing), takes the emptiest slot: the
    stream's blocks stay for its continuation (after a failover the two
    arrive together)."""
    p = pool()
    stream = [*IDS[:20], *range(30)]  # a 20-id prompt and 30 generated ids
    assert p.claim(stream, [0, 1], prompt=20, chunk=64).slot == 0
    p.k[:, 0, :, :50] = 1.0
    p.seal(0, stream, 0, 50)
    new = p.claim(IDS[:20], [0, 1], prompt=20, chunk=64)  # one block matched, chunk of 64
    assert (new.slot, new.start) == (1, 0)
    back = p.claim([*stream, 5], [0], prompt=20, chunk=64)
    assert (back.slot, back.start) == (0, 50)  # all it sealed, past the prompt: no chunk grid
    # With the stream's slot the only one free, the new request takes it.
    assert p.claim(IDS[:20], [0], prompt=20, chunk=64).slot == 0


ODD_ROWS = replace(SPEC, dtype="float16", head_dim=3, layers=3, kv_heads=2)  # 6-byte rows


@pytest.mark.parametrize("spec", [SPEC, ODD_ROWS], ids=["uint64-words", "uint16-words"])
def test_checksums_of_many_blocks_at_once_are_each_blocks_checksum(spec: kvlog.PoolSpec) -> None:
    """The batched reading (a layer's run of blocks at a time) gives what the
    seal format says: ``block_checksum`` of the block's words, keys then
    values, layer by layer, head by head."""
    p = KvPool(memoryview(bytearray(spec.pool_bytes)), spec, 1)
    rng = np.random.default_rng(0)
    for arr in (p.k, p.v):  # any bits: the checksum is over bytes
        raw = arr.view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    wanted = [(0, 16), (1, 16), (3, 5), (7, 1), (5, 16)]  # whole blocks with a gap too
    b = spec.block_tokens
    word = kvlog.word_dtype(spec.head_dim * spec.itemsize)
    for slot in range(spec.slots):
        expected = [
            kvlog.block_checksum(
                np.stack(
                    [
                        arr[layer, slot, head, block * b : block * b + count]
                        for arr in (p.k, p.v)
                        for layer in range(spec.layers)
                        for head in range(spec.kv_heads)
                    ]
                ).view(word),
                b,
            )
            for block, count in wanted
        ]
        assert p.checksums(slot, wanted) == expected
        assert [p.checksum(slot, *w) for w in wanted] == expected


def test_a_load_carries_its_claims_checksums_and_a_cut_saves_from_the_bad_block() -> None:
    """The next engine's claim is deferred: its load carries the checksums
    to settle (summed as the worker copies, or read). A block that fails
    cuts the request back: what is saved next starts at that block."""
    memory = bytearray(SPEC.pool_bytes)
    first = Planner(pool(memory, 1), SPEC.max_len)
    first.matched("a", IDS, 0)
    write_and_seal(first.pool, first.step([("a", 0, 50, [1], IDS)]).saves[0])
    first.pool.v[1, 0, 0, 20] += 1.0  # block 1, after its seal
    nxt = Planner(pool(memory, 2), SPEC.max_len)
    resumed = [*IDS, 7]
    found, claim = nxt.matched("b", resumed, 0)
    assert claim is not None and claim.checking is not None and found == 50
    nxt.allocated("b", 50)
    plan = nxt.step([("b", 50, 1, [4], resumed)])
    assert [(m.start, m.end, m.checking) for m in plan.loads] == [(0, 50, claim.checking)]
    assert [(m.start, m.end) for m in plan.saves] == [(50, 51)]
    nxt.pool.settle(claim.checking)  # the worker's, where its copy summed nothing
    trusted = nxt.pool.confirm(claim.checking)
    assert trusted == 16
    nxt.cut("b", trusted)
    # vLLM computes again from its block holding position 16 (here: 0)
    plan = nxt.step([("b", 0, 51, [4], resumed)])
    assert plan.loads == [] and [(m.start, m.end) for m in plan.saves] == [(16, 51)]


def test_loads_ahead_land_where_each_continuation_is_guessed_to() -> None:
    """A continuation's prompt is its slot's positions and one id more: it
    takes ceil((held + 1) / block) blocks, the held ones fill the first."""
    free = [10, 11, 12, 13, 14, 15]
    got = targets([3, 1, 2], {1: 32, 2: 40, 3: 15}, free, 16)
    assert got == [Target(3, (10,), 15), Target(1, (11, 12), 32)]  # 2 would not fit
    assert targets([1], {}, free, 16) == []  # a slot holding nothing
    assert targets([3], {3: 15}, [], 16) == []


def test_a_load_takes_what_was_loaded_ahead_only_from_position_0_into_the_same_blocks() -> None:
    memory = bytearray(SPEC.pool_bytes)
    first = Planner(pool(memory, 1), SPEC.max_len)
    first.matched("a", IDS, 0)
    write_and_seal(first.pool, first.step([("a", 0, 50, [1], IDS)]).saves[0])
    resumed = [*IDS, 7]
    sums = np.arange(3, dtype=np.uint64)
    for blocks, given, ready, want in [
        ([4], 0, {0: Ready((4,), 50, sums)}, 50),  # its own blocks
        ([5], 0, {0: Ready((4,), 50, sums)}, 0),  # other blocks
        ([4], 0, {1: Ready((4,), 50, sums)}, 0),  # another slot's
        ([4], 0, {0: Ready((4,), 40, None)}, 40),  # fewer positions: the rest is copied
        ([4], 0, None, 0),  # nothing loaded ahead
        ([4], 16, {0: Ready((4,), 50, sums)}, 0),  # vLLM's own cache held a prefix
    ]:
        nxt = Planner(pool(bytearray(memory), 2), SPEC.max_len)
        found, _ = nxt.matched("b", resumed, given)
        nxt.allocated("b", found)
        (load,) = nxt.step([("b", 50, 1, blocks, resumed)], ready).loads
        assert (load.start, load.end, load.ready) == (given, 50, want), (blocks, given, ready)
        summed = None if want == 0 or ready is None else ready[0].sums
        if summed is None:
            assert load.sums is None
        else:  # those of the blocks its claim settles (below position 50: 3), as summed
            assert load.sums is not None
            assert np.array_equal(load.sums, summed[:3])
            assert np.shares_memory(load.sums, summed)
