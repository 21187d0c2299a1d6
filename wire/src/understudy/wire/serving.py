"""Where an Active engine serves, and how it says it is alive: the contract
between an engine and the pod's front door.

- **Serving socket.** An engine listens on a Unix socket in the pod's run
  directory, and only while it is Active: ``serve/<engine id>.sock``. The
  front learns the Active engine's id and epoch from the lock, so it can only
  ever connect to the socket of the engine that holds the lock now.
- **Heartbeat.** Every engine rewrites a small record
  (``serve/<engine id>.beat``) from its event loop several times a second:
  its pid, its epoch and the monotonic clock. A record that stops moving
  while the process lives means a hung engine (stopped, deadlocked, stuck in
  a native call); the front kills it so that its death, the pod's only fence,
  hands the lock on. The monotonic clock is the same for every process on a
  node, so the front can compare it with its own.
- **Continuation.** A request the front moves to the next engine carries one
  JSON field, ``FIELD`` (``{request_id, created, resume: {token_ids,
  started}}``), and every event of an engine's stream starts with an SSE
  comment, ``TOKENS_PREFIX`` followed by the token ids it carries, which the
  front keeps (to resume after them) and strips. The front's side is
  ``understudy.front.continuation``, the engines' ``understudy.engine_shim.openai_api``.

Pure: names and formats only. Writing and reading a heartbeat is
``understudy.wire.heartbeat``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

SERVE_DIR = "serve"
FIELD = "understudy"
TOKENS_PREFIX = b": tokens="
# seq, pid, epoch, monotonic ns, seq again: a reader that sees the two
# sequence numbers differ read a record half-written and tries again.
BEAT_RECORD = struct.Struct("<QqqqQ")


def _safe(engine_id: str) -> str:
    # Engine ids are "<container name>/<random suffix>"; a path needs no slash.
    return engine_id.replace("/", ".")


def serving_socket(run_dir: Path, engine_id: str) -> Path:
    return run_dir / SERVE_DIR / f"{_safe(engine_id)}.sock"


def heartbeat_path(run_dir: Path, engine_id: str) -> Path:
    return run_dir / SERVE_DIR / f"{_safe(engine_id)}.beat"


@dataclass(frozen=True, slots=True)
class Beat:
    pid: int
    epoch: int  # 0 until the engine holds the lock
    monotonic: float  # seconds, the writer's time.monotonic()


def pack_beat(seq: int, pid: int, epoch: int, monotonic_ns: int) -> bytes:
    return BEAT_RECORD.pack(seq, pid, epoch, monotonic_ns, seq)


def unpack_beat(raw: bytes) -> Beat | None:
    """The record in ``raw``, or None if it is short or was read half-written."""
    if len(raw) != BEAT_RECORD.size:
        return None
    seq, pid, epoch, ns, seq2 = BEAT_RECORD.unpack(raw)
    return Beat(pid, epoch, ns / 1e9) if seq == seq2 else None
