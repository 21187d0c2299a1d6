"""The gateway's API keys: Bearer tokens checked against the keys' digests,
from a file re-read when it changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from understudy.front import apikeys
from understudy.front.apikeys import ApiKeyError, ApiKeys


@pytest.mark.parametrize(
    ("headers", "token"),
    [
        ([(b"Authorization", b"Bearer sk-1")], b"sk-1"),
        ([(b"authorization", b"  bearer   sk-1  ")], b"sk-1"),  # scheme any case, space
        ([(b"Authorization", b"Basic c2stMQ==")], None),  # another scheme
        ([(b"Authorization", b"Bearer ")], None),
        ([(b"Content-Type", b"application/json")], None),
        ([], None),
    ],
)
def test_bearer(headers: list[tuple[bytes, bytes]], token: bytes | None) -> None:
    assert apikeys.bearer(headers) == token


def test_a_key_file_one_per_line_with_blank_lines_and_a_trailing_newline(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_bytes(b"sk-1\n\n  sk-2  \n")
    keys = ApiKeys(f)
    for token, ok in [(b"sk-1", True), (b"sk-2", True), (b"sk-3", False), (b"sk-", False)]:
        assert keys.allows([(b"Authorization", b"Bearer " + token)]) is ok
    assert not keys.allows([])


@given(st.binary(min_size=1, max_size=64).filter(lambda b: b.strip() == b and b"\n" not in b))
def test_matches_exactly_the_key(key: bytes) -> None:
    digests = frozenset({apikeys.digest(key)})
    assert apikeys.matches(key, digests)
    assert not apikeys.matches(key + b"x", digests)
    assert not apikeys.matches(key[:-1] or b"x" + key, digests)
    assert not apikeys.matches(None, digests)


def test_the_file_is_re_read_when_it_changes_and_a_bad_rewrite_keeps_the_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    f = tmp_path / "keys"
    f.write_text("old\n")
    keys = ApiKeys(f, clock=lambda: now[0])
    auth = [(b"Authorization", b"Bearer new")]
    f.write_text("new\n")  # a Secret's update: a new file under the same name
    os.utime(f, ns=(1, 1))
    assert not keys.allows(auth)  # not looked at again within RECHECK_S
    now[0] += apikeys.RECHECK_S
    assert keys.allows(auth)
    assert not keys.allows([(b"Authorization", b"Bearer old")])
    f.write_text("")  # emptied: nobody would get in; the last keys stay
    now[0] += apikeys.RECHECK_S
    assert keys.allows(auth)
    f.unlink()
    now[0] += apikeys.RECHECK_S
    assert keys.allows(auth)
    assert "event=api_keys_empty_kept_last" in caplog.text
    assert "event=api_keys_unreadable_kept_last" in caplog.text
    assert "new" not in caplog.text.replace("event=api_keys", "")  # no key in the log


def test_keys_given_on_the_command_line_and_in_a_file_both_count(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("from-file\n")
    keys = ApiKeys(f, ["from-flag"])
    assert keys.allows([(b"Authorization", b"Bearer from-file")])
    assert keys.allows([(b"Authorization", b"Bearer from-flag")])


def test_a_missing_or_empty_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyError, match="cannot read the API key file"):
        ApiKeys(tmp_path / "absent")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ApiKeyError, match="holds no key"):
        ApiKeys(tmp_path / "empty")
