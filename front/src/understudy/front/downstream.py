"""The front door's HTTP/1.1 server: client connections, parsed by llhttp (httptools).

The front sits on every request's path, so its own cost is latency every
client pays. aiohttp's server (request objects, multidicts, URL parsing,
routing, response machinery) cost the front more CPU per request than the
engine behind it needs to answer a health check. This server does only what a
relay needs, at the asyncio Protocol level:

- a request's head and whole body in (``Exchange``), handed to the handler,
  a plain function: it answers at once, later from a callback, or from a
  task of its own (``Exchange.task``), so a request needs no task or future
  unless it has to wait for something;
- one answer out, whole (``Exchange.answer``) or as a chunked stream
  (``open_stream``, ``send``, ``end_stream``) with write back-pressure; the
  exchange is over when its answer is;
- keep-alive, pipelining (answered in order, one at a time), HTTP/1.0;
- ``Expect: 100-continue``; an ``Upgrade`` is ignored, as RFC 9110 allows;
- limits, each refused with its own status and an OpenAI-style error, then
  the connection closed: a malformed request (400), a request-target over
  ``max_target`` (414), a head over ``max_head`` (431), a body over
  ``max_body`` (413, before reading it when ``Content-Length`` says so), an
  unknown expectation (417), a ``CONNECT`` (405), no whole request within
  ``idle_s`` of the connection becoming idle (408, or a plain close when
  nothing had arrived);
- a client that closes its connection (a reset, or just its end: HTTP/1.1
  clients do not half-close while they wait for an answer, and uvicorn and
  aiohttp take it the same way) is gone: its request's task, if it has one,
  is cancelled, so a request held for an engine stops waiting and a stream
  stops being generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import httptools

from understudy.front import connlog, kept
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.front")

Headers = list[tuple[bytes, bytes]]
Handler = Callable[["Exchange"], None]

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
# Stop reading from a client that pipelined this many requests ahead of the
# one being answered; read again as they are answered.
_PIPELINE_MAX = 16
# Connections accepted per wake-up before the loop runs anything else.
_ACCEPT_BATCH = 64


@dataclass(frozen=True, slots=True)
class Limits:
    max_body: int = 16 * 1024 * 1024  # a generous bound on prompts
    max_target: int = 8 * 1024
    max_head: int = 64 * 1024  # request line and headers together
    # A kept-alive connection with no request for this long is closed; a
    # request must arrive whole within it too (a client trickling bytes
    # cannot hold a connection forever).
    idle_s: float = 75.0


def error_body(status: int, message: str) -> bytes:
    """An error the way OpenAI's API shapes them."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    doc = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return json.dumps(doc).encode()


JSON = (b"Content-Type", b"application/json; charset=utf-8")


