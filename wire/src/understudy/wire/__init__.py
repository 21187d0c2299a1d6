"""What the daemons speak: length-prefix framing, message codecs, Unix-socket
helpers (peer credentials, fd passing) and observability plumbing."""

from understudy.wire.framing import (
    DEFAULT_MAX_FRAME,
    FrameDecoder,
    FrameError,
    LocalFrameError,
    RemoteFrameError,
    encode,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "FrameDecoder",
    "FrameError",
    "LocalFrameError",
    "RemoteFrameError",
    "encode",
]
