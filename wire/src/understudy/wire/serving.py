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
  started}}``: :class:`Continuation`), and every event of an engine's stream
  starts with an SSE comment, ``TOKENS_PREFIX`` followed by the token ids it
  carries, which the front keeps (to resume after them) and strips. Both are
  built and parsed here and nowhere else (:func:`continuation_payload` and
  :func:`parse_continuation`, :func:`token_comment` and
  :func:`parse_token_comment`), so the front
  (``understudy.front.continuation``) and the engines
  (``understudy.engine_shim.openai_api``) cannot spell a key differently.
- **Relay to a gateway.** A request that carries ``RELAY_HEADER`` comes from
  a fleet gateway, which continues the stream on another pod if this one
  dies: the pod's front takes the request's own ``FIELD`` as where to start
  (the gateway's ids and the tokens it already relayed), keeps each event's
  token comment in what it relays, and writes ``BEAT_EVENT`` on the open
  stream every ``BEAT_INTERVAL_S`` that nothing else went out, so that a
  frozen pod's silence is measurable. An OpenAI client ignores comments.

Pure: names and formats only. Writing and reading a heartbeat is
``understudy.wire.heartbeat``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVE_DIR = "serve"
FIELD = "understudy"
TOKENS_PREFIX = b": tokens="
RELAY_HEADER = b"X-Understudy-Relay"
# On a request the front resends after its engine died: how many requests
# that death broke, all of them resent together, so that the next engine can
# start them in one step as soon as that many have come (a hint: it also
# starts when they stop coming).
COHORT_HEADER = "X-Understudy-Cohort"
RELAY_TOKENS = b"tokens"
BEAT_COMMENT = b": beat"
BEAT_EVENT = BEAT_COMMENT + b"\n\n"
# A gateway judges a stream silent past a few of these (its --silence).
BEAT_INTERVAL_S = 0.25
# The names of a pod front's two ports, in its container and in the pods'
# headless Service: a gateway on Kubernetes finds each pod's serving port and
# status port (/ready) by these names in the Service's EndpointSlices.
SERVING_PORT_NAME = "http"
STATUS_PORT_NAME = "front-status"
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


# ------------------------------------------------------------ continuation --


class ContinuationError(ValueError):
    """A continuation payload or a token comment that breaks the contract."""


@dataclass(frozen=True, slots=True)
class Resume:
    token_ids: tuple[int, ...]  # the tokens already relayed to the client
    started: bool  # whether the stream's opening event went out


@dataclass(frozen=True, slots=True)
class Continuation:
    """``FIELD``'s value. Every part is optional: a client that talks to an
    engine directly sends none, and the engine makes up its own ids."""

    request_id: str | None = None  # the answer's ``id``, the same on every attempt
    created: int | None = None  # the answer's ``created``, likewise
    resume: Resume | None = None  # None: the first attempt


def continuation_payload(c: Continuation) -> dict[str, Any]:
    """The JSON value of ``FIELD`` for ``c``."""
    out: dict[str, Any] = {}
    if c.request_id is not None:
        out["request_id"] = c.request_id
    if c.created is not None:
        out["created"] = c.created
    if c.resume is not None:
        out["resume"] = {"token_ids": list(c.resume.token_ids), "started": c.resume.started}
    return out


def _is_id(v: object) -> bool:
    # bool is an int to Python and never a token id or a timestamp
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _keys(doc: object, where: str, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ContinuationError(f"'{where}' must be an object")
    unknown = sorted(str(k) for k in doc.keys() - allowed)
    if unknown:
        raise ContinuationError(f"'{where}' has unknown keys {unknown}")
    return doc


def _resume(doc: object) -> Resume:
    where = f"{FIELD}.resume"
    doc = _keys(doc, where, frozenset({"token_ids", "started"}))
    ids, started = doc.get("token_ids"), doc.get("started")
    if not isinstance(ids, list) or not all(_is_id(t) for t in ids):
        raise ContinuationError(f"'{where}.token_ids' must be a list of token ids")
    if not isinstance(started, bool):
        raise ContinuationError(f"'{where}.started' must be a boolean")
    return Resume(tuple(ids), started)


def parse_continuation(payload: object) -> Continuation:
    """``FIELD``'s value (None where the request has none) as a
    :class:`Continuation`; :class:`ContinuationError` says what is wrong."""
    if payload is None:
        return Continuation()
    doc = _keys(payload, FIELD, frozenset({"request_id", "created", "resume"}))
    request_id, created = doc.get("request_id"), doc.get("created")
    if request_id is not None and not (isinstance(request_id, str) and request_id):
        raise ContinuationError(f"'{FIELD}.request_id' must be a non-empty string")
    if created is not None and not _is_id(created):
        raise ContinuationError(f"'{FIELD}.created' must be a non-negative integer")
    resume = _resume(doc["resume"]) if doc.get("resume") is not None else None
    return Continuation(request_id, created, resume)


def token_comment(token_ids: Sequence[int]) -> bytes:
    """The comment line (without its newline) that opens an event carrying
    ``token_ids``; an event that carries none has one too, with no ids."""
    return TOKENS_PREFIX + ",".join(map(str, token_ids)).encode()


def parse_token_comment(line: bytes) -> tuple[int, ...] | None:
    """The token ids of a comment line, or None if ``line`` is not one."""
    if not line.startswith(TOKENS_PREFIX):
        return None
    text = line[len(TOKENS_PREFIX) :].strip()
    if not text:
        return ()
    parts = text.split(b",")
    if not all(p.isdigit() for p in parts):
        raise ContinuationError(f"bad token ids {text[:80]!r}")
    return tuple(int(p) for p in parts)
