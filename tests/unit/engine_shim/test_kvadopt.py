"""Adoption's reading of the seal log (``kvadopt.adopt``) against the reference
(``kvlog.read_log`` then ``Index.replay``), on rings of any records: seals
and retires of blocks in and outside the pool, counts a seal cannot have,
epochs newer than the reader's, records out of their place, torn bytes and
gaps. The logs that a `Writer` makes, torn at any byte, are compared in
test_kvlog.py (its ``reread``)."""

from __future__ import annotations

import mmap
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.engine_shim import kvlog
from understudy.engine_shim.kvadopt import adopt
from understudy.engine_shim.kvlog import RECORD_SIZE, Index, Kind, PoolSpec, Record, read_log
from understudy.engine_shim.kvpool import KvPool

SPEC = PoolSpec(model="m", layers=1, kv_heads=1, head_dim=4, dtype="float32", slots=3, max_len=64)


def reference(raw: bytes, spec: PoolSpec, epoch: int) -> tuple[object, ...]:
    read = read_log(raw, spec.log_capacity)
    index = Index.replay(spec, read.records, epoch)
    return index.sealed, index.ignored, len(read.records), read.next_gen, read.torn, read.dropped


def fast(raw: bytes, spec: PoolSpec, epoch: int) -> tuple[object, ...]:
    got = adopt(raw, spec, epoch)
    return got.index.sealed, got.index.ignored, got.records, got.next_gen, got.torn, got.dropped


records = st.builds(
    Record,
    gen=st.integers(1, 200),
    kind=st.sampled_from([Kind.SEAL, Kind.RETIRE]),
    slot=st.integers(0, SPEC.slots),  # one past the pool too
    block=st.integers(0, SPEC.blocks_per_slot),
    epoch=st.integers(1, 6),
    chain=st.binary(min_size=16, max_size=16),
    checksum=st.integers(0, 2**64 - 1),
    count=st.integers(0, SPEC.block_tokens + 1),
)


@settings(max_examples=400, deadline=None)
@given(
    recs=st.lists(records, max_size=80),
    consecutive=st.booleans(),
    misplace=st.lists(st.integers(0, 10_000), max_size=3),
    tear=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, RECORD_SIZE - 1)), max_size=3),
    epoch=st.integers(1, 6),
)
def test_adoption_reads_any_ring_as_the_reference_does(
    recs: list[Record],
    consecutive: bool,
    misplace: list[int],
    tear: list[tuple[int, int]],
    epoch: int,
) -> None:
    cap = SPEC.log_capacity
    ring = bytearray(cap * RECORD_SIZE)
    for n, drawn in enumerate(recs):
        # A run of generations, or a ring with gaps.
        rec = replace(drawn, gen=n + 1) if consecutive else drawn
        at = rec.gen % cap
        ring[at * RECORD_SIZE : (at + 1) * RECORD_SIZE] = kvlog.encode_record(rec)
    for m in misplace:  # a valid record where its generation does not put it
        at = m % cap
        rec = Record(at + 1, Kind.SEAL, 0, 0, 1, bytes(16), 7, 1)
        ring[at * RECORD_SIZE : (at + 1) * RECORD_SIZE] = kvlog.encode_record(rec)
    for m, byte in tear:
        ring[(m % cap) * RECORD_SIZE + byte] ^= 0x5A
    raw = bytes(ring)
    assert fast(raw, SPEC, epoch) == reference(raw, SPEC, epoch)


def test_an_empty_ring_and_a_short_one() -> None:
    raw = bytes(SPEC.log_capacity * RECORD_SIZE)
    assert fast(raw, SPEC, 1) == reference(raw, SPEC, 1)
    with pytest.raises(ValueError, match="needs"):
        adopt(raw[:-1], SPEC, 1)


def test_a_full_ring_of_a_busy_pod_is_adopted_as_it_was_written() -> None:
    """8 slots of 8,192 positions (vLLM's default here), the ring full after
    hundreds of requests: the next engine's pool holds what the last one
    sealed. (Adopting it took 30 ms record by record; the time is printed,
    not asserted: benchmarks measure.)"""
    spec = PoolSpec(
        model="m", layers=1, kv_heads=1, head_dim=4, dtype="float32", slots=8, max_len=8192
    )
    memory = mmap.mmap(-1, spec.pool_bytes)
    first = KvPool(memoryview(memory), spec, 1)
    for r in range(300):
        slot, tokens = r % 8, [r * 7 + i for i in range(40)]
        claim = first.claim(tokens, [slot], 0, 16)
        for pos in range(claim.start, 40):
            first.seal(slot, tokens, pos, pos + 1)
    assert first.writer.next_gen > spec.log_capacity  # wrapped
    t0 = time.perf_counter()
    nxt = KvPool(memoryview(memory), spec, 2)
    print(f"adopted {nxt.stats.records} records in {time.perf_counter() - t0:.4f} s")
    assert nxt.index.sealed == first.index.sealed
    assert nxt.stats.records == spec.log_capacity and nxt.stats.torn == 0


def test_a_new_engines_first_adoption_imports_nothing() -> None:
    """Adoption runs once per engine process, on a failover's path: a module
    imported on first use there is paid in full (``np.unique`` imported
    numpy.ma, 50 ms, before the engine could go Active)."""
    code = """
import mmap, sys
from understudy.engine_shim import kvlog
from understudy.engine_shim.kvpool import KvPool
spec = kvlog.PoolSpec(model="m", layers=1, kv_heads=1, head_dim=4, dtype="float32",
                      slots=2, max_len=64)
memory = mmap.mmap(-1, spec.pool_bytes)
pool = KvPool(memoryview(memory), spec, 1)
for slot in range(2):
    tokens = list(range(slot, slot + 40))
    pool.claim(tokens, [slot], 0, 16)
    pool.seal(slot, tokens, 0, 40)
pool.claim(list(range(40)), [0], 0, 16)  # a retire
before = set(sys.modules)
nxt = KvPool(memoryview(memory), spec, 2)
assert nxt.index.sealed, "nothing adopted"
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
