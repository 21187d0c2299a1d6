"""Client of the pod's lock: what the engine shim (and ``understudy lock``) use.

``acquire`` blocks until granted and returns a ``HeldLock``: the open
connection *is* the lock, and a monitor thread watches it. When the server
goes away (EOF / POLLHUP, seen within milliseconds on a Unix socket) the
monitor reconnects and asks for the same grant back (``resume_epoch``) for up
to ``reconnect_timeout`` seconds — longer than the server's reconnect window,
so a restarted server still sees its holder come back. If that fails, or the
server granted another epoch meanwhile, ``on_lost`` is called; its default
terminates the process at once, because a holder that may have been replaced
must not keep serving.

Blocking sockets and threads, not asyncio: engines (vLLM among them) are
threaded programs, and the monitor must run whatever the engine's main thread
is doing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from understudy.lockserver.config import DEFAULT_CLIENT_RECONNECT_S
from understudy.lockserver.messages import (
    Acquire,
    Error,
    Granted,
    Holder,
    Status,
    StatusReply,
    client_codec,
    server_codec,
)
from understudy.wire.obs import log_event
from understudy.wire.uds import parse_tcp_address, set_keepalive

log = logging.getLogger("understudy.lockserver.client")

EXIT_LOCK_LOST = 3
_RETRY_S = 0.02


class LockError(Exception):
    """Base of client-side lock errors."""


class LockTimeout(LockError):
    """The grant (or the server) did not come within the timeout."""


class LockRefused(LockError):
    """The server answered with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class LockUnavailable(LockError):
    """No lock server could be reached."""


@dataclass(frozen=True, slots=True)
class Address:
    """``/path/lock.sock`` or ``unix:/path`` (Unix socket), ``tcp:HOST:PORT``."""

    path: Path | None = None
    tcp: tuple[str, int] | None = None

    @classmethod
    def parse(cls, text: str | os.PathLike[str]) -> Address:
        text = os.fspath(text)
        if text.startswith("tcp:"):
            return cls(tcp=parse_tcp_address(text.removeprefix("tcp:").removeprefix("//")))
        return cls(path=Path(text.removeprefix("unix:")))

    def __str__(self) -> str:
        if self.tcp is not None:
            return f"tcp:{self.tcp[0]}:{self.tcp[1]}"
        return str(self.path)

    def connect(self, timeout: float) -> socket.socket:
        if self.tcp is not None:
            sock = socket.create_connection(self.tcp, timeout=timeout)
            set_keepalive(sock)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(str(self.path))
            except BaseException:
                sock.close()
                raise
        return sock


def _connect_retrying(address: Address, deadline: float) -> socket.socket:
    """Connect, retrying while the server is absent (restarting) until deadline."""
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LockUnavailable(f"cannot reach lock server at {address}: {last}")
        try:
            return address.connect(min(remaining, 2.0))
        except (
            FileNotFoundError,
            ConnectionRefusedError,
            ConnectionResetError,
            TimeoutError,
        ) as exc:
            last = exc
            time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))


def _request(
    sock: socket.socket, message: Acquire | Status, timeout: float | None
) -> Granted | StatusReply | Error:
    """Send one request and wait for its reply (``None``: no time limit)."""
    sock.settimeout(timeout)
    sock.sendall(client_codec().encode(message))
    codec = server_codec()
    while True:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            raise LockTimeout("no reply from the lock server within the timeout") from None
        if not data:
            raise ConnectionResetError("lock server closed the connection")
        replies = codec.feed(data)
        if replies:
            reply = replies[0]
            if isinstance(reply, Holder):  # only ever sent on a watch
                raise ConnectionResetError("lock server sent a watch event to a request")
            return reply


def _default_on_lost(reason: str) -> None:
    # Fencing: a holder that may have been replaced must stop at once; no
    # cleanup handler may keep it serving next to the new holder.
    log_event(log, "lock_lost_exit", logging.CRITICAL, reason=reason, exit_code=EXIT_LOCK_LOST)
    sys.stderr.flush()
    os._exit(EXIT_LOCK_LOST)


def status(
    address: Address | str | os.PathLike[str], timeout: float = 2.0, token: str | None = None
) -> StatusReply:
    addr = address if isinstance(address, Address) else Address.parse(address)
    try:
        sock = addr.connect(timeout)
    except OSError as exc:
        raise LockUnavailable(f"cannot reach lock server at {addr}: {exc}") from exc
    with sock:
        try:
            reply = _request(sock, Status(token=token), timeout)
        except OSError as exc:
            raise LockUnavailable(f"lock server at {addr} failed: {exc}") from exc
    if isinstance(reply, Error):
        raise LockRefused(reply.code, reply.message)
    if not isinstance(reply, StatusReply):
        raise LockRefused("bad_reply", f"expected status_reply, got {reply.type}")
    return reply


