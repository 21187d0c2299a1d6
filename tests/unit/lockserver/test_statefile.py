"""The lock's state file: two checksummed copies, the newest whole one wins."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from understudy.lockserver import statefile, tally
from understudy.lockserver.fsm import PersistedRecord
from understudy.lockserver.statefile import StateFile, copy_paths


def test_missing_file_is_first_boot(tmp_path):
    r = StateFile(tmp_path / "lock.state").read()
    assert r.record is None and not r.corrupt and not r.damaged


def test_write_then_read_both_copies(tmp_path):
    p = tmp_path / "lock.state"
    f = StateFile(p)
    f.write("a", 3, 1_700_000_000.0)
    a, b = copy_paths(p)
    assert a.read_bytes() == b.read_bytes()
    body, trailer = a.read_bytes().split(b"\ncrc32 ")
    assert trailer == f"{zlib.crc32(body):08x}\n".encode()
    assert json.loads(body) == {
        "seq": 1,
        "holder": "a",
        "epoch": 3,
        "granted_at": "2023-11-14T22:13:20.000+00:00",
    }
    assert StateFile(p).read().record == PersistedRecord("a", 3)
    f.write(None, 3, 0)
    r = StateFile(p).read()
    assert (r.record, r.seq) == (PersistedRecord(None, 3), 2)
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


def _damage(path: Path, how: str) -> None:
    raw = path.read_bytes()
    match how:
        case "garbage":
            path.write_bytes(b"\x00not json{")
        case "flipped digit":  # still JSON, the checksum catches it
            path.write_bytes(raw.replace(b'"epoch": 3', b'"epoch": 7'))
        case "truncated":
            path.write_bytes(raw[: len(raw) // 2])
        case "empty":
            path.write_bytes(b"")
        case "deleted":
            path.unlink()


DAMAGE = ["garbage", "flipped digit", "truncated", "empty", "deleted"]


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("which", [0, 1])
def test_one_damaged_copy_costs_nothing(tmp_path, how, which):
    p = tmp_path / "lock.state"
    f = StateFile(p)
    f.write("old", 2, 1.0)
    f.write(
        "a",
        3,
        2.0,
        tally.granted(tally.Tally(), resumed=False, reissued=False, handover=True, handover_s=0.01),
    )
    _damage(copy_paths(p)[which], how)
    r = StateFile(p).read()
    assert (r.record, r.corrupt, r.seq) == (PersistedRecord("a", 3), False, 2)
    assert r.counters is not None and r.counters.handovers == 1
    assert [path for path, _ in r.damaged] == ([] if how == "deleted" else [copy_paths(p)[which]])


@pytest.mark.parametrize("how", ["garbage", "flipped digit", "truncated", "empty"])
def test_both_copies_damaged_is_corrupt_never_empty(tmp_path, how):
    p = tmp_path / "lock.state"
    StateFile(p).write("a", 3, 1.0)
    for copy in copy_paths(p):
        _damage(copy, how)
    r = StateFile(p).read()
    assert r.corrupt and r.record is None and "lock.state.a" in r.detail


def test_the_newest_whole_copy_wins(tmp_path):
    """A crash between the two writes: one copy holds the newer record."""
    p = tmp_path / "lock.state"
    f = StateFile(p)
    f.write("a", 3, 1.0)
    a, b = copy_paths(p)
    older = b.read_bytes()
    f.write("b", 4, 2.0)
    b.write_bytes(older)
    assert StateFile(p).read().record == PersistedRecord("b", 4)
    a.write_bytes(older)
    b.write_bytes(statefile.encode(9, {"holder": "c", "epoch": 5, "granted_at": None}))
    assert StateFile(p).read().record == PersistedRecord("c", 5)


def test_repair_writes_the_damaged_copy_whole_and_numbers_go_on(tmp_path):
    p = tmp_path / "lock.state"
    StateFile(p).write("a", 3, 1.0)
    a, b = copy_paths(p)
    a.write_bytes(b"garbage")
    f = StateFile(p)
    r = f.read()
    f.repair(r)
    assert a.read_bytes() == b.read_bytes()
    assert StateFile(p).read().damaged == ()
    f.write(None, 3, 2.0)
    assert StateFile(p).read().seq == r.seq + 1


@pytest.mark.parametrize(
    "record",
    [
        {"holder": "a"},
        {"holder": 3, "epoch": 1},
        {"holder": "a", "epoch": -1},
        {"holder": "a", "epoch": True},
        {"holder": "", "epoch": 1},
        {"holder": "a", "epoch": 1, "seq": -1},
    ],
)
def test_a_whole_copy_with_bad_fields_is_damaged(record):
    body = json.dumps({"seq": 1, **record}).encode()
    raw = body + f"\ncrc32 {zlib.crc32(body):08x}\n".encode()
    c = statefile.parse_copy(Path("x"), raw)
    assert c.seq is None and c.damage.startswith("unparsable")


def test_keep_copy_leaves_original(tmp_path):
    p = tmp_path / "lock.state.a"
    p.write_bytes(b"garbage")
    copy = statefile.keep_copy(p, 1000.0)
    assert copy is not None and copy.read_bytes() == b"garbage" and p.exists()


def test_counters_round_trip_with_the_record(tmp_path):
    p = tmp_path / "lock.state"
    t = tally.granted(tally.Tally(), resumed=False, reissued=False, handover=True, handover_s=0.003)
    t = tally.window_closed(t, "expired")
    StateFile(p).write("b", 4, 1_700_000_000.0, t)
    r = StateFile(p).read()
    assert r.record == PersistedRecord("b", 4) and not r.corrupt
    assert r.counters == t and not r.counters_detail


def test_a_record_without_counters_reads_as_none(tmp_path):
    p = tmp_path / "lock.state"
    for copy in copy_paths(p):
        copy.write_bytes(statefile.encode(1, {"holder": "a", "epoch": 7, "granted_at": None}))
    r = StateFile(p).read()
    assert r.record == PersistedRecord("a", 7) and not r.corrupt
    assert r.counters is None and not r.counters_detail


@pytest.mark.parametrize(
    "counters",
    ["x", {"grants": -1}, {"handovers": 1.5}, {"windows_closed": {"expired": "2"}}],
)
def test_bad_counters_cost_the_counts_never_the_holder(tmp_path, counters):
    p = tmp_path / "lock.state"
    raw = statefile.encode(1, {"holder": "a", "epoch": 7, "granted_at": None, "counters": counters})
    for copy in copy_paths(p):
        copy.write_bytes(raw)
    r = StateFile(p).read()
    assert r.record == PersistedRecord("a", 7) and not r.corrupt
    assert r.counters is None and "counters" in r.counters_detail
