"""Unix-domain (and TCP) socket helpers shared by the daemons and their clients.

Hygiene: sockets live in a 0700 directory, are bound 0660 with
CLOEXEC (Python's default: sockets are non-inheritable), a stale path is
removed only if it is a socket nobody answers, peer credentials are read with
SO_PEERCRED, at most one fd travels per frame in the same ``sendmsg`` as the
frame, received fds are owned at once, and a truncated ancillary message
(MSG_CTRUNC) is an error.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from understudy.wire.framing import HEADER, HEADER_SIZE, RemoteFrameError


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"pid={self.pid} uid={self.uid} gid={self.gid}"


_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> PeerCred | None:
    """SO_PEERCRED of a connected Unix socket; None for other families."""
    if sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def prepare_socket_dir(directory: Path) -> None:
    """Create the socket directory 0700 if missing.

    An existing directory keeps its mode: in a pod it is an emptyDir shared by
    containers that run as the same user, and the kubelet owns its mode.
    """
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o700, exist_ok=True)


def _remove_stale(path: Path, kind: int = socket.SOCK_STREAM) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # a dead server's leftover
        return
    except OSError as exc:
        raise OSError(f"cannot probe existing socket {path}: {exc}") from exc
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another server is answering on {path}")


def bind_unix(
    path: Path, mode: int = 0o660, backlog: int = 1024, kind: int = socket.SOCK_STREAM
) -> socket.socket:
    """A listening Unix socket at ``path`` with ``mode``, CLOEXEC, non-blocking
    (``kind``: SOCK_SEQPACKET keeps each message and its fd apart)."""
    prepare_socket_dir(path.parent)
    _remove_stale(path, kind)
    sock = socket.socket(socket.AF_UNIX, kind)
    old = os.umask(0o777 & ~mode)  # no window where the socket is wider than mode
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def set_keepalive(
    sock: socket.socket, idle_s: int = 1, interval_s: int = 1, count: int = 3
) -> None:
    """TCP keepalive and user timeout so a vanished peer is seen in about
    ``idle + interval * count`` seconds (4 s with the defaults)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
    sock.setsockopt(
        socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (idle_s + interval_s * count) * 1000
    )
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def parse_tcp_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


# --- frames with an optional fd (blocking sockets, used by clients) ---------


class OwnedFd:
    """A received file descriptor, closed unless ``detach``ed (or on ``close``)."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError("fd already closed or detached")
        return self._fd

    def detach(self) -> int:
        fd = self.fd
        self._fd = None
        return fd

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> OwnedFd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.close()


def send_frame(sock: socket.socket, frame: bytes, fd: int | None = None) -> None:
    """Send one already-encoded frame; the fd, if any, rides on its first byte."""
    if fd is None:
        sock.sendall(frame)
        return
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
    sent = sock.sendmsg([frame], anc)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, max_size: int) -> tuple[bytes, OwnedFd | None]:
    """Receive one frame and the fd that came with it, if any (blocking)."""
    fds: list[int] = []
    header = bytearray()
    while len(header) < HEADER_SIZE:
        data, anc, flags, _ = sock.recvmsg(
            HEADER_SIZE - len(header), socket.CMSG_SPACE(array.array("i").itemsize)
        )
        fds.extend(_fds_from(anc))
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            raise RemoteFrameError("ancillary data truncated (MSG_CTRUNC): more than one fd sent")
        if not data:
            _close_all(fds)
            raise ConnectionResetError("peer closed the connection")
        header += data
    (length,) = HEADER.unpack(header)
    if length > max_size:
        _close_all(fds)
        raise RemoteFrameError(f"frame length {length} exceeds the maximum {max_size}")
    try:
        body = recv_exact(sock, length)
    except BaseException:
        _close_all(fds)
        raise
    if len(fds) > 1:
        _close_all(fds)
        raise RemoteFrameError(f"{len(fds)} fds in one frame; at most one is allowed")
    return body, (OwnedFd(fds[0]) if fds else None)


def rights(fd: int) -> tuple[int, int, bytes]:
    """The ancillary message that carries ``fd`` (SCM_RIGHTS)."""
    return (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())


def fds_from(anc: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors that came in ``recvmsg``'s ancillary data (now the caller's)."""
    return _fds_from(anc)


def _fds_from(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - (len(data) % arr.itemsize)])
            fds.extend(arr)
    return fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# --- the same for asyncio servers over raw non-blocking sockets -------------


async def sock_send_frame(sock: socket.socket, frame: bytes, fd: int | None = None) -> None:
    """asyncio twin of ``send_frame`` for a non-blocking socket."""
    import asyncio

    loop = asyncio.get_running_loop()
    if fd is None:
        await loop.sock_sendall(sock, frame)
        return
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
    while True:
        try:
            sent = sock.sendmsg([frame], anc)
            break
        except (BlockingIOError, InterruptedError):
            ready = loop.create_future()
            loop.add_writer(sock.fileno(), ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_writer(sock.fileno())
    if sent < len(frame):
        await loop.sock_sendall(sock, frame[sent:])


async def sock_recv_with_fd(sock: socket.socket, size: int) -> tuple[bytes, OwnedFd | None]:
    """asyncio ``recvmsg`` for a non-blocking socket: up to ``size`` bytes and
    the one fd (SCM_RIGHTS) that rode on them, wrapped at once. More than one
    fd, or truncated ancillary data (MSG_CTRUNC), is the peer's error. For the
    one server request that carries an fd; a caller that does not want an fd
    closes the one it gets."""
    import asyncio

    loop = asyncio.get_running_loop()
    while True:
        try:
            data, anc, flags, _ = sock.recvmsg(size, socket.CMSG_SPACE(array.array("i").itemsize))
            break
        except (BlockingIOError, InterruptedError):
            ready: asyncio.Future[None] = loop.create_future()

            def wake(ready: asyncio.Future[None] = ready) -> None:
                if not ready.done():
                    ready.set_result(None)

            loop.add_reader(sock.fileno(), wake)
            try:
                await ready
            finally:
                loop.remove_reader(sock.fileno())
    fds = _fds_from(anc)
    if flags & socket.MSG_CTRUNC or len(fds) > 1:
        _close_all(fds)
        raise RemoteFrameError("more than one fd sent with a frame")
    return data, (OwnedFd(fds[0]) if fds else None)
