"""The seal log's pure core: codec, reading a ring, replay, lookup, and the
one property that matters: whatever the moment of a death, a reader trusts
only blocks whose memory holds what their seal says."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.engine_shim import kvlog
from understudy.engine_shim.kvadopt import adopt
from understudy.engine_shim.kvlog import (
    RECORD_SIZE,
    Index,
    Kind,
    PoolSpec,
    Record,
    Writer,
    chain,
    chains,
    read_log,
)


def spec(slots: int = 2, blocks: int = 4, slack: int = 0) -> PoolSpec:
    return PoolSpec(
        model="m",
        layers=2,
        kv_heads=1,
        head_dim=4,
        dtype="float32",
        slots=slots,
        max_len=blocks * 4,
        block_tokens=4,
        log_slack=slack,
    )


def h(i: int) -> bytes:
    return chain(kvlog.ROOT, [i])


def apply(log: bytearray, writes: list[kvlog.Write]) -> None:
    for w in writes:
        log[w.offset : w.offset + len(w.data)] = w.data


def reread(sp: PoolSpec, log: bytearray, epoch: int | None = None) -> Index:
    """The reference reading (`read_log`, `Index.replay`), and the engine's
    own at adoption (`kvadopt.adopt`) checked to agree with it."""
    read = read_log(log, sp.log_capacity)
    index = Index.replay(sp, read.records, epoch)
    fast = adopt(log, sp, 2**64 - 1 if epoch is None else epoch)
    assert fast.index.sealed == index.sealed and fast.index.ignored == index.ignored
    assert (fast.records, fast.next_gen, fast.torn, fast.dropped) == (
        len(read.records),
        read.next_gen,
        read.torn,
        read.dropped,
    )
    return index


def sealed_log(sp: PoolSpec, blocks: int) -> bytearray:
    """A ring in which slot 0's first ``blocks`` blocks were sealed, in order."""
    log = bytearray(sp.log_capacity * RECORD_SIZE)
    w = Writer(Index(sp), epoch=1)
    for b in range(blocks):
        apply(log, w.seal(0, b, h(b), b))
    return log


def chains_of(index: Index) -> dict[tuple[int, int], tuple[bytes, int]]:
    return {k: (s.chain, s.checksum) for k, s in index.sealed.items()}


# --- layout and codec -----------------------------------------------------------


def test_spec_layout_and_digest() -> None:
    sp = PoolSpec("cfg", layers=30, kv_heads=3, head_dim=64, dtype="float32", slots=8, max_len=8192)
    assert sp.blocks_per_slot == 512 and sp.total_blocks == 4096
    assert sp.log_capacity == 2 * 4096 + 64
    assert sp.arena_offset % kvlog.ARENA_ALIGN == 0
    assert sp.arena_offset >= kvlog.HEADER_SIZE + sp.log_capacity * RECORD_SIZE
    assert sp.cache_bytes == 30 * 8 * 3 * 8192 * 64 * 4
    assert sp.pool_bytes == sp.arena_offset + 2 * sp.cache_bytes
    assert sp.digest() == PoolSpec(**sp.as_json()).digest()  # type: ignore[arg-type]
    assert sp.digest() != PoolSpec(**(sp.as_json() | {"slots": 4})).digest()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [{"dtype": "int8"}, {"slots": 0}, {"max_len": 0}, {"block_tokens": 0}, {"log_slack": -1}],
)
def test_spec_refuses_nonsense(bad: dict[str, object]) -> None:
    args: dict[str, object] = spec().as_json() | bad
    with pytest.raises(ValueError):
        PoolSpec(**args)  # type: ignore[arg-type]


def test_header_round_trip_and_refusals() -> None:
    sp = spec()
    raw = kvlog.encode_header(sp)
    assert kvlog.decode_header(raw) == (sp.digest(), sp.log_capacity)
    assert kvlog.decode_header(bytes(len(raw))) is None  # a fresh pool's zeros
    assert kvlog.decode_header(raw[:10]) is None
    torn = bytearray(raw)
    torn[12] ^= 1
    assert kvlog.decode_header(torn) is None


