"""The transport of a kept client connection: what it reads outlives the front.

A front that took a request's bytes from the kernel and died before it wrote
them down (``connlog``) took them for good: the next front finds a connection
with nothing to finish, and a client that waits for the answer to a request
nobody has. uvloop's transports read first and tell their protocol after, and
start reading before their owner can stop them, so a kept connection has this
transport instead. Each read peeks (``MSG_PEEK``), hands the bytes to
``write_down``, and only then takes them from the kernel. A front killed in
between leaves them in its record and in the socket both; the next front
takes them from the socket unread (``discard``), by the socket's own count
(``connlog.kernel_read``).

Reading starts when its owner says (``resume_reading``): an adopted
connection reads only after its record was replayed. Writes go out at once
and queue the rest, with the protocol's flow control past ``HIGH_WATER``, as
asyncio's own transports do; ``close`` lets the queue out first.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

HIGH_WATER = 64 * 1024
LOW_WATER = 16 * 1024
_READ_MAX = 256 * 1024
# One read buffer for every connection: the loop runs one callback at a time,
# and each read copies out what it keeps.
_SCRATCH = bytearray(_READ_MAX)


class KeptTransport(asyncio.Transport):
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.Protocol,
        write_down: Callable[[bytes], None],
    ) -> None:
        super().__init__({"socket": sock})
        sock.setblocking(False)
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._write_down = write_down
        self._out = bytearray()
        self._reading = False
        self._writing = False
        self._closing = False
        self._lost = False
        self._paused = False  # the protocol's writing

    # ------------------------------------------------------------- reading --

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._loop.add_reader(self._fd, self._readable)
            self._reading = True

    def _readable(self) -> None:
        try:
            n = self._sock.recv_into(_SCRATCH, _READ_MAX, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._force_close(exc)
            return
        if not n:
            self.pause_reading()
            if not self._protocol.eof_received():
                self.close()
            return
        data = bytes(memoryview(_SCRATCH)[:n])  # one copy, of what came
        self._write_down(data)
        try:
            self.discard(n)
        except OSError as exc:
            self._force_close(exc)
            return
        self._protocol.data_received(data)

    def discard(self, n: int) -> None:
        """Take ``n`` bytes from the kernel, unread: they are written down
        (peeked before, by this front or the one that died)."""
        view = memoryview(_SCRATCH)
        while n > 0:
            got = self._sock.recv_into(view, min(n, _READ_MAX))
            if not got:
                raise ConnectionResetError(f"the connection ended {n} bytes short")
            n -= got

    # ------------------------------------------------------------- writing --

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return  # closing: what it was to say is said (asyncio's transports drop it too)
        if not self._out:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._force_close(exc)
                return
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
            self._loop.add_writer(self._fd, self._writable)
            self._writing = True
        self._out += data
        if not self._paused and len(self._out) > HIGH_WATER:
            self._paused = True
            self._protocol.pause_writing()

    def _writable(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._force_close(exc)
            return
        del self._out[:sent]
        if self._paused and len(self._out) <= LOW_WATER:
            self._paused = False
            self._protocol.resume_writing()
        if not self._out:
            self._loop.remove_writer(self._fd)
            self._writing = False
            if self._closing:
                self._loop.call_soon(self._connection_lost, None)

    def get_write_buffer_size(self) -> int:
        return len(self._out)

    def can_write_eof(self) -> bool:
        return False

    # ------------------------------------------------------------- closing --

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading; close once what was written went out."""
        if self._closing:
            return
        self._closing = True
        self.pause_reading()
        if not self._out:
            self._loop.call_soon(self._connection_lost, None)

    def abort(self) -> None:
        self._force_close(None)

    def _force_close(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._out.clear()
        self._closing = True
        self.pause_reading()
        self._loop.call_soon(self._connection_lost, exc)

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self.pause_reading()
        if self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False
        self._sock.close()
        self._protocol.connection_lost(exc)
