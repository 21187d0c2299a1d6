"""How a client's request becomes an engine's, and an engine's answer the client's.

What the front reads of a request (its path, whether it is a completion and
a stream), what an engine is sent on each attempt (the headers it may see,
the epoch it must hold, a stream's continuation), what of the engine's
answer goes back (everything but the hop-by-hop headers; a stream event by
event, its token ids kept), and how a client is told that nothing more can
be done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httptools

from understudy.front import connlog, continuation, downstream, fsm, upstream
from understudy.wire.obs import log_event
from understudy.wire.serving import (
    BEAT_EVENT,
    BEAT_INTERVAL_S,
    COHORT_HEADER,
    FIELD,
    RELAY_HEADER,
    RELAY_TOKENS,
    ContinuationError,
    parse_continuation,
    token_comment,
)

log = logging.getLogger("understudy.front")

EPOCH_HEADER = b"X-Understudy-Epoch"
NOT_ACTIVE_HEADER = b"X-Understudy-Not-Active"
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
# Request headers an engine sees; everything hop-by-hop is the front's own.
_FORWARD = frozenset(
    {b"content-type", b"accept", b"authorization", b"openai-organization", b"user-agent"}
)
_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"server"})
SSE = [(b"Content-Type", b"text/event-stream"), (b"Cache-Control", b"no-cache")]


@dataclass(slots=True)
class Request:
    """One client request across its attempts."""

    method: bytes
    path: str  # decoded: for matching and logs
    target: bytes  # the request-target as the client sent it: what the engine gets
    headers: list[tuple[bytes, bytes]]  # the ones an engine sees, as the client sent them
    body: bytes
    doc: dict[str, Any] | None  # the JSON body of a completion request
    streaming: bool
    arrived: float  # loop time
    request_id: str = ""
    created: int = 0
    migrations: int = 0
    relayed: bool = False
    started: bool = False
    token_ids: list[int] = field(default_factory=list)
    rejection: str = ""  # the answer the next engine gave the stream's continuation
    cohort: int = 0  # the requests its engine's death broke with it (COHORT_HEADER)
    # A gateway's request (``wire.serving.RELAY_HEADER``): its stream keeps
    # the token comments and is heartbeaten while it is open (``beats``).
    relay_tokens: bool = False
    beats: asyncio.Task[None] | None = None


def parse(ex: downstream.Exchange, now: float) -> Request:
    """The request as the front keeps it across its attempts."""
    headers = [(k, v) for k, v in ex.headers if k.lower() in _FORWARD]
    method = ex.method
    path = _path(ex.target)
    doc: dict[str, Any] | None = None
    streaming = False
    if method == b"POST" and path in COMPLETIONS:
        # Not JSON to us (nested too deep included): forwarded as it came.
        with contextlib.suppress(ValueError, RecursionError):
            parsed = json.loads(ex.body)
            if isinstance(parsed, dict):
                doc = parsed
                streaming = parsed.get("stream") is True
    # The engine gets the target as it came (percent-encoding, query and all):
    # the decoded path could hold bytes that are not Latin-1 or even CR LF,
    # which the engine's request line must never see.
    req = Request(method, path, ex.target, headers, ex.body, doc, streaming, now)
    req.relay_tokens = any(
        k.lower() == RELAY_HEADER.lower() and v == RELAY_TOKENS for k, v in ex.headers
    )
    if doc is not None:
        prefix = "chatcmpl" if path.endswith("chat/completions") else "cmpl"
        # 128 random bits, as uuid4's hex (the uuid module imports platform:
        # milliseconds of a restarted front's start).
        req.request_id = f"{prefix}-{os.urandom(16).hex()}"
        req.created = int(time.time())
        if req.relay_tokens:
            _continue_from(req, doc)
    return req


def _continue_from(req: Request, doc: dict[str, Any]) -> None:
    """A gateway's request starts where the gateway says: its ids, and the
    tokens it already relayed (a stream moved here from a pod that died).
    A continuation that breaks the contract is dropped, as a client's is."""
    try:
        c = parse_continuation(doc.get(FIELD))
    except ContinuationError:
        return
    req.request_id = c.request_id or req.request_id
    req.created = c.created if c.created is not None else req.created
    if c.resume is not None:
        req.token_ids = list(c.resume.token_ids)
        req.started = c.resume.started


def _path(target: bytes) -> str:
    """The decoded path of a request-target, for matching and logs only."""
    raw = target.split(b"?", 1)[0]
    if not raw.startswith(b"/"):  # absolute-form (a proxy's), or "*"
        with contextlib.suppress(httptools.HttpParserInvalidURLError):
            raw = httptools.parse_url(target).path or b"/"
    text = raw.decode("latin-1")
    return unquote(text, errors="replace") if "%" in text else text


