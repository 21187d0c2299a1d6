"""The lock protocol's codec: anything either parses or raises the Remote error."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.lockserver.messages import (
    MAX_FRAME,
    Acquire,
    Error,
    Granted,
    RemoteLockProtocolError,
    Status,
    StatusReply,
    client_codec,
    server_codec,
)
from understudy.wire.framing import HEADER

CLIENT_SAMPLES = [
    Acquire(engine_id="engine-primary/3f2a"),
    Acquire(engine_id="x", resume_epoch=7, token="t"),
    Status(),
    Status(token="secret"),
]
SERVER_SAMPLES = [
    Granted(engine_id="a", epoch=3),
    Granted(engine_id="a", epoch=3, resumed=True),
    StatusReply(
        holder=None,
        epoch=0,
        waiters=(),
        window_open=False,
        window_holder=None,
        window_remaining_s=None,
    ),
    Error(code="superseded", message="epoch 1 was superseded"),
]


@pytest.mark.parametrize("msg", CLIENT_SAMPLES)
def test_client_messages_round_trip_byte_by_byte(msg):
    frame = client_codec().encode(msg)
    codec = client_codec()
    out = []
    for i in range(len(frame)):
        out += codec.feed(frame[i : i + 1])
    assert out == [msg] and codec.buffered == 0


@pytest.mark.parametrize("msg", SERVER_SAMPLES)
def test_server_messages_round_trip(msg):
    assert server_codec().feed(server_codec().encode(msg)) == [msg]


def test_several_frames_in_one_read_and_trailing_bytes_kept():
    codec = client_codec()
    data = b"".join(client_codec().encode(m) for m in CLIENT_SAMPLES)
    out = codec.feed(data + data[:5])
    assert out == CLIENT_SAMPLES and codec.buffered == 5


def test_oversized_length_is_refused_before_buffering():
    codec = client_codec()
    with pytest.raises(RemoteLockProtocolError, match="exceeds the maximum"):
        codec.feed(HEADER.pack(4 * 1024**3 - 1))
    with pytest.raises(RemoteLockProtocolError):  # and stays broken
        codec.feed(client_codec().encode(Status()))


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"type":"acquire"}',
        b'{"type":"acquire","engine_id":""}',
        b'{"type":"acquire","engine_id":"a","extra":1}',
        b'{"type":"acquire","engine_id":5}',
        b'{"type":"acquire","engine_id":"a","resume_epoch":"3"}',
        b'{"type":"release","engine_id":"a"}',
        b"[]",
    ],
)
def test_invalid_bodies_raise_remote_error_with_a_reason(body):
    with pytest.raises(RemoteLockProtocolError, match="invalid message"):
        client_codec().feed(HEADER.pack(len(body)) + body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2 * MAX_FRAME))
def test_random_bytes_yield_messages_or_remote_error(data):
    codec = client_codec()
    try:
        for m in codec.feed(data):
            assert isinstance(m, Acquire | Status)
    except RemoteLockProtocolError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(CLIENT_SAMPLES), max_size=6), st.data())
def test_valid_frames_in_random_chunks(msgs, data):
    stream = b"".join(client_codec().encode(m) for m in msgs)
    codec = client_codec()
    out, i = [], 0
    while i < len(stream):
        n = data.draw(st.integers(1, 64))
        out += codec.feed(stream[i : i + n])
        i += n
    assert out == msgs
