"""What a migrated request sends to the next engine, and how streamed events
carry the token ids that make that possible (pure).

The engine API's extension (the contract, its builders and its parsers are
``understudy.wire.serving``; the engines' side is
``understudy.engine_shim.openai_api``), one JSON field ``understudy`` in a
completion request:

- ``request_id`` and ``created``: set by the front on the first attempt and
  kept on every later one, so an answer or a stream from the next engine
  carries the same ``id`` and ``created`` as the first engine's would;
- ``resume``: ``{"token_ids": [...], "started": bool}``, the ids of the tokens
  already relayed to the client and whether the stream's opening event went
  out. The next engine generates after them and emits only what follows.

A streamed event from an engine is ``: tokens=<ids>`` (an SSE comment: the
ids this event carries, possibly none) followed by its ``data:`` line. The
front keeps the ids and forwards the rest of the event byte for byte, so a
client's stream with a migration in it is identical to one without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from understudy.wire.serving import (
    BEAT_EVENT,
    FIELD,
    Continuation,
    ContinuationError,
    Resume,
    continuation_payload,
    parse_token_comment,
)

MAX_EVENT = 1 << 20  # an engine event larger than this is a protocol error


class StreamError(ValueError):
    """The engine's stream broke the event format."""


@dataclass(frozen=True, slots=True)
class Event:
    raw: bytes  # what the client gets: the event without our comment line
    token_ids: tuple[int, ...]
    done: bool  # ``data: [DONE]``


@dataclass
class EventDecoder:
    """Incremental SSE splitter: bytes in, complete events out."""

    _buf: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[Event]:
        self._buf += data
        out: list[Event] = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                if len(self._buf) > MAX_EVENT:
                    raise StreamError(f"an event longer than {MAX_EVENT} bytes")
                return out
            block = bytes(self._buf[: end + 2])
            del self._buf[: end + 2]
            if block != BEAT_EVENT:  # a pod front's heartbeat is the gateway's alone
                out.append(_event(block))

    @property
    def pending(self) -> int:
        return len(self._buf)


def _event(block: bytes) -> Event:
    ids: tuple[int, ...] = ()
    kept: list[bytes] = []
    for line in block[:-2].split(b"\n"):
        try:
            carried = parse_token_comment(line)
        except ContinuationError as exc:
            raise StreamError(str(exc)) from None
        if carried is None:
            kept.append(line)
        else:
            ids = carried
    raw = b"\n".join(kept) + b"\n\n"
    return Event(raw, ids, done=kept == [b"data: [DONE]"])


def first_attempt(body: dict[str, Any], request_id: str, created: int) -> dict[str, Any]:
    """The request as the first engine gets it: ours, with the ids fixed."""
    return {**body, FIELD: continuation_payload(Continuation(request_id, created))}


def resumed(
    body: dict[str, Any], request_id: str, created: int, token_ids: Sequence[int], started: bool
) -> dict[str, Any]:
    """The request as the next engine gets it after ``token_ids`` were relayed."""
    resume = Resume(tuple(token_ids), started)
    return {**body, FIELD: continuation_payload(Continuation(request_id, created, resume))}
