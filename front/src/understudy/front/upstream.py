"""A small HTTP/1.1 client for one engine's Unix socket, with kept-alive connections.

The front forwards every request over one of these, so it is on every
request's path. It works at the asyncio Protocol level and parses answers
with llhttp (httptools). Two ways in:

- ``request`` (a coroutine): connect if no kept-alive connection is idle,
  send, and wait for the answer's head (``send`` alone: the request is out,
  its answer to come);
- ``send_idle`` (a plain call): send on an idle connection, if there is one,
  and be called back (``Response.on_complete``) when the whole answer is in
  or the attempt failed; no task or future. A caller that finds the answer
  is not one it can relay can still ``await head()`` on it, as if it had
  come from ``request``. It speaks only
what an engine's server speaks (``Content-Length``, chunked, or until close)
and nothing else (no cookies, no redirects, no timers per request).

A kept-alive connection can be taken just as its engine exits. A request that
fails on a reused connection before any byte of an answer came back is
reported as ``Stale``: the caller tries once more on a new connection, which
either reaches the engine (the old connection had died idle) or finds none
(the engine is gone, perhaps with the request in it).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools

Headers = list[tuple[bytes, bytes]]

_IDLE_MAX = 64  # kept-alive connections per engine
# Stop reading a streamed answer (``chunks``) the client is slower to take
# than the engine is to produce once this much of it waits in the front; read
# again below half. An answer read whole is read whole, whatever its size.
_BUFFER_HIGH = 1024 * 1024
_NO_BODY = frozenset({204, 304})
_FRAMING = (b"content-length", b"transfer-encoding")
_SSE = b"text/event-stream"


class UpstreamError(Exception):
    """The engine could not be used for this request."""


class Unreachable(UpstreamError):
    """No connection: the engine does not listen (not Active yet, or gone)."""


class Stale(UpstreamError):
    """A reused connection was dead before the engine answered anything."""


class Broken(UpstreamError):
    """The connection died after the request was sent."""


class Response:
    """One answer from the engine: its head at once, its body as it arrives."""

    def __init__(self, conn: _Conn, head_only: bool, reused: bool) -> None:
        self.status = 0
        self.headers: Headers = []
        self._conn = conn
        self._head_only = head_only
        self._reused = reused
        self._got_bytes = False
        self._keep_alive = False
        self._until_close = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._streamed = False  # read part by part (chunks): back-pressure applies
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._on_complete: Callable[[], None] | None = None

    @property
    def complete(self) -> bool:
        """The whole answer is in (``body()`` has it)."""
        return self._done

    def on_complete(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when the whole answer is in or the attempt
        failed (at once if that already happened)."""
        if self._done or self._error is not None:
            callback()
        else:
            self._on_complete = callback

    def header(self, name: bytes) -> bytes | None:
        low = name.lower()
        return next((v for k, v in self.headers if k.lower() == low), None)

    # ---------------------------------------------- fed by the connection --

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _ended(self) -> None:
        self._wake()
        callback, self._on_complete = self._on_complete, None
        if callback is not None:
            callback()

    def _on_head(self, status: int, keep_alive: bool) -> None:
        if 100 <= status < 200:
            self.headers = []  # an interim answer: the real one follows
            return
        self.status = status
        self._keep_alive = keep_alive
        framed = any(k.lower() in _FRAMING for k, _ in self.headers)
        self._until_close = not framed and status not in _NO_BODY
        if self._head_only:
            # A HEAD's answer has no body, whatever it says (RFC 9112 6.3); the
            # parser cannot be told, so this connection is not used again.
            self._keep_alive = False
            self._finish()
        self._wake()

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._streamed and self._buffered > _BUFFER_HIGH:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        if self._done or self._error is not None:
            return
        self._done = True
        self._conn.finished(self, self._keep_alive)
        self._ended()

    def _fail(self, error: UpstreamError) -> None:
        if self._done or self._error is not None:
            return
        self._error = error
        self._ended()

    def _lost(self, exc: Exception | None) -> None:
        if self._done or self._error is not None:
            return
        if self.status and self._until_close and exc is None:
            self._finish()  # the engine ended the body by closing
        elif not self._got_bytes and self._reused:
            self._fail(Stale(f"connection closed before any answer ({exc!r})"))
        elif not self.status:
            self._fail(Broken(f"no answer: connection closed ({exc!r})"))
        else:
            self._fail(Broken(f"answer cut short: connection closed ({exc!r})"))

    # ------------------------------------------------------ for the caller --

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def head(self) -> Response:
        """Wait for the answer's head. Raises Stale or Broken."""
        while not self.status:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; the connection goes back to the pool at its end."""
        self._streamed = True
        while True:
            while self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._buffered < _BUFFER_HIGH // 2:
                    self._conn.resume()
                yield data
            if self._error is not None:
                raise self._error
            if self._done:
                return
            await self._wait()

    async def read(self) -> bytes:
        while not self._done:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self.body()

    def body(self) -> bytes:
        """The whole body of a complete answer."""
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    def close(self) -> None:
        """Give up on the rest of the answer (its connection is closed)."""
        if not self._done:
            self._fail(Broken("given up"))
            self._conn.close()


class _Conn(asyncio.Protocol):
    """One connection to the engine; one request on it at a time."""

    def __init__(self, pool: Upstream) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._paused = False
        self._resp: Response | None = None
        self.last_rx = 0.0  # loop time of the last bytes received

    def streaming(self) -> bool:
        """An event stream is being answered on this connection."""
        r = self._resp
        return r is not None and r.status == 200 and r.header(b"content-type") == _SSE

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses).
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self, lost=True)
        if self._resp is not None:
            self._resp._lost(exc)

    def eof_received(self) -> bool:
        self._pool.forget(self)  # not to be taken for a request from now on
        return False  # close; connection_lost tells the answer in progress, if any

    def send(self, resp: Response, data: bytes) -> None:
        assert self.transport is not None and self._resp is None
        self._resp = resp
        if self.closed or self.transport.is_closing():  # it went away since its release
            resp._lost(None)
            return
        try:
            self.transport.write(data)
        except (OSError, RuntimeError) as exc:  # uvloop: a transport closed under us
            resp._lost(exc)

    def finished(self, resp: Response, keep_alive: bool) -> None:
        if self._resp is resp:
            self._resp = None
        self.resume()
        if keep_alive and not self.closed:
            self._pool.release(self)
        else:
            self.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    @property
    def answering(self) -> bool:
        """A request is on it whose answer is not all in."""
        return self._resp is not None

    def read_pending(self) -> None:
        """Take in what the peer wrote that the loop has not read yet.

        For a peer judged dead: an engine can finish an answer and exit (a
        drain's end) within one turn of the loop, and its death word may be
        handled in that turn before the socket's bytes are; closing the
        transport then would throw a whole answer away and break a request
        that its engine did serve."""
        t = self.transport
        if t is None or self.closed:
            return
        sock = t.get_extra_info("socket")
        while sock is not None and self._resp is not None and not t.is_closing():
            try:
                data = os.read(sock.fileno(), 65536)
            except OSError:  # nothing more for now (EAGAIN), or it is gone
                return
            if not data:
                return  # its end: the close that follows tells the answer in progress
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        resp = self._resp
        if resp is None:
            self.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        resp._got_bytes = True
        if self._pool.tcp is not None:  # a pod's stream: its silence is judged
            self.last_rx = asyncio.get_running_loop().time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            resp._fail(Broken("the engine switched protocols"))
            self.close()
        except httptools.HttpParserError as exc:
            resp._fail(Broken(f"not an HTTP answer: {exc}"))
            self.close()

    # llhttp's callbacks, for the answer in progress.

    def on_message_begin(self) -> None:
        if self._resp is not None:
            self._resp.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._resp is not None:
            self._resp.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._resp is not None:
            p = self._parser
            self._resp._on_head(p.get_status_code(), p.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self._resp is not None:
            self._resp._on_body(body)

    def on_message_complete(self) -> None:
        resp = self._resp
        if resp is not None and resp.status:
            resp._finish()


class Upstream:
    """Requests to one engine's socket (or, for a fleet gateway, to one pod's
    front over TCP: ``tcp``, with ``headers`` added to every request)."""

    def __init__(
        self,
        path: str,
        *,
        tcp: tuple[str, int] | None = None,
        headers: Headers | None = None,
        connect_s: float = 1.0,
    ) -> None:
        self.path = path
        self.tcp = tcp
        self._extra = b"".join(k + b": " + v + b"\r\n" for k, v in headers or ())
        # A TCP peer that is gone without a reset (a node lost) would hold a
        # connect for minutes; a Unix socket answers at once either way.
        self._connect_s = connect_s
        self._idle: list[_Conn] = []
        self._open: set[_Conn] = set()
        self.closed = False
        # How many requests were on it when its peer was seen dead (abort at
        # a death word): each is resent with that count (COHORT_HEADER).
        self.broke_together = 0

    def given_up(self) -> bool:
        return self.closed

    @property
    def busy(self) -> int:
        """Connections with a request on them (or just finishing one)."""
        return len(self._open) - len(self._idle)

    @property
    def streams(self) -> int:
        """Event streams being answered."""
        return sum(c.streaming() for c in self._open)

    def quiet_since(self) -> float | None:
        """The loop time of the last bytes of the quietest answer in
        progress that is an event stream (its peer heartbeats it); None when
        there is none."""
        times = [c.last_rx for c in self._open if c.streaming()]
        return min(times) if times else None

    def abort(self) -> int:
        """The peer is judged dead: keep what it answered before (the bytes
        already in each connection), then close every connection, busy ones
        too (their answers break), and connect no more. Returns how many
        requests broke: those whose answer was not all in."""
        self.closed = True  # a connection that finishes now is closed, not kept
        conns = list(self._open)
        for conn in conns:
            conn.read_pending()
            conn.close()
        self._idle.clear()
        return sum(c.answering for c in conns)

    def release(self, conn: _Conn) -> None:
        if not self.closed and len(self._idle) < _IDLE_MAX:
            self._idle.append(conn)
        else:
            conn.close()

    def forget(self, conn: _Conn, lost: bool = False) -> None:
        if conn in self._idle:
            self._idle.remove(conn)
        if lost:
            self._open.discard(conn)

    def drop_idle(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    def close(self) -> None:
        self.closed = True
        self.drop_idle()

    async def _connect(self) -> _Conn:
        if self.closed:
            raise Unreachable(f"{self.path}: given up on")
        loop = asyncio.get_running_loop()
        try:
            if self.tcp is None:
                _, conn = await loop.create_unix_connection(lambda: _Conn(self), self.path)
            else:
                async with asyncio.timeout(self._connect_s):
                    _, conn = await loop.create_connection(lambda: _Conn(self), *self.tcp)
        except OSError as exc:
            raise Unreachable(f"{self.path}: {exc.strerror or exc}") from None
        except TimeoutError:
            raise Unreachable(f"{self.path}: no connection in {self._connect_s}s") from None
        if self.given_up():  # aborted while connecting
            conn.close()
            raise Unreachable(f"{self.path}: given up on")
        self._open.add(conn)
        return conn

    def send_idle(
        self, method: bytes, target: bytes, headers: Headers, body: bytes
    ) -> Response | None:
        """Send one request on a kept-alive connection, or None if none is idle."""
        if not self._idle:
            return None
        return self._send(self._idle.pop(), True, method, target, headers, body)

    async def send(self, method: bytes, target: bytes, headers: Headers, body: bytes) -> Response:
        """Send one request, on a kept-alive connection or a new one; its
        answer is to come (``Response.head``). Raises Unreachable."""
        reused = bool(self._idle)
        conn = self._idle.pop() if reused else await self._connect()
        return self._send(conn, reused, method, target, headers, body)

    async def request(
        self, method: bytes, target: bytes, headers: Headers, body: bytes
    ) -> Response:
        """Send one request and wait for the answer's head. Raises Unreachable,
        Stale (retry on a new connection) or Broken."""
        resp = await self.send(method, target, headers, body)
        try:
            return await resp.head()
        except BaseException:
            resp.close()  # cancelled, or the engine is gone: this connection is done
            raise

    def _send(
        self, conn: _Conn, reused: bool, method: bytes, target: bytes, headers: Headers, body: bytes
    ) -> Response:
        head = [b"%s %s HTTP/1.1\r\nHost: engine\r\n" % (method, target)]
        head.append(b"Content-Length: %d\r\n" % len(body))
        head.append(self._extra)
        head += [name + b": " + value + b"\r\n" for name, value in headers]
        head.append(b"\r\n")
        resp = Response(conn, head_only=method == b"HEAD", reused=reused)
        conn.send(resp, b"".join(head) + body)
        return resp
