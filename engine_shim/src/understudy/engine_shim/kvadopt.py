"""The seal log read and replayed at adoption, a whole ring at a time (pure).

``kvlog.read_log`` then ``Index.replay`` say what a log means, a record at a
time; they are the reference. A failover's next engine reads the whole ring
on its way to Active, and a busy pod's ring is full: 8,256 records for 8
slots of 8,192 positions, which took 21 ms to read and 8 ms to replay here
(a Python object per record), against what one decode step costs. This
reads the same ring as numpy arrays: every record's CRC is still checked
(one call per record that holds any byte), the run of consecutive
generations and what survives of it are found with array operations, and
`Sealed` objects are made only for the blocks that survive. The index and
counts are those of the reference (`tests/unit/engine_shim/test_kvadopt.py`
compares them on random logs, torn, gapped and misplaced ones too).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from understudy.engine_shim.kvlog import (
    RECORD_BODY_SIZE,
    RECORD_DTYPE,
    RECORD_SIZE,
    Index,
    Kind,
    PoolSpec,
    Sealed,
)

__all__ = ["Adopted", "adopt"]


@dataclass(frozen=True, slots=True)
class Adopted:
    """A log as the next engine takes it: what ``read_log`` and
    ``Index.replay`` give, without the records themselves."""

    index: Index
    records: int  # in the run read
    next_gen: int
    torn: int
    dropped: int


def adopt(raw: bytes | memoryview, spec: PoolSpec, epoch: int) -> Adopted:
    """The index of ``raw`` (the ring: ``spec.log_capacity`` records), as
    ``Index.replay(spec, read_log(raw, capacity).records, epoch)``."""
    cap = spec.log_capacity
    if len(raw) < cap * RECORD_SIZE:
        raise ValueError(f"a log of {cap} records needs {cap * RECORD_SIZE} bytes")
    data = bytes(raw[: cap * RECORD_SIZE])
    rows = np.frombuffer(data, dtype=np.uint8).reshape(cap, RECORD_SIZE)
    recs = rows.view(RECORD_DTYPE)[:, 0]
    used = np.flatnonzero(rows.any(axis=1))
    crc_ok = np.zeros(cap, dtype=bool)
    crc_ok[used] = [
        zlib.crc32(data[i * RECORD_SIZE : i * RECORD_SIZE + RECORD_BODY_SIZE])
        == int(recs["crc"][i])
        for i in used
    ]
    kinds = recs["kind"]
    gens = recs["gen"]
    valid = crc_ok & (gens != 0) & ((kinds == Kind.SEAL) | (kinds == Kind.RETIRE))
    torn = int(used.size - np.count_nonzero(valid))
    placed = valid & (gens % np.uint64(cap) == np.arange(cap, dtype=np.uint64))
    misplaced = int(np.count_nonzero(valid) - np.count_nonzero(placed))
    at = np.flatnonzero(placed)
    if not at.size:
        return Adopted(Index(spec), 0, 1, torn, misplaced)
    order = at[np.argsort(gens[at], kind="stable")]
    g = gens[order]
    breaks = np.flatnonzero(np.diff(g) != 1)
    run = order[breaks[-1] + 1 :] if breaks.size else order  # gen order, ending at the newest
    index = _replay(spec, recs[run], epoch)
    return Adopted(index, int(run.size), int(g[-1]) + 1, torn, misplaced + at.size - run.size)


def _replay(spec: PoolSpec, recs: npt.NDArray[np.void], epoch: int) -> Index:
    """``Index.replay`` of ``recs`` (a run, in generation order)."""
    index = Index(spec)
    newer = recs["epoch"] > np.uint64(epoch)
    kind, slot, block, count = recs["kind"], recs["slot"], recs["block"], recs["count"]
    inside = (slot < spec.slots) & (block < spec.blocks_per_slot)
    seal = kind == Kind.SEAL
    counted = ~seal | ((count > 0) & (count <= spec.block_tokens))
    live = ~newer & inside & counted
    index.ignored = int(np.count_nonzero(~live))
    at = np.arange(recs.size)
    seals, retires = at[live & seal], at[live & ~seal]
    # The last seal of each block (the first of each key in the reversed run,
    # by a stable sort; not ``np.unique``, whose first call imports numpy.ma:
    # 50 ms, on a failover's path, in every new engine) ...
    latest_first = seals[::-1]
    key = (slot.astype(np.int64) * spec.blocks_per_slot + block)[latest_first]
    order = np.argsort(key, kind="stable")
    head = np.ones(order.size, dtype=bool)
    head[1:] = key[order][1:] != key[order][:-1]
    survivors = latest_first[order[head]]
    # ... unless a later retire of its slot, from its block or one before, removed it.
    gone = np.zeros(survivors.size, dtype=bool)
    for slot_no in sorted(set(slot[retires].tolist())):
        mine = retires[slot[retires] == slot_no]
        mine = mine[np.argsort(block[mine], kind="stable")]
        latest = np.maximum.accumulate(mine)  # the latest retire at each block or before
        here = slot[survivors] == slot_no
        j = np.searchsorted(block[mine], block[survivors[here]], side="right")
        gone[here] = (j > 0) & (latest[np.maximum(j - 1, 0)] > survivors[here])
    # Each field as one list, not a numpy scalar per field and record: 251
    # survivors' seals took 5 ms that way in a fresh process's first
    # adoption (a waking engine's), 0.3 this way.
    kept = recs[survivors[~gone]]
    chains = kept["chain"].tobytes()
    size = kept.dtype["chain"].itemsize
    cols = (kept[f].tolist() for f in ("slot", "block", "gen", "epoch", "checksum", "count"))
    for i, (s, b, gen, ep, checksum, count) in enumerate(zip(*cols, strict=True)):
        chain = chains[i * size : (i + 1) * size]
        index.sealed[(s, b)] = Sealed(gen, ep, chain, checksum, count)
    return index
