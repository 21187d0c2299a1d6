"""What the daemons speak: length-prefix framing (``framing``), message codecs
(``messages``), the one shape of every state machine (``machine``), the
engine/front contract and its heartbeat (``serving``, ``heartbeat``),
Unix-socket helpers with peer credentials and fd passing (``uds``),
observability plumbing (``obs``) and the collector's start-up freeze
(``heap``). Only the framing codec is re-exported here; the rest is imported
from its module."""

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
