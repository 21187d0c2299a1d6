"""A claim whose checksums run beside the engine's first step (``defer``):
the block the start falls inside is checked at the claim, the whole blocks
below it on a thread, and ``confirm`` gives the start that holds, retiring
what lies past a bad block. (The engines around it: test_kvpool_llama.py.)"""

from __future__ import annotations

import numpy as np

from understudy.engine_shim import kvlog
from understudy.engine_shim.kvpool import KvPool

SPEC = kvlog.PoolSpec("m", layers=2, kv_heads=2, head_dim=8, dtype="float32", slots=2, max_len=128)
TOKENS = list(range(100, 140))  # 40 positions: blocks 0 and 1 whole, block 2 with 8


def adopted(corrupt_position: int | None = None, n: int = len(TOKENS)) -> KvPool:
    """The next engine's pool, after one that sealed TOKENS[:n] in slot 0."""
    memory = bytearray(SPEC.pool_bytes)
    first = KvPool(memoryview(memory), SPEC, 1)
    first.claim(TOKENS[:n], [0, 1], prompt=n, chunk=16)
    rng = np.random.default_rng(0)
    first.k[:, 0, :, :n] = rng.standard_normal((2, 2, n, 8), dtype=np.float32)
    first.v[:, 0, :, :n] = rng.standard_normal((2, 2, n, 8), dtype=np.float32)
    first.seal(0, TOKENS, 0, n)
    if corrupt_position is not None:
        first.v[1, 0, 1, corrupt_position, 3] += 1.0
    return KvPool(memoryview(memory), SPEC, 2)


def test_a_claim_that_holds_is_confirmed_at_its_start() -> None:
    pool = adopted()
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16, defer=True)
    assert (claim.slot, claim.start, claim.corrupt) == (0, 40, 0)
    assert claim.checking is not None and claim.checking.start == 40
    assert pool.confirm(claim.checking) == 40
    assert pool.stats.reused_blocks == 2 and pool.stats.corrupt_blocks == 0


def test_the_block_the_start_falls_inside_is_checked_at_the_claim() -> None:
    pool = adopted(corrupt_position=35)  # block 2, which the engine writes into from 40
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16, defer=True)
    assert (claim.start, claim.corrupt) == (32, 1)
    assert claim.checking is not None  # blocks 0 and 1, on the thread
    assert pool.confirm(claim.checking) == 32


def test_a_bad_block_below_the_start_moves_it_back_and_retires_the_rest() -> None:
    pool = adopted(corrupt_position=20)  # block 1
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16, defer=True)
    assert (claim.start, claim.corrupt) == (40, 0)  # not known yet
    assert claim.checking is not None
    assert pool.confirm(claim.checking) == 16
    assert pool.stats.corrupt_blocks == 1 and pool.stats.reused_blocks == 1
    assert pool.index.held() == {0: 16}  # block 0 only: 1 and 2 retired
    # inside the prompt, the start goes back to the chunk grid: here to 0
    pool = adopted(corrupt_position=20)
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=41, chunk=32, defer=True)
    assert claim.start == 32 and claim.checking is not None
    assert pool.confirm(claim.checking) == 0
    assert pool.index.held().get(0, 0) == 0


def test_without_a_whole_block_below_the_start_nothing_is_deferred() -> None:
    pool = adopted(n=10)  # block 0, sealed in part: checked at the claim
    claim = pool.claim([*TOKENS[:10], 7], [0, 1], prompt=5, chunk=16, defer=True)
    assert (claim.start, claim.checking) == (10, None)


# --- in_step: the engine's first step sums the blocks as it reads them ----------


def test_in_step_the_steps_sums_settle_the_claim_and_no_thread_reads_them() -> None:
    pool = adopted()
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16, defer=True, in_step=True)
    assert claim.checking is not None
    assert [b for b, _ in claim.checking.in_step] == [0, 1]
    assert not claim.checking.first_bad.done()  # nothing runs until the step settles it
    summed = pool.block_sums(claim.checking)
    assert summed.total.tolist() == [0, 0]
    expected = [pool.checksum(0, b, 16) for b in (0, 1)]
    summed.total[:] = expected
    pool.settle(claim.checking, summed.total)
    assert pool.confirm(claim.checking) == 40
    assert pool.stats.summed_in_step == 2 and pool.stats.corrupt_blocks == 0


def test_in_step_sums_that_differ_move_the_start_back_to_the_bad_block() -> None:
    pool = adopted(corrupt_position=20)  # block 1
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16, defer=True, in_step=True)
    assert claim.checking is not None and claim.start == 40
    summed = pool.block_sums(claim.checking)
    summed.total[:] = [pool.checksum(0, b, 16) for b in (0, 1)]  # what the bytes hold now
    pool.settle(claim.checking, summed.total)
    assert pool.confirm(claim.checking) == 16
    assert pool.index.held() == {0: 16}


def test_in_step_without_a_step_confirm_reads_the_blocks_itself() -> None:
    pool = adopted(corrupt_position=20)
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16, defer=True, in_step=True)
    assert claim.checking is not None
    assert pool.confirm(claim.checking) == 16  # the step failed before it settled
    assert pool.stats.summed_in_step == 0


def test_in_step_a_start_inside_the_prompt_is_checked_on_a_thread() -> None:
    pool = adopted()
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=41, chunk=32, defer=True, in_step=True)
    assert claim.start == 32 and claim.checking is not None
    assert claim.checking.in_step == ()  # a prefill follows: its attention sums nothing
    assert pool.confirm(claim.checking) == 32