def acquire(
    address: Address | str | os.PathLike[str],
    engine_id: str,
    timeout: float | None,
    *,
    token: str | None = None,
    on_lost: Callable[[str], None] | None = None,
    on_epoch: Callable[[int], None] | None = None,
    reconnect_timeout: float = DEFAULT_CLIENT_RECONNECT_S,
    connect_timeout: float = 10.0,
) -> HeldLock:
    """Block until ``engine_id`` holds the lock (``timeout=None``: as long as it takes).

    A standby waits without a time limit on purpose: it waits for another
    engine to die. That wait is still bounded by the server's liveness — if
    the server goes away, the wait reconnects and starts over, and gives up
    with ``LockUnavailable`` after ``connect_timeout`` without a server.
    """
    addr = address if isinstance(address, Address) else Address.parse(address)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        connect_deadline = time.monotonic() + connect_timeout
        if deadline is not None:
            connect_deadline = min(connect_deadline, deadline)
        sock = _connect_retrying(addr, connect_deadline)
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = _request(sock, Acquire(engine_id=engine_id, token=token), remaining)
        except LockTimeout:
            sock.close()
            raise LockTimeout(f"lock not granted to {engine_id} within {timeout}s") from None
        except OSError as exc:
            # The server went away while we waited: wait again on the next one.
            sock.close()
            log_event(log, "acquire_retry", logging.WARNING, engine_id=engine_id, error=str(exc))
            continue
        except BaseException:
            sock.close()
            raise
        if isinstance(reply, Granted):
            held = HeldLock(
                addr,
                sock,
                reply.engine_id,
                reply.epoch,
                token,
                on_lost or _default_on_lost,
                reconnect_timeout,
                on_epoch,
            )
            held.released_at = reply.released_at
            return held
        sock.close()
        if isinstance(reply, Error):
            raise LockRefused(reply.code, reply.message)
        raise LockRefused("bad_reply", f"expected granted, got {reply.type}")


class HeldLock:
    """A granted lock: hold it by keeping this object (its socket) open."""

    def __init__(
        self,
        address: Address,
        sock: socket.socket,
        engine_id: str,
        epoch: int,
        token: str | None,
        on_lost: Callable[[str], None],
        reconnect_timeout: float,
        on_epoch: Callable[[int], None] | None = None,
    ) -> None:
        self.address = address
        self.engine_id = engine_id
        self.epoch = epoch
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        self.resumes = 0
        # Wall time the previous holder let go (from the grant), if known.
        self.released_at: float | None = None
        self._sock = sock
        self._token = token
        self._on_lost = on_lost
        self._on_epoch = on_epoch
        self._reconnect_timeout = reconnect_timeout
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._monitor, name=f"lock-monitor-{engine_id}", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the lock (closing the connection is the release)."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------ monitor

    def _monitor(self) -> None:
        mask = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLRDHUP
        while not self._stop.is_set():
            poller = select.poll()
            poller.register(self._sock.fileno(), mask)
            poller.register(self._wake_r, select.POLLIN)
            events = poller.poll()
            if self._stop.is_set():
                return
            if not any(fd == self._sock.fileno() for fd, _ in events):
                continue
            if not self._connection_ended():
                continue
            log_event(
                log,
                "lock_connection_lost",
                logging.WARNING,
                engine_id=self.engine_id,
                epoch=self.epoch,
            )
            reason = self._resume()
            if reason is None:
                continue
            if self._stop.is_set():
                return
            self.lost_reason = reason
            self.lost.set()
            log_event(
                log,
                "lock_lost",
                logging.ERROR,
                engine_id=self.engine_id,
                epoch=self.epoch,
                reason=reason,
            )
            self._on_lost(reason)
            return

    def _connection_ended(self) -> bool:
        try:
            self._sock.settimeout(0)
            data = self._sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        # Nothing is sent to a holder after its grant; bytes here are a bug
        # on the server, not a reason to give up the lock.
        return not data

    def _resume(self) -> str | None:
        """Reconnect and get the same grant back; the reason it failed, or None."""
        with contextlib.suppress(OSError):
            self._sock.close()
        deadline = time.monotonic() + self._reconnect_timeout
        request = Acquire(engine_id=self.engine_id, resume_epoch=self.epoch, token=self._token)
        while not self._stop.is_set():
            try:
                sock = _connect_retrying(self.address, deadline)
            except LockUnavailable as exc:
                return f"lock server did not come back within {self._reconnect_timeout}s ({exc})"
            try:
                reply = _request(sock, request, max(0.0, deadline - time.monotonic()))
            except LockTimeout:
                sock.close()
                return f"grant not resumed within {self._reconnect_timeout}s"
            except OSError:
                sock.close()
                continue  # server died again: try the next one
            if isinstance(reply, Granted) and (reply.epoch == self.epoch or reply.reissued):
                # reissued: the server had lost its record and re-granted our
                # claim under a new epoch; we hold the lock, and fence with it.
                old, self.epoch = self.epoch, reply.epoch
                self._sock = sock
                self.resumes += 1
                log_event(
                    log, "lock_resumed", engine_id=self.engine_id, epoch=self.epoch,
                    reissued_from=old if reply.reissued else None,
                )  # fmt: skip
                if reply.reissued and self._on_epoch is not None:
                    self._on_epoch(self.epoch)
                return None
            sock.close()  # whatever we were given, it is not our grant
            if isinstance(reply, Granted):
                return f"server granted epoch {reply.epoch}, not our epoch {self.epoch}"
            if isinstance(reply, Error):
                return f"{reply.code}: {reply.message}"
            return f"unexpected reply {reply.type}"
        return "closed"
