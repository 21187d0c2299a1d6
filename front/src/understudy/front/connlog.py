"""What a front writes down about each client connection, so that the next
front can finish it (``understudy.wire.connhold`` keeps the connection itself).

One small file per connection, ``conns/<id>`` in the pod's run directory (a
memory-backed volume): a header, then records, each written with one
``pwrite`` *before* the bytes it describes reach the socket, so that a front
killed at any instant leaves a record that says at least as much as the
client got:

- ``R``: bytes read from the client, before they are parsed;
- ``O``: a streamed answer's head, with what its continuation needs (the
  request's id and ``created``, JSON);
- ``V``: one stream event as written (chunk framing included) and the token
  ids it carries;
- ``W``: other bytes written (``100 Continue``, a gateway's heartbeat);
- ``F``: an answer's last bytes: the exchange is over;
- ``X``: a refusal's answer: the connection closes after it.

``R`` is written while the bytes are still the kernel's: the front peeks
at them, writes them down, and only then takes them (``kept``). A front
killed in between leaves them in both places; one killed after a plain read
would have taken a request nobody has.

When the connection is idle (every answer out, nothing of a next request
read) and the kernel has taken every byte, the file is cut back to its
header, whose ``tx_base`` and ``rx_base`` then count the bytes that went
each way before: a kept-alive connection's record stays the size of one
exchange.

The next front (``plan``) takes from the socket what the record has already
(``skip``: the bytes written down but still in the kernel's receive queue,
from the socket's own count, ``kernel_read``), replays ``R`` through its
parser, skips the exchanges that ended, writes first what the kernel never
took (the record's bytes past the socket's own count: bytes acked by the
client plus those still in its send queue, ``TCP_INFO`` and ``SIOCOUTQ``),
and continues a stream that was under way from its last event, with the ids
of the tokens its client already has.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import socket
import struct
import termios
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from understudy.wire import failpoints

DIR = "conns"
MAGIC = b"USC2"
# magic, the socket's inode (0: not known), tx_base, rx_base. The inode names
# the connection a record is of whatever id the keeper holds it under: a
# front killed with a copy not yet sent leaves the connection to its witness,
# which holds it under an id of its own (``inodes``).
_HEADER = struct.Struct("<4sIQQ")
_REC = struct.Struct("<cI")  # kind, payload length
_META = struct.Struct("<H")
_COUNT = struct.Struct("<I")
MAX_RECORD = 64 << 20
_MAX_INODE = 0xFFFFFFFF  # a socket's (sockfs numbers them with an unsigned int)
# struct tcp_info (Linux >= 4.1): tcpi_state, a u8 first; tcpi_bytes_acked and
# tcpi_bytes_received, u64s at these offsets.
_BYTES_ACKED = 120
_BYTES_RECEIVED = 128
# The states in which the peer's FIN has arrived: the kernel counts it as a
# byte received (it takes a sequence number), and it is not data.
_FIN_STATES = frozenset({6, 7, 8, 9, 11})  # TIME_WAIT, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING

# The record kinds (module docstring).
R, OPEN, V, W, F, X = b"R", b"O", b"V", b"W", b"F", b"X"
_TX = frozenset({OPEN, V, W, F, X})


class LogError(ValueError):
    """A record that is not one of ours: the connection cannot be finished."""


class ConnLog:
    """This front's record of one connection (``pwrite`` at its end)."""

    __slots__ = ("_end", "_fd", "cid", "inode", "path", "rx", "rx_base", "tx", "tx_base")

    def __init__(
        self,
        path: Path,
        fd: int,
        cid: str,
        bases: tuple[int, int],
        end: int,
        counts: tuple[int, int],
        inode: int = 0,
    ) -> None:
        self.path = path
        self.cid = cid
        self.inode = inode
        self._fd = fd
        # Bytes of this connection's answers and requests before the records.
        self.tx_base, self.rx_base = bases
        self._end = end
        self.tx, self.rx = counts  # bytes the records say were written, and read, since

    @classmethod
    def create(cls, directory: Path, cid: str, inode: int = 0) -> ConnLog:
        """A new record, of the connection whose socket has ``inode`` (0: not said)."""
        path = directory / cid
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        failpoints.hit("front.accept.header")
        return cls._begin(path, fd, cid, inode)

    @classmethod
    def _begin(cls, path: Path, fd: int, cid: str, inode: int) -> ConnLog:
        """A new record's header: its file's first write."""
        inode = inode if 0 < inode <= _MAX_INODE else 0
        os.pwrite(fd, _HEADER.pack(MAGIC, inode, 0, 0), 0)
        return cls(path, fd, cid, (0, 0), _HEADER.size, (0, 0), inode)

    @classmethod
    def reopen(
        cls, directory: Path, cid: str, inode: int = 0
    ) -> tuple[ConnLog, int, list[tuple[bytes, bytes]]]:
        """A predecessor's record, to go on writing: it (its ``tx_base`` and
        ``rx_base`` are the predecessor's), its tx_base and records.

        A file shorter than a header is a record whose front died inside
        ``create``, between the file and its header (CI saw one, empty):
        the header is its first write and the front reads nothing before
        ``create`` returns, so nothing went either way. It starts again
        as new, of the socket with ``inode``."""
        path = directory / cid
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            data = os.pread(fd, os.fstat(fd).st_size, 0)
            if len(data) < _HEADER.size:
                return cls._begin(path, fd, cid, inode), 0, []
            tx_base, records, end = parse(data)
            _, inode, _, rx_base = _HEADER.unpack_from(data, 0)  # parse checked the header
        except BaseException:
            os.close(fd)
            raise
        tx = sum(len(tx_bytes(k, p)) for k, p in records if k in _TX)
        rx = sum(len(p) for k, p in records if k == R)
        if end < len(data):
            os.ftruncate(fd, end)  # a torn last record: never written, as far as anyone knows
        record = cls(path, fd, cid, (tx_base, rx_base), end, (tx, rx), inode)
        return record, tx_base, records

    def _append(self, kind: bytes, *parts: bytes) -> None:
        size = sum(map(len, parts))
        os.pwrite(self._fd, b"".join((_REC.pack(kind, size), *parts)), self._end)
        self._end += _REC.size + size

    def received(self, data: bytes) -> None:
        self._append(R, data)
        self.rx += len(data)

    def opened(self, meta: dict[str, Any], head: bytes) -> None:
        doc = json.dumps(meta, separators=(",", ":")).encode()
        self._append(OPEN, _META.pack(len(doc)), doc, head)
        self.tx += len(head)

    def event(self, ids: Iterable[int], data: bytes) -> None:
        packed = array.array("I", ids).tobytes()
        self._append(V, _COUNT.pack(len(packed) // 4), packed, data)
        self.tx += len(data)

    def wrote(self, data: bytes, kind: bytes = W) -> None:
        """Bytes written: plain (W), an answer's last (F), or a refusal's (X)."""
        self._append(kind, data)
        self.tx += len(data)

    def compact(self) -> None:
        """Idle, and the kernel took everything: cut the records. Truncated
        first: a front killed between the two leaves no records and the old
        bases, and the next front takes the socket's own counts instead
        (``plan``'s ``rebase``: the kernel had it all)."""
        os.ftruncate(self._fd, _HEADER.size)
        self._end = _HEADER.size
        failpoints.hit("front.record.compact")
        self.rebase(self.tx_base + self.tx, self.rx_base + self.rx)

    def rebase(self, tx_base: int, rx_base: int) -> None:
        """Write down the bytes that went each way before the records (the
        records must be none: ``compact``, or a plan's ``rebase``)."""
        self.tx_base, self.rx_base = tx_base, rx_base
        self.tx = self.rx = 0
        os.pwrite(self._fd, _HEADER.pack(MAGIC, self.inode, tx_base, rx_base), 0)

    @property
    def idle(self) -> bool:
        return self._end == _HEADER.size

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def inodes(directory: Path, names: Iterable[str]) -> dict[int, str]:
    """The records ``names`` by the inode of the socket each is of (a record
    that cannot be read, or does not say, is left out)."""
    found: dict[int, str] = {}
    for name in names:
        try:
            with (directory / name).open("rb") as f:
                head = f.read(_HEADER.size)
        except OSError:
            continue
        if len(head) == _HEADER.size:
            magic, inode, _, _ = _HEADER.unpack(head)
            if magic == MAGIC and inode:
                found[inode] = name
    return found


def parse(data: bytes) -> tuple[int, list[tuple[bytes, bytes]], int]:
    """A record file's tx_base, its whole records, and where they end (a
    torn last record, one its writer died in, is left out)."""
    if len(data) < _HEADER.size:
        raise LogError(f"{len(data)} bytes: no header")
    magic, _, tx_base, _ = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise LogError(f"not a connection record: {magic!r}")
    records: list[tuple[bytes, bytes]] = []
    at = _HEADER.size
    while at + _REC.size <= len(data):
        kind, size = _REC.unpack_from(data, at)
        if kind not in (R, OPEN, V, W, F, X) or size > MAX_RECORD:
            raise LogError(f"a record of kind {kind!r} and {size} bytes at {at}")
        if at + _REC.size + size > len(data):
            break
        records.append((kind, data[at + _REC.size : at + _REC.size + size]))
        at += _REC.size + size
    return tx_base, records, at


def tx_bytes(kind: bytes, payload: bytes) -> bytes:
    """What a record says was written to the client."""
    if kind == OPEN:
        (n,) = _META.unpack_from(payload, 0)
        return payload[_META.size + n :]
    if kind == V:
        (n,) = _COUNT.unpack_from(payload, 0)
        return payload[_COUNT.size + 4 * n :]
    return payload if kind in _TX else b""


@dataclass(frozen=True, slots=True)
class Stream:
    """A streamed answer under way: what its continuation needs."""

    meta: dict[str, Any]
    token_ids: tuple[int, ...]
    started: bool  # an event went out after the head


@dataclass(frozen=True, slots=True)
class Plan:
    rx: bytes  # every byte read since the record's start: replayed, not read again
    skip: int  # of those, still in the socket's receive queue: taken from it unread
    done: int  # exchanges whose answer was written whole: skipped
    tail: bytes  # what the kernel never took: written first
    stream: Stream | None  # the answer after ``done``, if it is a stream under way
    refused: bool  # a refusal went out: close after the tail
    # The record's (tx_base, rx_base) from the socket's own counts, where its
    # front died compacting it (``plan``); None: its own are right.
    rebase: tuple[int, int] | None = None


def plan(
    tx_base: int,
    records: list[tuple[bytes, bytes]],
    kernel: int,
    *,
    rx_base: int = 0,
    read: int | None = None,
    found: bool = True,
) -> Plan:
    """How the next front finishes a connection, from its record and
    ``kernel``, the bytes the socket took from any front (``kernel_count``),
    and ``read``, the bytes any front took from it (``kernel_read``; None:
    not known, nothing is skipped). ``found``: the record is one a front
    that died wrote (False: the next front made it, finding none)."""
    rx = b"".join(p for k, p in records if k == R)
    skip = 0 if read is None else rx_base + len(rx) - read
    if skip < 0 and found and not records and read is not None and kernel > tx_base:
        # Nothing past the header, and the socket says more went both ways
        # than it counts: only ``compact`` takes records away, so its front
        # died compacting it (the cut made, the new header not), which it
        # does once its client had every answer and nothing of a next
        # request was read. Nothing is owed either way: the socket's counts
        # are the new bases. (Bytes read with none written since the header
        # are what a front that read before writing down would leave: refused.)
        return Plan(b"", 0, 0, b"", None, False, rebase=(kernel, read))
    if skip < 0:
        raise LogError(f"{-skip} bytes were read from the socket and never written down")
    tx = b"".join(tx_bytes(k, p) for k, p in records)
    if kernel < tx_base:
        raise LogError(f"the socket took {kernel} bytes, fewer than the {tx_base} before")
    tail = tx[kernel - tx_base :]
    done = sum(1 for k, _ in records if k == F)
    last_end = max((i for i, (k, _) in enumerate(records) if k == F), default=-1)
    stream: Stream | None = None
    for kind, payload in records[last_end + 1 :]:
        if kind == OPEN:
            (n,) = _META.unpack_from(payload, 0)
            stream = Stream(json.loads(payload[_META.size : _META.size + n]), (), False)
        elif kind == V and stream is not None:
            (n,) = _COUNT.unpack_from(payload, 0)
            ids = array.array("I")
            ids.frombytes(payload[_COUNT.size : _COUNT.size + 4 * n])
            stream = Stream(stream.meta, (*stream.token_ids, *ids), True)
    refused = any(k == X for k, _ in records)
    return Plan(rx, skip, done, tail, stream, refused)


def kernel_count(sock: socket.socket) -> int:
    """Bytes this TCP socket took from its writers since it opened: acked by
    the peer, plus those still in its send queue."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _BYTES_ACKED + 8:
        raise LogError("this kernel's TCP_INFO has no bytes_acked (Linux 4.1 or later)")
    (acked,) = struct.unpack_from("<Q", info, _BYTES_ACKED)
    queued = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)
    return int(acked) + queued[0]


def kernel_read(sock: socket.socket) -> int:
    """Bytes readers took from this TCP socket since it opened: every byte
    it received, less those still in its receive queue (and the FIN)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _BYTES_RECEIVED + 8:
        raise LogError("this kernel's TCP_INFO has no bytes_received (Linux 4.1 or later)")
    (received,) = struct.unpack_from("<Q", info, _BYTES_RECEIVED)
    if info[0] in _FIN_STATES:
        received -= 1
    unread = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, unread)
    return int(received) - unread[0]
