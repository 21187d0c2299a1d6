from __future__ import annotations

import json

import pytest

from understudy.lockserver import statefile
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
