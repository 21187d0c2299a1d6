"""The lock record's shared format, as a reader in another process sees it."""

from __future__ import annotations

from pathlib import Path

from understudy.lockserver.statefile import StateFile
from understudy.wire import lockrecord


def test_a_reader_sees_what_the_lock_server_wrote(tmp_path: Path) -> None:
    state = tmp_path / "lock.state"
    writer = StateFile(state)
    writer.write("engine-a", 7, 1000.0)
    writer.write("engine-b", 8, 1001.0)
    record, why = lockrecord.read_newest(state)
    assert why == ""
    assert record is not None and (record.holder, record.epoch) == ("engine-b", 8)


def test_the_newest_whole_copy_wins(tmp_path: Path) -> None:
    state = tmp_path / "lock.state"
    a, b = lockrecord.copy_paths(state)
    a.write_bytes(lockrecord.encode(4, {"holder": "x", "epoch": 3}))
    b.write_bytes(lockrecord.encode(5, {"holder": None, "epoch": 3}))
    record, _ = lockrecord.read_newest(state)
    assert record == lockrecord.Record(5, None, 3)
    # the newer copy damaged: the older whole one is the record
    b.write_bytes(b.read_bytes().replace(b"null", b"nul "))
    record, _ = lockrecord.read_newest(state)
    assert record == lockrecord.Record(4, "x", 3)


def test_no_record_says_why(tmp_path: Path) -> None:
    state = tmp_path / "lock.state"
    assert lockrecord.read_newest(state) == (None, f"no lock record at {state}")
    a, b = lockrecord.copy_paths(state)
    a.write_bytes(b'{"seq": 1, "holder": "x", "epoch": 2}')
    b.write_bytes(lockrecord.encode(1, {"holder": "x", "epoch": 2})[:-3] + b"00\n")
    record, why = lockrecord.read_newest(state)
    assert record is None
    assert why == "lock.state.a: no checksum; lock.state.b: checksum mismatch"


def test_parse_refuses_bad_fields() -> None:
    assert lockrecord.parse(lockrecord.encode(1, {"holder": "", "epoch": 2})).startswith(
        "unparsable: holder"
    )
    assert lockrecord.parse(lockrecord.encode(1, {"holder": "a", "epoch": -1})).startswith(
        "unparsable: epoch"
    )
    assert lockrecord.parse(lockrecord.encode(1, {"holder": "a"})).startswith("unparsable")
