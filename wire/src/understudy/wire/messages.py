"""Helpers every protocol's ``messages.py`` uses: JSON bodies of pydantic models.

A protocol module defines its frozen models, a discriminated union on ``type``
and a ``TypeAdapter`` over it; ``MessageCodec`` pairs that adapter with the
frame decoder so that ``feed(bytes) -> list[Message]`` either yields messages or
raises the protocol's ``Remote…`` error, and never anything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import pydantic

from understudy.wire.framing import DEFAULT_MAX_FRAME, FrameDecoder, RemoteFrameError, encode

M = TypeVar("M")

FROZEN = pydantic.ConfigDict(frozen=True, extra="forbid", strict=True)


class MessageCodec(Generic[M]):
    """Frames and parses one protocol's messages."""

    def __init__(
        self,
        adapter: pydantic.TypeAdapter[M],
        remote_error: Callable[[str], Exception],
        max_size: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self._adapter = adapter
        self._remote_error = remote_error
        self._decoder = FrameDecoder(max_size)
        self.max_size = max_size

    @property
    def buffered(self) -> int:
        return self._decoder.buffered

    def feed(self, data: bytes) -> list[M]:
        try:
            bodies = self._decoder.feed(data)
        except RemoteFrameError as exc:
            raise self._remote_error(str(exc)) from exc
        return [self.parse(body) for body in bodies]

    def parse(self, body: bytes) -> M:
        try:
            return self._adapter.validate_json(body)
        except pydantic.ValidationError as exc:
            # One line: which field and why, never the whole offending body.
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "message"
            raise self._remote_error(f"invalid message: {where}: {first['msg']}") from exc

    def encode(self, message: M) -> bytes:
        return encode(self._adapter.dump_json(message), self.max_size)
