"""A standby's copies ahead of a kill (`vllm_kvfollow`): which blocks of which
slot it copies into which of vLLM's blocks, pass by pass, and what of it the
wake takes. The copies themselves (the C moves, into vLLM-CPU's cache) are
tested against vLLM in tests/vllm/test_vllm_kvconn.py; here ``load`` notes
each move."""

from __future__ import annotations

from understudy.engine_shim import kvlog
from understudy.engine_shim.adapters.vllm_kvfollow import Following
from understudy.engine_shim.adapters.vllm_kvplan import Move
from understudy.engine_shim.adapters.vllm_kvpreload import targets
from understudy.engine_shim.kvlog import Kind, Record
from understudy.engine_shim.kvpool import BlockSums, in_flight

SPEC = kvlog.PoolSpec("m", layers=1, kv_heads=1, head_dim=4, dtype="float32", slots=3, max_len=256)
FREE = list(range(40, 80))


class Log:
    """A log's index, sealed as an engine would, generation by generation."""

    def __init__(self) -> None:
        self.index = kvlog.Index(SPEC)
        self.gen = 0

    def seal(self, slot: int, positions: int, chain: bytes = kvlog.ROOT) -> None:
        """``slot``'s blocks up to ``positions`` (whole ones unchanged)."""
        for block in range(-(-positions // 16)):
            count = min(16, positions - 16 * block)
            if (got := self.index.sealed.get((slot, block))) is None or got.count != count:
                self.gen += 1
                rec = Record(self.gen, Kind.SEAL, slot, block, 1, chain, block, count)
                self.index.apply(rec)

    def retire(self, slot: int) -> None:
        self.gen += 1
        self.index.apply(Record(self.gen, Kind.RETIRE, slot, 0, 1))


def passes(following: Following, log: Log, n: int = 1) -> list[tuple[int, int, int, int]]:
    """``n`` passes of the reader: the moves made, (slot, first vLLM block, start, end)."""
    moves: list[tuple[int, int, int, int]] = []

    def load(m: Move, sums: BlockSums) -> None:
        assert sums.total.size == m.end // 16  # it sums the blocks it copies
        moves.append((m.slot, m.block_ids[0], m.start, m.end))

    for _ in range(n):
        following.follow(log.index, lambda k: FREE[:k], load)
    return moves


def test_it_copies_whole_blocks_once_the_guess_held_and_then_only_what_is_new() -> None:
    log, following = Log(), Following(SPEC, 32)
    log.seal(0, 70)
    assert passes(following, log) == []  # the guess is made
    assert passes(following, log, 2) == [(0, 40, 0, 64)]  # 4 whole blocks, once
    log.seal(0, 81)
    assert passes(following, log) == [(0, 40, 64, 80)]
    assert following.positions == 80


def test_a_guess_that_moves_is_not_copied_into() -> None:
    """Two streams: the newest-first order puts the slot sealed last first,
    and the other's blocks after it. While the order changes at each pass,
    nothing is copied; once it holds, each slot is copied into its blocks,
    from its start where its blocks moved."""
    log, following = Log(), Following(SPEC, 32)
    log.seal(0, 40)
    log.seal(1, 20)
    assert in_flight(log.index) == [1, 0]
    assert passes(following, log, 2) == [(1, 40, 0, 16), (0, 41, 0, 32)]
    log.seal(0, 48)  # slot 0 sealed last: it goes first, slot 1 after it
    assert passes(following, log) == []
    log.seal(1, 33)  # and back, slot 1 on two blocks now
    assert passes(following, log) == []
    # Slot 1's block 40 still holds its copy; slot 0's blocks moved (41 to 42).
    assert passes(following, log) == [(1, 40, 16, 32), (0, 42, 0, 48)]


def test_the_wake_takes_a_copy_only_where_its_blocks_and_seals_still_hold() -> None:
    log, following = Log(), Following(SPEC, 32)
    log.seal(0, 50)
    log.seal(1, 40)
    passes(following, log, 2)
    held = log.index.held()
    guess = targets(in_flight(log.index), held, FREE, 32)
    ahead = following.ahead(guess, log.index)
    assert [(t.slot, t.done) for t in ahead] == [(1, 32), (0, 48)]
    assert all(t.sums is not None and t.sums.size == SPEC.blocks_per_slot for t in ahead)
    # The wake guessed other blocks for slot 0 (slot 1 took more), and slot 1
    # was retired and sealed again under another prefix.
    other = targets([0, 1], held, FREE, 32)
    assert [(t.slot, t.done) for t in following.ahead(other, log.index)] == [(0, 0), (1, 0)]
    log.retire(1)
    log.seal(1, 40, chain=b"\x01" * 16)
    guess = targets([1, 0], log.index.held(), FREE, 32)
    assert [(t.slot, t.done) for t in following.ahead(guess, log.index)] == [(1, 0), (0, 0)]
