"""What a standby's view maps from the records it follows (kvreader: the
extents of the index those records alone replay to): how far each slot's
seals reach, and nothing for a record no Writer would write."""

from __future__ import annotations

from understudy.engine_shim import kvlog
from understudy.engine_shim.kvlog import Kind, Record
from understudy.engine_shim.kvpool import sealed_extents

SPEC = kvlog.PoolSpec("m", layers=1, kv_heads=1, head_dim=4, dtype="float32", slots=2, max_len=64)


def _reach(records: list[Record], spec: kvlog.PoolSpec) -> dict[int, int]:
    return sealed_extents(kvlog.Index.replay(spec, records))


def seal(slot: int, block: int, count: int) -> Record:
    return Record(1, Kind.SEAL, slot, block, 1, kvlog.ROOT, 0, count)


def test_each_slot_reaches_its_furthest_seal() -> None:
    records = [seal(0, 0, 16), seal(0, 2, 5), seal(0, 1, 16), seal(1, 0, 3)]
    assert _reach(records, SPEC) == {0: 2 * 16 + 5, 1: 3}


def test_retires_and_records_outside_the_pool_reach_nowhere() -> None:
    records = [
        Record(2, Kind.RETIRE, 0, 0, 1),
        seal(2, 0, 16),  # no slot 2
        seal(0, 4, 16),  # a slot of 64 positions has 4 blocks
        seal(1, 0, 0),
        seal(1, 0, 17),
    ]
    assert _reach(records, SPEC) == {}
