"""What the daemons speak: length-prefix framing (``framing``), message codecs
(``messages``), the one shape of every state machine (``machine``), the
engine/front contract and its heartbeat (``serving``, ``heartbeat``),
Unix-socket helpers with peer credentials and fd passing (``uds``),
observability plumbing (``obs``), the collector's start-up freeze
(``heap``), named fault-injection points (``failpoints``) and a container's
small init that restarts its process in place (``respawn``, its policy in
``restart``). Only the framing codec is re-exported here; the rest is
imported from its module."""

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