class ClientGone(ConnectionError):
    """The client's connection is closed: its answer has nowhere to go."""


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing: the request is refused."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_date_second = -1
_date_value = b""
# RFC 9110's IMF-fixdate, in English whatever the locale (email.utils would
# cost a restarted front milliseconds to import, before it accepts).
_DAYS = (b"Mon", b"Tue", b"Wed", b"Thu", b"Fri", b"Sat", b"Sun")
_MONTHS = (b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun",
           b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec")  # fmt: skip


def _date() -> bytes:
    """The Date header's value, formatted once a second."""
    global _date_second, _date_value
    now = int(time.time())
    if now != _date_second:
        t = time.gmtime(now)
        _date_second, _date_value = now, b"%s, %02d %s %04d %02d:%02d:%02d GMT" % (
            _DAYS[t.tm_wday], t.tm_mday, _MONTHS[t.tm_mon - 1], t.tm_year,
            t.tm_hour, t.tm_min, t.tm_sec,
        )  # fmt: skip
    return _date_value


class Exchange:
    """One request from a client, and the answer it gets."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_ended",
        "body",
        "headers",
        "keep_alive",
        "method",
        "status",
        "target",
        "task",
        "version",
    )  # fmt: skip

    def __init__(
        self,
        conn: ClientConnection,
        method: bytes,
        target: bytes,
        headers: Headers,
        body: bytes,
        version: str,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.target = target  # as the client sent it: percent-encoding, query and all
        self.headers = headers
        self.body = body
        self.version = version
        self.keep_alive = keep_alive
        self.status = 0  # the answer's status, once its head went out
        # The task answering this request, if it needed one: cancelled when
        # the client goes away.
        self.task: asyncio.Task[None] | None = None
        self._conn = conn
        self._chunked = False
        self._ended = False

    @property
    def answered(self) -> bool:
        """The answer's head went out: from now on only the stream can go on."""
        return self.status != 0

    @property
    def ended(self) -> bool:
        """The whole answer went out (or nothing more can)."""
        return self._ended

    def _head(self, status: int, headers: Headers, framing: bytes) -> bytes:
        self.status = status
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        lines += [name + b": " + value + b"\r\n" for name, value in headers]
        if not any(name.lower() == b"date" for name, _ in headers):
            lines.append(b"Date: " + _date() + b"\r\n")
        if not self.keep_alive:
            lines.append(b"Connection: close\r\n")
        elif self.version == "1.0":  # kept alive only when said so
            lines.append(b"Connection: keep-alive\r\n")
        lines.append(framing)
        return b"".join(lines)

    def answer(
        self,
        status: int,
        headers: Headers,
        body: bytes,
        content_length: int | None = None,
        kind: bytes = connlog.F,
    ) -> None:
        """The whole answer. ``content_length`` stands for the body a HEAD's answer
        does not carry (the engine's own ``Content-Length``)."""
        if self.answered:
            raise RuntimeError("answered twice")
        length = len(body) if content_length is None else content_length
        head = self._head(status, headers, b"Content-Length: %d\r\n\r\n" % length)
        self._ended = True
        try:
            self._conn.write(head if self.method == b"HEAD" else head + body, kind)
        finally:
            self._conn.exchange_done(self)

    def refuse(self, status: int, message: str) -> None:
        """A refusal's answer, after which the connection closes (``X``)."""
        self.answer(status, [JSON], error_body(status, message), kind=connlog.X)

    def error(self, status: int, message: str, retry_after: int | None = None) -> None:
        headers = [JSON]
        if retry_after is not None:
            headers.append((b"Retry-After", b"%d" % retry_after))
        self.answer(status, headers, error_body(status, message))

    def open_stream(
        self, status: int, headers: Headers, resume: dict[str, Any] | None = None
    ) -> None:
        """Begin an answer whose body follows in parts (``send``, ``end_stream``).
        ``resume``: what a next front needs to continue it (``connlog``)."""
        if self.answered:
            raise RuntimeError("answered twice")
        meta = resume or {}
        if self.method == b"HEAD":
            self._conn.write_head(self._head(status, headers, b"\r\n"), meta)
            self.end_stream()
        elif self.version == "1.1":
            self._chunked = True
            head = self._head(status, headers, b"Transfer-Encoding: chunked\r\n\r\n")
            self._conn.write_head(head, meta)
        else:  # HTTP/1.0 has no chunks: the body ends with the connection
            self.keep_alive = False
            self._conn.write_head(self._head(status, headers, b"\r\n"), meta)

    def resumed(self, status: int) -> None:
        """This answer's head went out from a front that died: its stream goes
        on here (``ClientConnection.adopt``), framed as the head said."""
        self.status = status
        if self.version == "1.1":
            self._chunked = True
        else:
            self.keep_alive = False

    async def send(self, data: bytes, token_ids: Sequence[int] | None = None) -> None:
        """One part of a streamed answer; waits while the client reads slower.
        ``token_ids``: the tokens it carries (an event: ``connlog``)."""
        if self._ended or not data:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        await self._conn.write_and_drain(data, token_ids)

    def end_stream(self, last: bytes = b"") -> None:
        """End a streamed answer, with ``last`` as its final part (not waited for)."""
        if self._ended:
            return
        self._ended = True
        try:
            if self._chunked:
                end = b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else b"0\r\n\r\n"
                self._conn.write(end, connlog.F)
            else:
                self._conn.write(last, connlog.F)
        finally:
            self._conn.exchange_done(self)

    def abort(self) -> None:
        """End an answer that cannot be finished (a stream cut short by a bug):
        closing the connection is the only way left to tell the client."""
        self.keep_alive = False
        self._ended = True
        with contextlib.suppress(ClientGone):
            self._conn.write(b"", connlog.F)
        self._conn.exchange_done(self)

    def fail(self, exc: Exception) -> None:
        """The front failed answering (a bug): the client still learns it, by
        a 500, or, once the answer began, by the connection's close."""
        if self._ended:
            return
        with contextlib.suppress(ClientGone):
            if self.answered:
                self.abort()
            else:
                self.error(500, f"the front failed: {type(exc).__name__}")


class ClientConnection(asyncio.Protocol):
    """One client's connection: parse requests, answer them one at a time, in order."""

    def __init__(self, handler: Handler, limits: Limits, server: Server) -> None:
        self._handler = handler
        self._limits = limits
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._queue: deque[Exchange] = deque()
        self._active: Exchange | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused_reading = False
        self._paused_writing = False
        self._drained: asyncio.Future[None] | None = None
        self._closed = False
        self._refusal: _Refused | None = None
        self._partial = False  # part of a request has arrived
        # A client waits for an answer on this connection: from its accept (its
        # first request is on its way) until an answer leaves it idle, and
        # from the first byte of the next request. Counted by the server: a
        # front that dies loses exactly its busy connections' requests. Idle
        # (kept alive, answered) connections are counted apart: one may hold a
        # next request the front has not read yet.
        self._busy = False
        self._idle = False
        self._expect_continue = False
        self._upgrade = False
        # What a next front needs to finish this connection, written down as
        # it goes (None: not kept, as on a status port or a gateway).
        self.log: connlog.ConnLog | None = None
        # Adopted from a front that died: its record's bytes are parsed
        # again (``adopt``), its ended exchanges skipped, its stream resumed.
        self._replaying = False
        self._skip = 0
        self._resume: connlog.Stream | None = None
        # The request being parsed.
        self._target: list[bytes] = []
        self._headers: Headers = []
        self._head_size = 0
        self._body: list[bytes] = []
        self._body_size = 0

    # ---------------------------------------------------------- transport --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses).
        self._transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)
        self._set_busy(True)
        self._arm_timer()

    def claim(self) -> None:
        """Busy from now: it was just accepted or adopted, and its server
        counted it then (``Server.count_busy``), before it made this object."""
        self._busy = True

    def _set_busy(self, busy: bool) -> None:
        idle = not busy and not self._closed
        if busy is not self._busy or idle is not self._idle:
            d_busy, d_idle = int(busy) - int(self._busy), int(idle) - int(self._idle)
            self._busy, self._idle = busy, idle
            self._server.count_busy(d_busy, d_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._set_busy(False)
        self._server.connections.discard(self)
        if self.log is not None:
            self._server.on_closed(self.log)
            self.log = None
        self._cancel_timer()
        self._queue.clear()
        if self._active is not None and self._active.task is not None:
            self._active.task.cancel()  # nobody is left to answer
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def write_down(self, data: bytes) -> None:
        """Bytes read, written down before the kernel lets go of them
        (``kept``) and before they are parsed: a next front parses them again."""
        if self.log is None:
            return
        try:
            self.log.received(data)
        except OSError as exc:  # a full volume: served from now on, but not kept
            log_event(log, "connlog_failed", logging.ERROR, id=self.log.cid, error=str(exc))
            self._server.on_closed(self.log)
            self.log = None

    def eof_received(self) -> bool:
        return False  # the client is gone: close (connection_lost follows)

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def write(self, data: bytes, kind: bytes = connlog.W) -> None:
        """Write to the client, written down first (``log``): ``kind`` says
        what the bytes are to a next front (an answer's last: F)."""
        self._check_open()
        if self.log is not None:
            self.log.wrote(data, kind)
        self._send(data)

    def write_head(self, head: bytes, resume: dict[str, Any]) -> None:
        """A streamed answer's head, written down with what continues it."""
        self._check_open()
        if self.log is not None:
            self.log.opened(resume, head)
        self._send(head)

    def _check_open(self) -> None:
        if self._closed or self._transport is None or self._transport.is_closing():
            raise ClientGone("the client closed its connection")

    def _send(self, data: bytes) -> None:
        assert self._transport is not None
        if not data:
            return
        try:
            self._transport.write(data)
        except (OSError, RuntimeError) as exc:  # uvloop: closed before we were told
            raise ClientGone(f"the client's connection failed: {exc}") from None

    async def write_and_drain(self, data: bytes, token_ids: Sequence[int] | None = None) -> None:
        if token_ids is None:
            self.write(data)
        else:
            self._check_open()
            if self.log is not None:
                self.log.event(token_ids, data)
            self._send(data)
        if self._paused_writing:
            self._drained = self._loop.create_future()
            await self._drained
            if self._closed:
                raise ClientGone("the client closed its connection")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def socket(self) -> socket.socket | None:
        if self._transport is None or self._closed:
            return None
        sock: socket.socket | None = self._transport.get_extra_info("socket")
        return sock

    def close(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.close()  # what was written still goes out
        # Nothing more is read, served or written from now on (requests
        # pipelined behind a "Connection: close" answer included).
        self._closed = True
        self._queue.clear()

    # ------------------------------------------------------------- timers --

    def _arm_timer(self) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(self._limits.idle_s, self._idle_expired)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_expired(self) -> None:
        self._timer = None
        if self._active is not None or self._queue:
            return
        if self._partial:
            self._refuse(_Refused(408, f"the request did not arrive within {self._limits.idle_s}s"))
        else:
            self.close()

    # -------------------------------------------------------------- input --

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None or self._closed:
            return  # refused or closing: the rest of what it sends is not read
        try:
            while True:
                try:
                    self._parser.feed_data(data)
                    return
                except httptools.HttpParserUpgrade as exc:
                    # The request asked to switch protocols; it is answered
                    # in HTTP/1.1 instead, and what follows is HTTP/1.1 again.
                    data = data[int(exc.args[0]) :]
                    if not data:
                        return
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                self._refuse(cause)
            else:
                log_event(log, "request_parse_bug", logging.ERROR, error=repr(cause))
                self._refuse(_Refused(500, "the front failed to read the request"))
        except httptools.HttpParserError as exc:
            if self.closed:  # (a callback of this very feed may have closed it)
                return  # bytes after a "Connection: close" request: not a request at all
            self._refuse(_Refused(400, f"malformed HTTP request: {exc}"))

    def on_message_begin(self) -> None:
        self._partial = True
        self._set_busy(True)
        self._target = []
        self._headers = []
        self._head_size = 0
        self._body = []
        self._body_size = 0
        self._expect_continue = False
        self._upgrade = False

    def on_url(self, url: bytes) -> None:
        self._target.append(url)
        self._head_size += len(url)
        if self._head_size > self._limits.max_target:
            raise _Refused(414, f"request-target longer than {self._limits.max_target} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self._limits.max_head:
            raise _Refused(431, f"request head larger than {self._limits.max_head} bytes")

    def on_headers_complete(self) -> None:
        p = self._parser
        length = 0
        expect: bytes | None = None
        for name, value in self._headers:
            low = name.lower()
            if low == b"content-length":
                length = int(value)  # llhttp has checked it is a number
            elif low == b"expect":
                expect = value.strip().lower()
        if p.get_method() == b"CONNECT":
            raise _Refused(405, "CONNECT is not served here")
        if p.should_upgrade():
            self._upgrade = True
            chunked = any(n.lower() == b"transfer-encoding" for n, _ in self._headers)
            if length or chunked:
                # llhttp hands a body after an Upgrade over as the new
                # protocol's bytes: it cannot be read as this request's body.
                raise _Refused(400, "an Upgrade request with a body is not served; send it without")
        if length > self._limits.max_body:
            raise _Refused(413, f"request body larger than {self._limits.max_body} bytes")
        if expect is not None:
            if expect != b"100-continue" or p.get_http_version() != "1.1":
                raise _Refused(417, f"expectation not supported: {expect.decode('latin-1')}")
            self._expect_continue = True
            self._send_continue()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._body_size += len(body)
        if self._body_size > self._limits.max_body:
            raise _Refused(413, f"request body larger than {self._limits.max_body} bytes")

    def on_message_complete(self) -> None:
        p = self._parser
        self._partial = False
        if self._closed:
            return
        self._expect_continue = False
        if self._skip:  # answered whole by the front that died
            self._skip -= 1
            if not p.should_keep_alive() or self._upgrade:
                self.close()  # as that front was about to: nothing more is read
            return
        ex = Exchange(
            self,
            p.get_method(),
            b"".join(self._target),
            self._headers,
            b"".join(self._body),
            p.get_http_version(),
            p.should_keep_alive() and not self._upgrade,
        )
        if self._resume is not None:  # its stream went out in part: it goes on
            stream, self._resume = self._resume, None
            ex.resumed(200)
            self._active = ex
            self._server.resume(ex, stream)
            return
        self._queue.append(ex)
        if self._active is None:
            self._next()
        elif len(self._queue) >= _PIPELINE_MAX and self._transport is not None:
            self._transport.pause_reading()
            self._paused_reading = True

    def _send_continue(self) -> None:
        # Only between answers: a 100 in the middle of another answer would
        # corrupt it. A client that waits for it waits until then. Never
        # again for a request parsed a second time: its record has the first.
        if self._replaying:
            self._expect_continue = False
            return
        if self._expect_continue and self._active is None and not self._queue:
            self._expect_continue = False
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    # ----------------------------------------------------------- requests --

    def _next(self) -> None:
        """Answer the next request in line, or wait for one."""
        if self._closed or self._active is not None:
            return
        if self._queue:
            self._cancel_timer()
            ex = self._queue.popleft()
            if self._paused_reading and self._transport is not None:
                self._paused_reading = False
                self._transport.resume_reading()
            self._active = ex
            try:
                self._handler(ex)
            except Exception as exc:  # a bug: the client still gets an answer
                log.exception("handler failed")
                ex.fail(exc)
            return
        if self._refusal is not None:
            self._answer_refusal(self._refusal)
        else:
            if not self._partial:
                self._set_busy(False)  # answered; idle until the next request begins
                self._compact()
            self._arm_timer()
            self._send_continue()

    def _compact(self) -> None:
        """Idle: cut the record once the kernel has every byte of it."""
        record, t = self.log, self._transport
        if record is None or record.idle or t is None or t.get_write_buffer_size():
            return
        try:
            record.compact()
        except OSError as exc:  # the record grows until the next try
            log_event(log, "connlog_compact_failed", logging.WARNING, error=str(exc))

    def exchange_done(self, ex: Exchange) -> None:
        """``ex``'s answer is out: the connection is free for the next request."""
        if ex is not self._active:
            return
        self._active = None
        if self._closed:
            return
        if not ex.keep_alive:
            self._queue.clear()
            self.close()
        elif self._queue:
            # Not from inside the answer's own call stack (it may be an
            # upstream parser's callback).
            self._loop.call_soon(self._next)
        else:
            self._next()

    def _refuse(self, refusal: _Refused) -> None:
        """Stop reading; answer the refusal once the requests before it are answered."""
        self._refusal = refusal
        if self._active is None and not self._queue:
            self._answer_refusal(refusal)

    def _answer_refusal(self, refusal: _Refused) -> None:
        self._cancel_timer()
        log_event(log, "request_refused", status=refusal.status, reason=refusal.message)
        self._server.on_refused(refusal.status)
        if self._closed:
            return
        ex = Exchange(self, b"", b"", [], b"", "1.1", keep_alive=False)
        with contextlib.suppress(ClientGone):
            ex.refuse(refusal.status, refusal.message)
        self.close()

    # ----------------------------------------------------------- adoption --

    def adopt(self, plan: connlog.Plan) -> None:
        """Finish what a front that died left on this connection (its record's
        ``plan``): the bytes the kernel never took, then its requests parsed
        again, the ended ones skipped and a stream under way resumed."""
        t = cast(kept.KeptTransport, self._transport)
        try:
            t.discard(plan.skip)  # written down, but still the kernel's: read here once
        except OSError as exc:
            log_event(log, "adopt_connection_failed", logging.ERROR, error=str(exc))
            t.abort()
            return
        if plan.tail:
            self._send(plan.tail)
        if plan.refused:
            self.close()
            return
        self._skip, self._resume = plan.done, plan.stream
        self._replaying = True
        try:
            if plan.rx:
                self.data_received(plan.rx)
        finally:
            self._replaying = False
        if not self._paused_reading:
            t.resume_reading()  # what the client sent since, after what it sent before
        if self._active is None and not self._queue:
            self._next()


class Server:
    """A listening socket and its client connections."""

    def __init__(
        self,
        handler: Handler,
        limits: Limits,
        on_refused: Callable[[int], None] = lambda status: None,
        on_busy: Callable[[int, int], None] | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.on_refused = on_refused
        self.connections: set[ClientConnection] = set()
        self._servers: list[asyncio.Server] = []
        self._listening: list[socket.socket] = []  # sockets accepted on by _accept
        self._connecting: set[asyncio.Task[None]] = set()
        self.busy = 0  # connections whose client waits for an answer
        self.idle = 0  # connections kept alive between requests
        self._on_busy = on_busy
        # Connections that outlive this server's process (the pod's front:
        # ``connhold``, ``connlog``): ``keep`` is told of each connection at
        # its accept and returns its record (None: not kept); ``on_closed``
        # of each record when its connection is gone; ``resume`` is given an
        # adopted stream to go on with.
        self.keep: Callable[[socket.socket], connlog.ConnLog | None] | None = None
        self.on_closed: Callable[[connlog.ConnLog], None] = lambda record: record.remove()
        self.resume: Callable[[Exchange, connlog.Stream], None] = lambda ex, _: ex.abort()

    def count_busy(self, delta: int, idle_delta: int = 0) -> None:
        self.busy += delta
        self.idle += idle_delta
        if self._on_busy is not None:
            self._on_busy(self.busy, self.idle)

    async def listen(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: ClientConnection(self.handler, self.limits, self),
            host,
            port,
            reuse_address=True,
            backlog=1024,
        )
        self._servers.append(server)
        bound: int = server.sockets[0].getsockname()[1]
        return bound

    def serve_on(self, sock: socket.socket, backlog: int) -> None:
        """Accept on a listening socket made elsewhere (handed over), with a
        listen ``backlog`` (the socket's, shared with every holder).

        Our own accept loop rather than the loop's server: a connection
        counts as busy the moment ``accept`` returns it, before anything else
        runs (the loop's servers announce a connection one turn later), so a
        front that dies in between has counted every connection it took."""
        sock.listen(backlog)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._accept, sock)
        self._listening.append(sock)

    def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the rest wait in the queue
                log_event(log, "accept_failed", logging.ERROR, error=str(exc))
                return
            # Counted (a store into the ledger's page), then kept (``keep``
            # gives the keeper its copy): the time from the accept to the
            # copy is the one window in which this process's death loses the
            # connection, so nothing else comes before it, and a death in it
            # is counted lost.
            self.count_busy(1)
            record = self.keep(conn) if self.keep is not None else None
            proto = ClientConnection(self.handler, self.limits, self)
            proto.claim()
            proto.log = record
            if record is not None:
                self._connect_kept(loop, proto, conn).resume_reading()
                continue
            task = loop.create_task(self._connect(loop, proto, conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, proto: ClientConnection, conn: socket.socket
    ) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.connect_accepted_socket(lambda: proto, conn)
        except (OSError, RuntimeError) as exc:  # the client left already
            log_event(log, "connection_failed", logging.DEBUG, error=str(exc))
            conn.close()
            proto.connection_lost(exc if isinstance(exc, OSError) else None)

    def _connect_kept(
        self, loop: asyncio.AbstractEventLoop, proto: ClientConnection, conn: socket.socket
    ) -> kept.KeptTransport:
        """A kept connection's transport (``kept``), not reading yet: made
        here, at once, so that the connection is in ``live`` from its accept."""
        with contextlib.suppress(OSError):  # the client left already: its first read says so
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport = kept.KeptTransport(loop, conn, proto, proto.write_down)
        proto.connection_made(transport)
        return transport

    def adopt(self, conn: socket.socket, record: connlog.ConnLog, plan: connlog.Plan) -> None:
        """A connection a front that died had accepted: finish its ``plan``."""
        self.count_busy(1)
        proto = ClientConnection(self.handler, self.limits, self)
        proto.claim()
        proto.log = record
        self._connect_kept(asyncio.get_running_loop(), proto, conn)
        proto.adopt(plan)

    def live(self) -> list[tuple[str, int]]:
        """The kept connections open now: (their record's id, their descriptor)."""
        out = []
        for proto in self.connections:
            sock = proto.socket
            if proto.log is not None and sock is not None:
                out.append((proto.log.cid, sock.fileno()))
        return out

    def stop_accepting(self) -> None:
        """Leave new connections to the listening socket's other holders (they
        wait in its queue for the next front); the ones accepted go on."""
        for server in self._servers:
            server.close()
        loop = asyncio.get_running_loop()
        for sock in self._listening:
            loop.remove_reader(sock.fileno())
            sock.close()  # our copy: the keeper's stays open
        self._listening.clear()

    def close(self) -> None:
        """Stop accepting, and close every connection (in-flight work is cancelled)."""
        self.stop_accepting()
        for conn in list(self.connections):
            conn.close()


async def until_stopped() -> None:
    """Return at SIGTERM or SIGINT (the pod's front and the gateway drain their
    clients then)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
