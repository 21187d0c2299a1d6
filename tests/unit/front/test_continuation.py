"""The stream format between engines and the front, fed byte by byte."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from understudy.front.continuation import (
    EventDecoder,
    StreamError,
    first_attempt,
    resumed,
)

STREAM = (
    b': tokens=\ndata: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
    b': tokens=17\ndata: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    b': tokens=5,9\ndata: {"choices":[{"delta":{"content":" there"}}]}\n\n'
    b"data: [DONE]\n\n"
)


def _all(chunks: list[bytes]) -> list:
    d = EventDecoder()
    return [ev for c in chunks for ev in d.feed(c)]


def test_comment_lines_carry_ids_and_never_reach_the_client() -> None:
    evs = _all([STREAM])
    assert [e.token_ids for e in evs] == [(), (17,), (5, 9), ()]
    assert [e.done for e in evs] == [False, False, False, True]
    relayed = b"".join(e.raw for e in evs)
    assert b"tokens=" not in relayed
    assert (
        relayed
        == b"".join(
            line + b"\n" for line in STREAM.split(b"\n") if not line.startswith(b": tokens=")
        ).replace(b"\n\n\n", b"\n\n")[: len(relayed)]
    )


@given(st.lists(st.integers(1, 7), min_size=1))
def test_any_split_gives_the_same_events(sizes: list[int]) -> None:
    chunks, i = [], 0
    while i < len(STREAM):
        n = sizes[len(chunks) % len(sizes)]
        chunks.append(STREAM[i : i + n])
        i += n
    assert _all(chunks) == _all([STREAM])


def test_bad_ids_and_endless_events_are_errors() -> None:
    with pytest.raises(StreamError):
        EventDecoder().feed(b": tokens=1,x\ndata: {}\n\n")
    with pytest.raises(StreamError):
        EventDecoder().feed(b"data: " + b"x" * (2 << 20))


def test_continuation_body_keeps_the_ids_and_says_what_went_out() -> None:
    body = {"model": "m", "messages": [], "stream": True}
    assert first_attempt(body, "chatcmpl-1", 7)["understudy"] == {
        "request_id": "chatcmpl-1",
        "created": 7,
    }
    again = resumed(body, "chatcmpl-1", 7, [17, 5, 9], started=True)
    assert again["understudy"]["resume"] == {"token_ids": [17, 5, 9], "started": True}
    assert {k: v for k, v in again.items() if k != "understudy"} == body
