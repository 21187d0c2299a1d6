"""Length-prefixed framing: a 4-byte big-endian length, then the body.

Pure (no I/O): ``encode`` builds a frame, ``FrameDecoder.feed`` turns received
bytes into complete bodies. The decoder enforces a maximum body size as soon as
a header is seen, so a hostile 4 GB length costs four bytes, not four
gigabytes of buffer (h11 caps its buffer the same way).
"""

from __future__ import annotations

import struct

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 64 * 1024


class FrameError(Exception):
    """Base class of framing errors."""


class LocalFrameError(FrameError):
    """We tried to send something that breaks the framing rules (a bug here)."""


class RemoteFrameError(FrameError):
    """The peer sent bytes that break the framing rules."""


def encode(body: bytes, max_size: int = DEFAULT_MAX_FRAME) -> bytes:
    if len(body) > max_size:
        raise LocalFrameError(f"frame body of {len(body)} bytes exceeds the maximum {max_size}")
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Incremental decoder. After a RemoteFrameError it refuses further input."""

    __slots__ = ("_broken", "_buf", "max_size")

    def __init__(self, max_size: int = DEFAULT_MAX_FRAME) -> None:
        self.max_size = max_size
        self._buf = bytearray()
        self._broken: RemoteFrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        if self._broken is not None:
            raise self._broken
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= HEADER_SIZE:
            (length,) = HEADER.unpack_from(self._buf)
            if length > self.max_size:
                self._broken = RemoteFrameError(
                    f"frame length {length} exceeds the maximum {self.max_size}"
                )
                self._buf.clear()
                raise self._broken
            end = HEADER_SIZE + length
            if len(self._buf) < end:
                break
            out.append(bytes(self._buf[HEADER_SIZE:end]))
            del self._buf[:end]
        return out
