"""The continuation contract between the front and the engines
(``wire.serving``): whatever the builders write, the parsers read back as it
was, and whatever breaks the contract is a ``ContinuationError`` that says what."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from understudy.wire.serving import (
    FIELD,
    Continuation,
    ContinuationError,
    Resume,
    continuation_payload,
    parse_continuation,
    parse_token_comment,
    token_comment,
)

token_ids = st.lists(st.integers(0, 1 << 40), max_size=64).map(tuple)
continuations = st.builds(
    Continuation,
    request_id=st.none() | st.text(min_size=1, max_size=40),
    created=st.none() | st.integers(0, 1 << 40),
    resume=st.none() | st.builds(Resume, token_ids=token_ids, started=st.booleans()),
)


@given(continuations)
def test_a_payload_reads_back_as_it_was_built_through_json(c: Continuation) -> None:
    # JSON is the way it travels: the round trip goes through it
    sent = json.loads(json.dumps({FIELD: continuation_payload(c)}))
    assert parse_continuation(sent[FIELD]) == c


@given(token_ids)
def test_a_token_comment_reads_back_as_it_was_built(ids: tuple[int, ...]) -> None:
    assert parse_token_comment(token_comment(ids)) == ids


def test_a_request_without_the_field_is_a_first_attempt_with_no_ids() -> None:
    assert parse_continuation(None) == Continuation()
    assert parse_continuation({}) == Continuation()


def test_other_lines_are_not_token_comments() -> None:
    assert parse_token_comment(b"data: [DONE]") is None
    assert parse_token_comment(b": keep-alive") is None
    assert parse_token_comment(b": tokens=") == ()


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ([], "'understudy' must be an object"),
        ({"request": "x"}, "unknown keys ['request']"),
        ({"request_id": ""}, "request_id' must be a non-empty string"),
        ({"request_id": 7}, "request_id' must be a non-empty string"),
        ({"created": "now"}, "created' must be a non-negative integer"),
        ({"created": True}, "created' must be a non-negative integer"),
        ({"resume": [1, 2]}, "'understudy.resume' must be an object"),
        ({"resume": {"token_ids": [1]}}, "started' must be a boolean"),
        ({"resume": {"token_ids": [1], "started": 1}}, "started' must be a boolean"),
        ({"resume": {"token_ids": [1, -2], "started": True}}, "token_ids' must be a list"),
        ({"resume": {"token_ids": [True], "started": True}}, "token_ids' must be a list"),
        ({"resume": {"token_ids": "1,2", "started": True}}, "token_ids' must be a list"),
        ({"resume": {"token_ids": [], "started": True, "more": 1}}, "unknown keys ['more']"),
    ],
)
def test_a_malformed_payload_is_an_error_that_names_the_key(payload: Any, says: str) -> None:
    with pytest.raises(ContinuationError) as err:
        parse_continuation(payload)
    assert says in str(err.value)


@pytest.mark.parametrize("line", [b": tokens=1,x", b": tokens=1,,2", b": tokens=-1", b": tokens=,"])
def test_a_malformed_token_comment_is_an_error(line: bytes) -> None:
    with pytest.raises(ContinuationError, match="bad token ids"):
        parse_token_comment(line)
