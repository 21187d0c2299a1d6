from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from understudy.wire.framing import FrameDecoder, LocalFrameError, RemoteFrameError, encode


@given(st.lists(st.binary(max_size=300), max_size=10), st.integers(1, 50))
def test_frames_survive_any_chunking(bodies, chunk):
    stream = b"".join(encode(b, 1024) for b in bodies)
    dec = FrameDecoder(1024)
    out = []
    for i in range(0, len(stream), chunk):
        out += dec.feed(stream[i : i + chunk])
    assert out == bodies and dec.buffered == 0


def test_encode_refuses_oversized_body():
    with pytest.raises(LocalFrameError):
        encode(b"x" * 11, 10)


def test_exact_max_is_fine_one_more_is_not():
    assert FrameDecoder(10).feed(encode(b"x" * 10, 10)) == [b"x" * 10]
    with pytest.raises(RemoteFrameError):
        FrameDecoder(10).feed(b"\x00\x00\x00\x0b")
