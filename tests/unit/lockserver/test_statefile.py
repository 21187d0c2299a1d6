from __future__ import annotations

import json

import pytest

from understudy.lockserver import statefile, tally
from understudy.lockserver.fsm import PersistedRecord


def test_missing_file_is_first_boot(tmp_path):
    r = statefile.read(tmp_path / "lock.state")
    assert r.record is None and not r.corrupt


def test_write_then_read(tmp_path):
    p = tmp_path / "lock.state"
    statefile.write(p, "a", 3, 1_700_000_000.0)
    data = json.loads(p.read_text())
    assert data == {"holder": "a", "epoch": 3, "granted_at": "2023-11-14T22:13:20.000+00:00"}
    assert statefile.read(p).record == PersistedRecord("a", 3)
    statefile.write(p, None, 3, 0)
    assert statefile.read(p).record == PersistedRecord(None, 3)
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"null",
        b"[]",
        b'{"holder": "a"}',
        b'{"holder": 3, "epoch": 1}',
        b'{"holder": "a", "epoch": -1}',
        b'{"holder": "a", "epoch": true}',
        b'{"holder": "", "epoch": 1}',
        b"\xff\xfe",
    ],
)
def test_garbage_is_corrupt_never_empty(tmp_path, raw):
    p = tmp_path / "lock.state"
    p.write_bytes(raw)
    r = statefile.read(p)
    assert r.corrupt and r.record is None and r.detail


def test_keep_copy_leaves_original(tmp_path):
    p = tmp_path / "lock.state"
    p.write_bytes(b"garbage")
    copy = statefile.keep_copy(p, 1000.0)
    assert copy is not None and copy.read_bytes() == b"garbage" and p.exists()


def test_counters_round_trip_with_the_record(tmp_path):
    p = tmp_path / "lock.state"
    t = tally.granted(tally.Tally(), resumed=False, reissued=False, handover=True, handover_s=0.003)
    t = tally.window_closed(t, "expired")
    statefile.write(p, "b", 4, 1_700_000_000.0, t)
    r = statefile.read(p)
    assert r.record == PersistedRecord("b", 4) and not r.corrupt
    assert r.counters == t and not r.counters_detail


def test_a_file_from_before_counters_reads_as_none(tmp_path):
    p = tmp_path / "lock.state"
    p.write_text('{"holder": "a", "epoch": 7, "granted_at": null}')
    r = statefile.read(p)
    assert r.record == PersistedRecord("a", 7) and not r.corrupt
    assert r.counters is None and not r.counters_detail


@pytest.mark.parametrize(
    "counters",
    ['"x"', '{"grants": -1}', '{"handovers": 1.5}', '{"windows_closed": {"expired": "2"}}'],
)
def test_bad_counters_cost_the_counts_never_the_holder(tmp_path, counters):
    p = tmp_path / "lock.state"
    p.write_text('{"holder": "a", "epoch": 7, "granted_at": null, "counters": ' + counters + "}")
    r = statefile.read(p)
    assert r.record == PersistedRecord("a", 7) and not r.corrupt
    assert r.counters is None and "counters" in r.counters_detail
