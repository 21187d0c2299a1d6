"""What a generative engine offers the OpenAI layer (``openai_api``).

The OpenAI surface (chat and text completions, streaming, usage, the
continuation a migrated stream needs) is written once, over this Protocol;
each generative adapter (the numpy ``llama`` reference decoder, ``vllm``)
implements it. Token ids are the currency: the front relays them with every
streamed chunk, and a continuation hands the next engine the ids already sent.

Determinism contract, which makes a migrated stream identical to an
uninterrupted one:
- greedy decoding (``temperature == 0``) depends only on the token ids;
- seeded sampling draws the token at position ``p`` (0 = first generated
  token) from a generator seeded by ``(seed, p)``, so continuing after ``k``
  generated tokens draws exactly what the uninterrupted run drew;
- ``decode`` is a function of the id list, and so are the streamed text
  deltas (`IncrementalText`), so they come out the same whoever generated
  the earlier ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class NotServing(RuntimeError):
    """The engine is asleep, closed or failed: it takes no requests (the front
    then waits for the engine the lock names)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    # Generation ends after any of these (the engine's own end-of-sequence
    # ids are always included by the generator).
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Step:
    """One generated token, and why generation ended if it ended with it."""

    token_id: int
    finish_reason: str | None = None  # "stop" | "length" | None


def finish_of(resume: Sequence[int], params: SamplingParams, eos_ids: frozenset[int]) -> str | None:
    """Why a generation that already produced ``resume`` is over ("length" or
    "stop"), or None when it goes on. An engine can die after streaming a
    generation's last token and before its end (usage, ``[DONE]``): the next
    engine then owes the client only that end."""
    if len(resume) >= params.max_tokens:
        return "length"
    if resume and resume[-1] in eos_ids | frozenset(params.stop_token_ids):
        return "stop"
    return None


class IncrementalText:
    """The text deltas of a growing list of generated ids, as vLLM's incremental
    detokenizer makes them: a delta never ends inside a multi-byte character.

    Each `push` decodes a short window, ids ``[prefix:]``, and shows what it
    adds to ids ``[prefix:read]`` (already shown). While the window's text
    ends in U+FFFD (an incomplete UTF-8 sequence: a byte-level token can hold
    part of a character) nothing is shown: the next id may complete it. The
    window restarts at ``read`` after every shown delta, so a stream costs
    O(n) decoding, not O(n²); decoding from ``prefix`` rather than ``read``
    keeps the context a SentencePiece decoder needs for its leading space.

    The deltas depend on the ids alone: a stream continued by another engine
    replays the ids already sent (their deltas are discarded) and goes on
    with exactly the deltas the first engine would have sent. Joined, they
    are ``decode(ids)``: the last id (``final``) shows whatever is left, an
    incomplete character included (as the whole answer shows it).
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read")

    def __init__(self, decode: Callable[[Sequence[int]], str], ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        for token in ids:
            self.push(token)

    def push(self, token: int, final: bool = False) -> str:
        """Append ``token``; the text to show now (maybe empty)."""
        self._ids.append(token)
        shown = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not final and (len(text) <= len(shown) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(shown) :]


class Generator(Protocol):
    model_id: str
    max_model_len: int  # prompt + generated tokens
    eos_ids: frozenset[int]  # the model's own end-of-sequence ids

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (with the model's BOS if it uses one)."""
        ...

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of a chat, through the model's chat template, ready to generate."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids (special tokens skipped)."""
        ...

    def expect(self, n: int) -> None:
        """``n`` requests are coming together (``step_thread.StepThread.expect``):
        a hint, said before the first of them is generated."""
        ...

    def generate(
        self, prompt: Sequence[int], params: SamplingParams, resume: Sequence[int] = ()
    ) -> AsyncIterator[Step]:
        """Generate after ``prompt`` + ``resume`` (ids an earlier engine already
        generated for this request), one Step per new token; the last Step has
        a finish_reason. ``params.max_tokens`` counts the resumed ids too.
        Concurrent calls are batched by the engine. Raises ValueError (a request
        it cannot take) or NotServing, before its first Step."""
        ...
