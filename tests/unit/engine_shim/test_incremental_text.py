"""Streamed text deltas (generation.IncrementalText) with the real byte-level
tokenizers of both built-in models: a delta never splits a multi-byte
character, the deltas join to the whole answer, and they depend on the ids
alone (a continued stream sends what the uninterrupted one would have)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.engine_shim.adapters.llama_text import ChatTokenizer
from understudy.engine_shim.generation import IncrementalText

TEXTS = [
    "The capital of France is Paris.",
    "Grüße aus Köln: crème brûlée, naïve résumé.",
    "東京と大阪。你好，世界。안녕하세요.",
    "Emoji: 😀🎉👩‍👩‍👧 and flags 🇫🇷 🇯🇵",
    "Привет, мир! Γειά σου. مرحبا",
    "math: ∀x ∈ ℝ, x² ≥ 0 — ≠ ≤ ∞",
]


@pytest.fixture(scope="module", params=["smollm2", "tiny-llama"])
def tok(request: pytest.FixtureRequest) -> ChatTokenizer:
    return ChatTokenizer(request.getfixturevalue(f"{request.param.replace('-', '_')}_dir"))


def stream(tok: ChatTokenizer, ids: list[int], resume: int = 0) -> list[str]:
    text = IncrementalText(tok.decode, ids[:resume])
    return [text.push(t, final=i == len(ids) - 1) for i, t in enumerate(ids) if i >= resume]


def byte_ids(tok: ChatTokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (every byte-level vocabulary has the 256), so
    each multi-byte character is split across tokens."""
    ids = [tok.tokenizer.token_to_id(_byte_char(b)) for b in text.encode()]
    assert None not in ids
    return ids


def _byte_char(b: int) -> str:
    """GPT-2's spelling of byte ``b`` in a byte-level vocabulary (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_and_join_to_the_answer(tok: ChatTokenizer, text: str) -> None:
    for ids in (tok.encode(text), byte_ids(tok, text)):
        assert tok.decode(ids) == text
        deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas), deltas


def test_split_characters_are_held_back_until_complete(tok: ChatTokenizer) -> None:
    ids = byte_ids(tok, "a😀b")  # a, 4 bytes of the emoji, b
    assert len(ids) == 6
    assert stream(tok, ids) == ["a", "", "", "", "😀", "b"]


def test_an_incomplete_character_at_the_end_is_flushed_as_the_answer_shows_it(
    tok: ChatTokenizer,
) -> None:
    ids = byte_ids(tok, "ok😀")[:-1]  # the answer ended inside the emoji
    assert tok.decode(ids).endswith("\ufffd")
    assert "".join(stream(tok, ids)) == tok.decode(ids)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_ids_stream_to_their_decoding_and_resume_anywhere(
    tok: ChatTokenizer, data: st.DataObject
) -> None:
    """Random ids (a random-weight model emits invalid UTF-8 too): the deltas
    still join to decode(ids), and a stream resumed after k ids goes on with
    exactly the uninterrupted stream's deltas."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=40))
    k = data.draw(st.integers(0, len(ids) - 1))
    whole = stream(tok, ids)
    assert "".join(whole) == tok.decode(ids)
    assert stream(tok, ids, resume=k) == whole[k:]


def test_special_tokens_show_nothing(smollm2_dir: Path) -> None:
    tok = ChatTokenizer(smollm2_dir)
    ids = [*tok.encode("Paris"), 2]  # <|im_end|> is skipped in the text
    assert stream(tok, ids) == ["Paris", ""]
