"""The adopted blocks of the sequences in flight at the death, checked on a
thread before their continuations claim them (``KvPool.check_ahead``): a
claim then takes the checksums found, never reads those blocks again, and a
bad block costs what it costs at a claim. (The deferred claim: test_kvpool_defer.py.)"""

from __future__ import annotations

import threading

import pytest

from understudy.engine_shim.kvpool import AHEAD_RECORDS, KvPool

from .test_kvpool_defer import SPEC, TOKENS, adopted


def checked_ahead(pool: KvPool) -> KvPool:
    pool.check_ahead()
    assert pool.ahead is not None
    pool.ahead.join()
    return pool


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "at-the-claim"])
def test_a_claim_takes_the_checksums_found_ahead(defer: bool) -> None:
    pool = checked_ahead(adopted())
    assert pool.stats.checked_ahead == 3  # blocks 0 and 1, and block 2 as far as sealed
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16, defer=defer)
    assert claim.start == 40
    if claim.checking is not None:
        assert pool.confirm(claim.checking) == 40
    assert pool.stats.checked == 0  # no block read twice


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "at-the-claim"])
def test_a_bad_block_found_ahead_moves_the_claim_back(defer: bool) -> None:
    pool = checked_ahead(adopted(corrupt_position=20))  # block 1
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16, defer=defer)
    start = claim.start if claim.checking is None else pool.confirm(claim.checking)
    assert start == 16
    assert pool.stats.corrupt_blocks == 1 and pool.stats.checked == 0
    assert pool.index.held() == {0: 16}


def test_a_claim_before_the_thread_reaches_its_slot_checks_it_itself() -> None:
    pool = adopted(corrupt_position=35)
    held = threading.Event()
    pool.warming = threading.Thread(target=held.wait)  # the pages still being mapped
    pool.warming.start()
    pool.check_ahead()
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16)
    assert (claim.start, claim.corrupt) == (32, 1)
    assert pool.stats.checked == 3
    held.set()
    assert pool.ahead is not None
    pool.ahead.join()
    assert pool.stats.checked_ahead == 0  # the slot was the claim's by then


def test_only_the_slots_sealed_last_are_checked_ahead() -> None:
    """A prefix sealed long before the death (slot 0) waits for a claim: the
    sequence in flight (slot 1) sealed more than the window's records since."""
    memory = bytearray(SPEC.pool_bytes)
    first = KvPool(memoryview(memory), SPEC, 1)
    first.claim(TOKENS, [0], prompt=40, chunk=16)
    first.seal(0, TOKENS, 0, 40)
    first.claim(TOKENS[:1], [1], prompt=1, chunk=16)
    steps = AHEAD_RECORDS * SPEC.slots + 1
    for n in range(1, steps + 1):  # a decode step each: its last block sealed again
        first.seal(1, TOKENS, n - 1, n)
    pool = checked_ahead(KvPool(memoryview(memory), SPEC, 2))
    assert pool.stats.checked_ahead == 1  # slot 1's block 0
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16)
    assert (claim.slot, claim.start) == (0, 40)
    assert pool.stats.checked == 3


def test_blocks_sealed_again_after_the_check_are_read_at_their_claim() -> None:
    pool = checked_ahead(adopted())
    claim = pool.claim([*TOKENS, 7], [0, 1], prompt=10, chunk=16)
    pool.seal(0, [*TOKENS, 7], claim.start, 41)
    pool.claim([*TOKENS, 7, 8], [0, 1], prompt=10, chunk=16)  # the slot freed and claimed again
    assert pool.stats.checked == 1  # block 2, sealed anew; 0 and 1 as checked ahead
