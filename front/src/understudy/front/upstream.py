"""A small HTTP/1.1 client for one engine's Unix socket, with kept-alive connections.

The front forwards every request over one of these, so it is on every
request's path: it does only what the engines' own server speaks (HTTP/1.1,
``Content-Length`` or chunked bodies) and nothing else (no cookies, no
redirects, no timers per request), which keeps the front's added latency
small.

A kept-alive connection can be taken just as its engine exits. A request that
fails on a reused connection before any byte of an answer came back is
reported as ``Stale``: the caller tries once more on a new connection, which
either reaches the engine (the old connection had died idle) or finds none
(the engine is gone, perhaps with the request in it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

_HEAD_LIMIT = 64 * 1024
_IDLE_MAX = 64  # kept-alive connections per engine


class UpstreamError(Exception):
    """The engine could not be used for this request."""


class Unreachable(UpstreamError):
    """No connection: the engine does not listen (not Active yet, or gone)."""


class Stale(UpstreamError):
    """A reused connection was dead before the engine answered anything."""


class Broken(UpstreamError):
    """The connection died after the request was sent."""


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.close()


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    _conn: _Conn
    _pool: Upstream
    _length: int | None
    _chunked: bool
    _keep_alive: bool
    _done: bool = field(default=False)

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers if k.lower() == low), None)

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; the connection goes back to the pool at its end."""
        r = self._conn.reader
        try:
            if self._chunked:
                while True:
                    size_line = await r.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0], 16)
                    if size == 0:
                        while await r.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailers
                        break
                    data = await r.readexactly(size + 2)
                    yield data[:-2]
            elif self._length is not None:
                left = self._length
                while left:
                    data = await r.read(min(left, 256 * 1024))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:  # until the engine closes
                while data := await r.read(256 * 1024):
                    yield data
                self._keep_alive = False
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self._conn.close()
            self._done = True
            raise Broken(f"answer cut short: {exc!r}") from None
        except OSError as exc:
            self._conn.close()
            self._done = True
            raise Broken(f"answer cut short: {exc!r}") from None
        self._done = True
        self._pool.release(self._conn, self._keep_alive)

    def close(self) -> None:
        """Give up on the rest of the answer (its connection is closed)."""
        if not self._done:
            self._done = True
            self._conn.close()


class Upstream:
    """Requests to one engine's socket."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[_Conn] = []
        self.closed = False

    def release(self, conn: _Conn, keep_alive: bool) -> None:
        if keep_alive and not self.closed and len(self._idle) < _IDLE_MAX:
            self._idle.append(conn)
        else:
            conn.close()

    def drop_idle(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    def close(self) -> None:
        self.closed = True
        self.drop_idle()

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path, limit=_HEAD_LIMIT)
        except OSError as exc:
            raise Unreachable(f"{self.path}: {exc.strerror or exc}") from None
        return _Conn(reader, writer)

    async def request(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> Response:
        """Send one request and read the answer's head. Raises Unreachable,
        Stale (retry on a new connection) or Broken."""
        reused = bool(self._idle)
        conn = self._idle.pop() if reused else await self._connect()
        head = [f"{method} {target} HTTP/1.1", "Host: engine", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers]
        try:
            conn.writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            await conn.writer.drain()
            raw = await conn.reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            conn.close()
            if reused:
                raise Stale(repr(exc)) from None
            raise Broken(f"no answer: {exc!r}") from None
        try:
            return self._response(conn, raw)
        except ValueError as exc:
            conn.close()
            raise Broken(f"not an HTTP answer: {exc}") from None

    def _response(self, conn: _Conn, raw: bytes) -> Response:
        lines = raw[:-4].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(lines[0][:80])
        status = int(rest.split(" ", 1)[0])
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"bad header line {line[:80]!r}")
            headers.append((name.strip(), value.strip()))
        low = {k.lower(): v for k, v in headers}
        chunked = "chunked" in low.get("transfer-encoding", "").lower()
        length = None if chunked or "content-length" not in low else int(low["content-length"])
        keep = low.get("connection", "").lower() != "close" and (chunked or length is not None)
        if status in (204, 304) or (100 <= status < 200):
            length, chunked = 0, False
        return Response(status, headers, conn, self, length, chunked, keep)