def headers_for(req: Request, route: fsm.Route) -> list[tuple[bytes, bytes]]:
    """What an engine sees of the client's headers, the epoch it must hold
    to serve (an engine under another epoch refuses), and for a request
    resent after its engine's death, how many that death broke together."""
    out = [*req.headers, (EPOCH_HEADER, b"%d" % route.epoch)]
    if req.cohort:
        out.append((COHORT_HEADER.encode(), b"%d" % req.cohort))
    return out


def not_active(r: upstream.Response) -> bool:
    """The engine refused: not Active, draining, or another epoch."""
    return r.status == 409 and r.header(NOT_ACTIVE_HEADER) is not None


def payload(req: Request) -> bytes:
    """The body an attempt sends: a stream that already relayed tokens asks
    the next engine to continue after them."""
    if req.doc is None:
        return req.body  # not ours to understand: forwarded as it came
    if req.started:
        doc = continuation.resumed(req.doc, req.request_id, req.created, req.token_ids, req.started)
    else:
        doc = continuation.first_attempt(req.doc, req.request_id, req.created)
    return json.dumps(doc, separators=(",", ":")).encode()


def relay(ex: downstream.Exchange, r: upstream.Response, body: bytes) -> None:
    """The engine's answer, to the client as it is (less the hop-by-hop headers)."""
    headers = [(k, v) for k, v in r.headers if k.lower() not in _HOP]
    length = None
    if ex.method == b"HEAD":
        declared = r.header(b"content-length")
        length = int(declared) if declared is not None and declared.isdigit() else 0
    ex.answer(r.status, headers, body, content_length=length)


async def relay_stream(
    req: Request, r: upstream.Response, ex: downstream.Exchange
) -> tuple[fsm.Outcome, None]:
    """Relay an engine's event stream, keeping the token ids it carries (what
    a continuation sends the next engine). A client that goes away cancels
    this (its connection's doing); an engine that does raises
    ``upstream.UpstreamError``, a stream that is not one ``StreamError``."""
    decoder = continuation.EventDecoder()
    async for chunk in r.chunks():
        for ev in decoder.feed(chunk):
            if not ex.answered:
                ex.open_stream(200, SSE, resume_meta(req))
                if req.relay_tokens:
                    start_beats(req, ex)
            if req.relay_tokens:  # the gateway continues after these if we die
                await ex.send(token_comment(ev.token_ids) + b"\n" + ev.raw, ev.token_ids)
            else:
                await ex.send(ev.raw, ev.token_ids)
            req.relayed = True
            req.started = True
            req.token_ids.extend(ev.token_ids)
            if ev.done:
                ex.end_stream()
                return fsm.Outcome.ANSWERED, None
    raise upstream.Broken("the stream ended without [DONE]")


def resume_meta(req: Request) -> dict[str, Any]:
    """What a next front needs to continue this stream on the same client
    connection (``connlog``): its ids, as every engine of it is sent."""
    return {"request_id": req.request_id, "created": req.created}


def resumed_request(ex: downstream.Exchange, stream: connlog.Stream, now: float) -> Request:
    """An adopted stream's request as its first front kept it: the ids it
    had, and the tokens its client already has (relayed, not the request's
    fault: no migration counted)."""
    req = parse(ex, now)
    meta = stream.meta
    if isinstance(meta.get("request_id"), str) and isinstance(meta.get("created"), int):
        req.request_id, req.created = meta["request_id"], meta["created"]
    req.token_ids = list(stream.token_ids)
    req.started = stream.started
    req.relayed = True
    return req


def start_beats(req: Request, ex: downstream.Exchange) -> None:
    req.beats = asyncio.create_task(_beat(ex), name="stream-beat")


async def _beat(ex: downstream.Exchange) -> None:
    """Heartbeat a gateway's open stream until it ends, across this front's
    own failovers too (a stream waiting for the next engine is not a dead
    pod), so that only a pod that is gone or frozen falls silent."""
    with contextlib.suppress(downstream.ClientGone):
        while not ex.ended:
            await asyncio.sleep(BEAT_INTERVAL_S)
            await ex.send(BEAT_EVENT)


def answer_error(
    req: Request,
    ex: downstream.Exchange,
    status: int,
    message: str,
    retry_after: int | None = 1,
) -> None:
    """The client is told why nothing more can be done for its request: an
    error answer (``Retry-After``: it may ask again), or, in a stream that
    already went out, a last error event."""
    log_event(log, "gave_up", logging.ERROR, path=req.path, status=status, reason=message)
    if ex.answered:
        # All that is left is to end the stream with an error event the
        # client can see, as OpenAI's streams do. The send does not wait: the
        # stream ends here either way.
        kind = "invalid_request_error" if status < 500 else "server_error"
        err = {"error": {"message": message, "type": kind, "code": status}}
        with contextlib.suppress(downstream.ClientGone):
            ex.end_stream(b"data: " + json.dumps(err).encode() + b"\n\n")
        return
    ex.error(status, message, retry_after=retry_after)
