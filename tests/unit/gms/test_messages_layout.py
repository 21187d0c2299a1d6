"""GMS codec fuzz (only messages or the Remote error) and the layout hash."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.gms import messages as m
from understudy.gms.layout import (
    AllocationRecord,
    MetadataRecord,
    align_up,
    canonical_json,
    layout_hash,
    put_metadata,
)

VALID: list[m.Request] = [
    m.Hello(mode=m.Mode.RW_OR_RO, timeout_s=1.5, client="x"),
    m.Allocate(size=123, tag="weights"),
    m.Export(id=7),
    m.ExportMany(ids=(1, 2, 3)),
    m.ListAllocations(),
    m.PutMetadata(key="layer.0.w", value={"dtype": "f16", "shape": [2, 3], "offset": 0}),
    m.GetMetadata(key="k"),
    m.ListMetadata(),
    m.Commit(),
    m.GetLayoutHash(),
    m.GetState(),
]


def frame(msg: m.Request) -> bytes:
    body = m.REQUEST_ADAPTER.dump_json(msg)
    return struct.pack(">I", len(body)) + body


@given(st.binary(max_size=512))
@settings(max_examples=300)
def test_random_bytes_yield_messages_or_the_remote_error(data: bytes) -> None:
    codec = m.request_codec()
    try:
        out = codec.feed(data)
    except m.RemoteGmsError:
        return
    for msg in out:
        assert isinstance(msg, tuple(type(v) for v in VALID))


@given(st.lists(st.sampled_from(VALID), min_size=1, max_size=6), st.binary(max_size=64))
@settings(max_examples=100)
def test_valid_frames_fed_byte_by_byte(msgs: list[m.Request], tail: bytes) -> None:
    codec = m.request_codec()
    got: list[m.Request] = []
    stream = b"".join(frame(x) for x in msgs) + tail
    try:
        for i in range(len(stream)):
            got.extend(codec.feed(stream[i : i + 1]))
    except m.RemoteGmsError:
        assert len(got) == len(msgs)  # only the random tail may be bad
        return
    assert got[: len(msgs)] == msgs


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff\xff",  # a 4 GB length prefix
        struct.pack(">I", m.MAX_REQUEST_FRAME + 1),
        struct.pack(">I", 2) + b"{}",
        struct.pack(">I", 4) + b"null",
        frame(m.GetState()).replace(b"get_state", b"get_stat3"),
        struct.pack(">I", 30) + b'{"type":"allocate","size":-1}' + b" ",
        struct.pack(">I", 42) + b'{"type":"get_state","extra":1}' + b" " * 12,
    ],
)
def test_bad_frames_raise_the_remote_error(data: bytes) -> None:
    with pytest.raises(m.RemoteGmsError):
        m.request_codec().feed(data)


def test_replies_round_trip() -> None:
    codec = m.reply_codec()
    rep = m.StateReport(
        state=m.LockState.RO,
        committed=True,
        sessions={m.Granted.RW: 0, m.Granted.RO: 2},
        waiting=0,
        waiting_writers=0,
        allocations=1,
        bytes=4096,
        layout_hash="ab",
        device=0,
        tag="weights",
        backend="host",
    )
    assert codec.feed(codec.encode(rep)) == [rep]


def recs(*spec: tuple[int, int, str]) -> list[AllocationRecord]:
    return [AllocationRecord(i, size, size, tag) for i, size, tag in spec]


def test_layout_hash_covers_order_sizes_tags_metadata_not_ids() -> None:
    meta = (MetadataRecord("w", canonical_json({"offset": 0})),)
    base = layout_hash(recs((0, 4096, "weights"), (1, 8192, "weights")), meta)
    assert base == layout_hash(recs((10, 4096, "weights"), (11, 8192, "weights")), meta)
    assert base != layout_hash(recs((0, 8192, "weights"), (1, 4096, "weights")), meta)
    assert base != layout_hash(recs((0, 4096, "weights"), (1, 8192, "other")), meta)
    assert base != layout_hash(recs((0, 4096, "weights"), (1, 4096, "weights")), meta)
    other_meta = (MetadataRecord("w", canonical_json({"offset": 1})),)
    assert base != layout_hash(recs((0, 4096, "weights"), (1, 8192, "weights")), other_meta)
    # metadata order does not matter, values are canonical
    two = put_metadata(put_metadata((), "a", {"x": 1, "y": 2}), "b", {})
    two_rev = put_metadata(put_metadata((), "b", {}), "a", {"y": 2, "x": 1})
    assert layout_hash([], two) == layout_hash([], two_rev)


def test_put_metadata_replaces_in_place() -> None:
    md = put_metadata(put_metadata((), "a", {"x": 1}), "b", {})
    md = put_metadata(md, "a", {"x": 2})
    assert [r.key for r in md] == ["a", "b"] and md[0].value_json == '{"x":2}'


def test_align_up() -> None:
    assert align_up(1, 4096) == 4096 and align_up(4096, 4096) == 4096
    assert align_up(4097, 2 << 20) == 2 << 20
    with pytest.raises(ValueError):
        align_up(1, 3000)
