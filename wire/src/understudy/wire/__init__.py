"""What the daemons speak: length-prefix framing (``framing``), message codecs
(``messages``), the one shape of every state machine (``machine``), the
engine/front contract and its heartbeat (``serving``, ``heartbeat``), the
lock's persisted record (``lockrecord``), Unix-socket helpers with peer
credentials and fd passing (``uds``), the serving socket's handover
(``handover``), observability plumbing (``obs``), the collector's start-up
freeze (``heap``), failpoints (``failpoints``) and the child's side of the
respawner (``respawn``; the respawner is ``understudy.respawner``). Only the
framing codec is re-exported here; the rest is imported from its module."""

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