@given(
    gen=st.integers(1, 2**64 - 1),
    kind=st.sampled_from(Kind),
    slot=st.integers(0, 2**16 - 1),
    block=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 2**64 - 1),
    chain_=st.binary(min_size=16, max_size=16),
    checksum=st.integers(0, 2**64 - 1),
    count=st.integers(0, 2**16 - 1),
)
def test_record_round_trip(
    gen: int,
    kind: Kind,
    slot: int,
    block: int,
    epoch: int,
    chain_: bytes,
    checksum: int,
    count: int,
) -> None:
    rec = Record(gen, kind, slot, block, epoch, chain_, checksum, count)
    raw = kvlog.encode_record(rec)
    assert len(raw) == RECORD_SIZE
    assert kvlog.decode_record(raw) == rec


@given(data=st.binary(min_size=RECORD_SIZE, max_size=RECORD_SIZE))
def test_random_bytes_are_no_record(data: bytes) -> None:
    rec = kvlog.decode_record(data)
    if rec is not None:  # only if the CRC happens to hold: then it re-encodes the same
        assert kvlog.encode_record(rec)[:54] == data[:54]


@given(
    rec=st.builds(
        Record,
        st.integers(1, 1000),
        st.sampled_from(Kind),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 9),
        st.binary(min_size=16, max_size=16),
        st.integers(0, 2**32),
    ),
    cut=st.integers(1, RECORD_SIZE - 1),
    old=st.binary(min_size=RECORD_SIZE, max_size=RECORD_SIZE),
)
def test_a_torn_record_is_never_read(rec: Record, cut: int, old: bytes) -> None:
    new = kvlog.encode_record(rec)
    torn = new[:cut] + old[cut:]
    got = kvlog.decode_record(torn)
    assert got is None or got == rec or got == kvlog.decode_record(old)


def test_chain_covers_the_whole_prefix() -> None:
    a = chains([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chains([1, 2, 3, 0, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # a difference in block 0 changes block 1 too
    assert chains([1, 2, 3], 4) == []


# --- reading a ring -------------------------------------------------------------


def test_empty_log() -> None:
    sp = spec()
    got = read_log(bytes(sp.log_capacity * RECORD_SIZE), sp.log_capacity)
    assert got == kvlog.LogRead((), 1, 0, 0)
    with pytest.raises(ValueError):
        read_log(b"", sp.log_capacity)


def test_a_gap_drops_everything_older() -> None:
    sp = spec(slack=8)
    log = sealed_log(sp, 4)
    log[2 * RECORD_SIZE + 5] ^= 0xFF  # generation 2 corrupted
    got = read_log(log, sp.log_capacity)
    assert [r.gen for r in got.records] == [3, 4]
    assert got.torn == 1 and got.dropped == 1 and got.next_gen == 5


def test_a_record_out_of_its_place_is_not_read() -> None:
    sp = spec(slack=8)
    log = bytearray(sp.log_capacity * RECORD_SIZE)
    log[3 * RECORD_SIZE : 4 * RECORD_SIZE] = kvlog.encode_record(Record(1, Kind.SEAL, 0, 0, 1))
    got = read_log(log, sp.log_capacity)
    assert got.records == () and got.dropped == 1


# --- replay and lookup -----------------------------------------------------------


def test_retire_drops_the_slot_from_a_block_on() -> None:
    sp = spec()
    index = Index.replay(
        sp,
        [
            *(Record(g + 1, Kind.SEAL, 0, g, 1, h(g), 0, 4) for g in range(4)),
            Record(5, Kind.SEAL, 1, 0, 1, h(0), 0, 4),
            Record(6, Kind.RETIRE, 0, 2, 2),
        ],
    )
    assert sorted(index.sealed) == [(0, 0), (0, 1), (1, 0)]
    assert index.run(0) == 2 and index.run(1) == 1


def test_replay_ignores_newer_epochs_and_blocks_outside_the_pool() -> None:
    sp = spec()
    recs = [
        Record(1, Kind.SEAL, 0, 0, 5, h(0), 0, 4),  # a newer epoch
        Record(2, Kind.SEAL, 9, 0, 1, h(0), 0, 4),  # no slot 9
        Record(3, Kind.SEAL, 0, 0, 1, h(0), 0, 5),  # more positions than a block has
        Record(4, Kind.SEAL, 0, 0, 1, h(0), 0, 0),  # none
    ]
    index = Index.replay(sp, recs, epoch=4)
    assert index.sealed == {} and index.ignored == 4


def test_match_finds_the_longest_sealed_prefix() -> None:
    sp = spec(slots=3)
    toks = list(range(100, 116))
    hs = chains(toks, 4)
    other = chains([*toks[:8], 0, 0, 0, 0], 4)
    w = Writer(Index(sp), epoch=1)
    for b in range(2):
        w.seal(0, b, hs[b], 0)
    for b in range(3):
        w.seal(1, b, other[b], 0)
    for b in range(4):
        w.seal(2, b, hs[b], 0)
    index = w.index
    assert index.match(toks, range(3)) == kvlog.Match(2, 16, 4)
    assert index.match(toks[:15], range(3)) == kvlog.Match(2, 12, 3)  # whole blocks only
    assert index.match(toks, [0, 1]) == kvlog.Match(0, 8, 2)  # slot 1 diverges at block 2
    assert index.match([1, 2, 3, 4], range(3)) is None


def test_a_last_block_sealed_in_part_matches_in_part() -> None:
    sp = spec(slots=2)
    toks = list(range(100, 110))  # two whole blocks and 2 positions
    hs = chains(toks, 4)
    w = Writer(Index(sp), epoch=1)
    w.seal(0, 0, hs[0], 0)
    w.seal(0, 1, hs[1], 0)
    w.seal(0, 2, chain(hs[1], toks[8:9]), 0, count=1)
    w.seal(0, 2, chain(hs[1], toks[8:10]), 0, count=2)  # it grew: sealed again
    assert w.index.sealed[(0, 2)].count == 2
    assert w.index.match(toks, [0, 1]) == kvlog.Match(0, 10, 3)
    assert w.index.match([*toks, 7, 7], [0, 1]) == kvlog.Match(0, 10, 3)
    assert w.index.match(toks[:9], [0, 1]) == kvlog.Match(0, 8, 2)  # the part is longer
    assert w.index.match([*toks[:9], 0], [0, 1]) == kvlog.Match(0, 8, 2)  # another token
    with pytest.raises(ValueError):
        w.seal(0, 3, h(0), 0, count=5)


def test_touched_blocks() -> None:
    sp = spec(blocks=4)
    assert list(kvlog.touched(sp, 0, 3)) == [(0, 3)]
    assert list(kvlog.touched(sp, 3, 9)) == [(0, 4), (1, 4), (2, 1)]
    assert list(kvlog.touched(sp, 8, 100)) == [(2, 4), (3, 4)]  # never past the slot
    assert list(kvlog.touched(sp, 5, 5)) == []


def test_writer_refuses_blocks_outside_the_pool() -> None:
    w = Writer(Index(spec()), epoch=1)
    with pytest.raises(ValueError):
        w.seal(2, 0, h(0), 0)
    with pytest.raises(ValueError):
        w.seal(0, 4, h(0), 0)
    with pytest.raises(ValueError):
        w.seal(0, 0, b"short", 0)
    assert w.retire(0, 0) == []  # nothing sealed there: nothing to write
    with pytest.raises(ValueError):
        Writer(Index(spec()), epoch=1, next_gen=0)


def _block(seed: int, pieces: int = 6, positions: int = 16, words: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**64, size=(pieces, positions, words), dtype=np.uint64)


@given(
    piece=st.integers(0, 5),
    position=st.integers(0, 15),
    word=st.integers(0, 7),
    bit=st.integers(0, 63),
    seed=st.integers(0, 3),
)
def test_checksum_detects_any_change_of_one_word(
    piece: int, position: int, word: int, bit: int, seed: int
) -> None:
    """Any bit of any word, the top one too (a float's sign): a change confined
    to one word moves the checksum by the change times an odd number."""
    x = _block(seed)
    before = kvlog.block_checksum(x, 16)
    x[piece, position, word] ^= np.uint64(1 << bit)
    assert kvlog.block_checksum(x, 16) != before
    x[piece, position, word] = np.uint64(2**64 - 1) - x[piece, position, word]  # any value
    assert kvlog.block_checksum(x, 16) != before


def test_checksum_depends_on_where_the_bytes_are() -> None:
    x = _block(0)
    base = kvlog.block_checksum(x, 16)
    for moved in (
        x[:, [1, 0, *range(2, 16)]],  # two positions swapped
        x[:, :, [1, 0, *range(2, 8)]],  # two words of every position swapped
        x[[1, 0, 2, 3, 4, 5]],  # two pieces (layers, heads, keys/values) swapped
        np.zeros_like(x),  # a block zeroed (fresh memory)
    ):
        assert kvlog.block_checksum(np.ascontiguousarray(moved), 16) != base
    # a block covered in part: its first positions only, as their own block
    assert kvlog.block_checksum(x[:, :5], 16) == kvlog.block_checksum(x[:, :5].copy(), 16)
    assert kvlog.block_checksum(x[:, :5], 16) != kvlog.block_checksum(x[:, :6], 16)
    with pytest.raises(ValueError):
        kvlog.block_checksum(x, 8)  # more positions than a block has


def test_checksum_words_tile_a_row() -> None:
    assert kvlog.word_dtype(256) is np.uint64
    assert kvlog.word_dtype(12) is np.uint32
    assert kvlog.word_dtype(6) is np.uint16
    assert kvlog.word_dtype(3) is np.uint8


def test_a_header_of_another_version_is_refused_and_named() -> None:
    """Version 1 sealed CRC-32s: its pool is never adopted, and the shell can
    say it is an old format (not a fresh or torn header)."""
    sp = spec()
    raw = kvlog.encode_header(sp)
    assert kvlog.header_version(raw) == kvlog.VERSION == 2
    body = bytearray(raw[:-4])
    struct.pack_into("<I", body, 8, 1)  # the version field, after the magic
    old = bytes(body) + struct.pack("<I", zlib.crc32(body))
    assert kvlog.decode_header(old) is None
    assert kvlog.header_version(old) == 1
    assert kvlog.header_version(bytes(len(raw))) is None
    torn = bytearray(old)
    torn[20] ^= 1
    assert kvlog.header_version(torn) is None


# --- the property: a death anywhere never makes a wrong block trusted ------------

# Write block (slot, block) with content id c up to position ``count`` and seal
# it; or, ``grow``, write more of the block the slot holds and seal it again.
Op = tuple[int, int, int, int, bool]
Truth = dict[tuple[int, int], tuple[int, int] | None]  # (content, positions) or being written


def h2(content: int, count: int) -> bytes:
    return chain(kvlog.ROOT, [content, count])


def _engine(sp: PoolSpec, ops: list[Op]) -> tuple[list[kvlog.Write], list[Truth]]:
    """Run ``ops`` as the engine does (retire, then write, then seal; a growing
    block is sealed again without a retire, its sealed positions unchanged) and
    return every log write in order with what memory truly held during each one
    (None: a block being rewritten)."""
    w = Writer(Index(sp), epoch=1)
    truth: Truth = {}
    writes: list[kvlog.Write] = []
    after: list[Truth] = []
    for slot, block, fresh, count, grow in ops:
        held = truth.get((slot, block))
        content = fresh
        if grow and held is not None and held[1] < count:
            content = held[0]  # more positions of what the block holds
        else:
            for write in w.retire(slot, block):
                writes.append(write)
                after.append(dict(truth))
            for b in range(block, sp.blocks_per_slot):
                truth[(slot, b)] = None  # the engine now writes these positions
        truth[(slot, block)] = (content, count)
        for write in w.seal(slot, block, h2(content, count), content * 100 + count, count):
            writes.append(write)
            after.append(dict(truth))
    return writes, after


def _trusted_is_true(index: Index, truth: Truth) -> None:
    for key, sealed in index.sealed.items():
        held = truth.get(key)
        assert held is not None, f"{key} is trusted while being written"
        content, count = held
        assert sealed.count <= count, f"{key} trusted for {sealed.count} of {count} positions"
        assert sealed.chain == h2(content, sealed.count), f"{key} holds {content}"
        assert sealed.checksum == content * 100 + sealed.count


ops_strategy = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.integers(0, 3),
        st.integers(0, 50),
        st.integers(1, 4),
        st.booleans(),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops_strategy, slack=st.integers(0, 3))
def test_without_a_death_the_reader_sees_what_the_writer_wrote(ops: list[Op], slack: int) -> None:
    sp = spec(slack=slack)
    log = bytearray(sp.log_capacity * RECORD_SIZE)
    writes, after = _engine(sp, ops)
    apply(log, writes)
    index = reread(sp, log)
    want = Writer(Index(sp), epoch=1)
    for write in writes:
        want.index.apply(write.record)
    assert chains_of(index) == chains_of(want.index)
    _trusted_is_true(index, after[-1])
    # Every block last written and sealed is still trusted, for all it holds:
    # wrapping forgot nothing.
    for key, held in after[-1].items():
        if held is not None:
            assert index.sealed[key].count == held[1]


@settings(max_examples=300, deadline=None)
@given(
    ops=ops_strategy,
    slack=st.integers(0, 3),
    where=st.floats(0, 1, exclude_max=True),
    cut=st.integers(0, RECORD_SIZE - 1),
)
def test_a_death_in_the_middle_of_any_write_trusts_nothing_wrong(
    ops: list[Op], slack: int, where: float, cut: int
) -> None:
    sp = spec(slack=slack)
    log = bytearray(sp.log_capacity * RECORD_SIZE)
    writes, after = _engine(sp, ops)
    k = int(where * len(writes))
    apply(log, writes[:k])
    torn = writes[k]
    log[torn.offset : torn.offset + cut] = torn.data[:cut]  # died here
    # after[k] is what memory held while write k was under way: the old
    # contents for a retire (written before the positions), the new ones for
    # a seal (written after them).
    index = reread(sp, log)
    _trusted_is_true(index, after[k])
    # The next engine appends after what it read, and its reader agrees.
    got = read_log(log, sp.log_capacity)
    w2 = Writer(index, epoch=2, next_gen=got.next_gen)
    apply(log, w2.seal(1, 0, h(99), 99))
    again = reread(sp, log)
    assert again.sealed[(1, 0)].chain == h(99) and again.sealed[(1, 0)].count == 4
    assert {k2: v for k2, v in chains_of(again).items() if k2 != (1, 0)} == {
        k2: v for k2, v in chains_of(index).items() if k2 != (1, 0)
    }


def test_copy_forward_keeps_an_old_seal_across_many_wraps() -> None:
    sp = spec(slack=0)  # 8 blocks, a ring of 16
    log = bytearray(sp.log_capacity * RECORD_SIZE)
    w = Writer(Index(sp), epoch=1)
    apply(log, w.seal(0, 0, h(7), 7))  # a long-lived prompt block
    for i in range(200):  # slot 1 churns
        apply(log, w.retire(1, 0))
        apply(log, w.seal(1, 0, h(i), i))
    index = reread(sp, log)
    assert index.sealed[(0, 0)].chain == h(7)
    assert index.sealed[(1, 0)].chain == h(199)
    assert struct.unpack_from("<Q", log, 0)[0] % sp.log_capacity == 0


# --- following a live log (read_from) ----------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    ops=ops_strategy,
    slack=st.integers(0, 3),
    seen=st.floats(0, 1),
    now=st.floats(0, 1),
    cut=st.integers(0, RECORD_SIZE),
)
def test_a_follower_reads_what_was_appended_since_or_is_told_to_read_it_whole(
    ops: list[Op], slack: int, seen: float, now: float, cut: int
) -> None:
    """A reader that read up to ``seen`` writes and looks again at ``now``
    (the write under way then cut at any byte) reads exactly the records
    written since, in order, or as many as are whole; and None only where the
    ring has wrapped past what it read, or the write under way is wrapping
    over the last record it read."""
    sp = spec(slack=slack)
    cap = sp.log_capacity
    log = bytearray(cap * RECORD_SIZE)
    writes, _ = _engine(sp, ops)
    j = int(seen * len(writes))
    k = max(j, int(now * len(writes)))
    apply(log, writes[:k])
    if k < len(writes):
        torn = writes[k]
        log[torn.offset : torn.offset + cut] = torn.data[:cut]
    gen = writes[j].record.gen if j < len(writes) else writes[-1].record.gen + 1
    got = kvlog.read_from(log, cap, gen)
    since = [w.record for w in writes[j:k]]
    whole = k < len(writes) and cut >= kvlog.RECORD_BODY_SIZE + 4  # its body and CRC
    want = [*since, writes[k].record] if whole else since
    if k - j > cap:
        assert got is None
        return
    if k - j >= cap - 1 and cut > 0 and k < len(writes):
        # The write under way is over the place of ``gen - 1`` (or ``gen``'s):
        # the ring is wrapping past the reader, which may be told so now.
        assert got is None or list(got) == want[: len(got)]
        return
    assert got is not None
    assert list(got) == want[: len(got)]
    assert len(got) >= len(since)


def test_a_follower_of_a_log_begun_again_is_told_to_read_it_whole() -> None:
    sp = spec(slack=2)
    log = sealed_log(sp, 3)
    assert kvlog.read_from(log, sp.log_capacity, 4) == ()
    log[:] = bytes(len(log))  # an engine that did not adopt it clears it
    again = Writer(Index(sp), epoch=2)
    apply(log, again.seal(1, 0, h(9), 9))
    assert kvlog.read_from(log, sp.log_capacity, 4) is None
    assert [r.gen for r in kvlog.read_from(log, sp.log_capacity, 1) or ()] == [1]
    with pytest.raises(ValueError):
        kvlog.read_from(log, sp.log_capacity, 0)
