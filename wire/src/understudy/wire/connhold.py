"""Client connections that outlive the front: a copy of each held by the keeper.

The lock server already keeps the pod's listening socket, so that a front's
death refuses no connection (``handover``). This is the same for the
connections the front has accepted: at accept the front sends the keeper a
duplicate of each one's descriptor (``hold``), and takes it back when it
closes the connection (``drop``). When the front dies, the kernel keeps every
connection open, because the keeper's copy is still open; the client sees
nothing but a pause. The next front asks for them (``adopt``), gets a copy of
each, and finishes what its predecessor left, from the predecessor's record
of each connection (``understudy.front.connlog``). A keeper whose front does
not come back within ``hold_s`` closes them: those clients see the close.

One ``SOCK_SEQPACKET`` Unix socket, ``conns.sock`` in the pod's run
directory: each message is one small JSON object, and a descriptor rides on
the message it belongs to (a stream socket could merge two messages and
their descriptors). The front speaks first; the keeper speaks only to
answer ``adopt``:

- front → keeper: ``{"op": "hold", "id": ID}`` with the descriptor;
  ``{"op": "drop", "id": ID}``; ``{"op": "adopt"}``;
- keeper → front: ``{"op": "held", "id": ID}`` with a descriptor, one per
  connection kept, then ``{"op": "adopted", "count": N}``.

The keeper serves one front at a time, in the order they connected: it
reads a dead front's last messages (its socket's queue outlives it) before
it answers the next front's ``adopt``, so a connection accepted just before
a death is in the answer.

Its messages are checked by hand (``decode``), not by pydantic models: as
``handover``, this module is imported by a restarting front before it
accepts, where every millisecond of import is its clients' wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from understudy.wire import failpoints, uds
from understudy.wire.framing import RemoteFrameError
from understudy.wire.obs import log_event

CONNS_SOCKET = "conns.sock"
MAX_MESSAGE = 256
HOLD_S = 30.0  # a front that does not come back within this: its clients see the close
# The keeper reads a previous front's last messages for at most PREVIOUS_S
# before it answers the next front's ``adopt``; that front waits ADOPT_S for
# the answer, well beyond (equal waits would race, and a front that gave up
# would leave the connections it was sent held by nobody's front).
PREVIOUS_S = 3.0
ADOPT_S = 10.0
MAX_HELD = 65536
_RECONNECT_S = 0.05
_RECONNECT_TRIES = 200  # 10 s of them
_RECONNECT_MAX_S = 2.0
_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_OPS = frozenset({"hold", "drop", "adopt", "held", "adopted"})


class HoldError(ValueError):
    """A message that breaks the protocol."""


def encode(op: str, **fields: Any) -> bytes:
    return json.dumps({"op": op, **fields}, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    """A message, checked: a known op, and an id of the allowed shape where one goes."""
    try:
        msg = json.loads(data)
    except ValueError:
        raise HoldError(f"not JSON: {data[:80]!r}") from None
    if not isinstance(msg, dict) or msg.get("op") not in _OPS:
        raise HoldError(f"not a message: {data[:80]!r}")
    if msg["op"] in ("hold", "drop", "held"):
        cid = msg.get("id")
        if not isinstance(cid, str) or not _ID.fullmatch(cid):
            raise HoldError(f"bad connection id: {cid!r}")
    if msg["op"] == "adopted" and not isinstance(msg.get("count"), int):
        raise HoldError("adopted without a count")
    return msg


# ------------------------------------------------------------ the keeper --


class Keeper:
    """The lock server's side: holds the copies, answers ``adopt``, and
    closes them when no front came back within ``hold_s``."""

    def __init__(self, path: Path, log: logging.Logger, hold_s: float = HOLD_S) -> None:
        self.path = path
        self.hold_s = hold_s
        self.held: dict[str, uds.OwnedFd] = {}
        # Each held socket's inode: a front's witness (``understudy.front.witness``)
        # gives every connection of a dead front's table, held or not, under
        # ids of its own; a connection is kept once.
        self._by_inode: dict[int, str] = {}
        self._inode: dict[str, int] = {}
        self._log = log
        self._fronts = 0  # connected
        self._previous: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None

    async def serve_forever(self) -> None:
        server = uds.bind_unix(self.path, mode=0o660, backlog=16, kind=socket.SOCK_SEQPACKET)
        loop = asyncio.get_running_loop()
        sessions: set[asyncio.Task[None]] = set()
        try:
            while True:
                conn, _ = await loop.sock_accept(server)
                conn.setblocking(False)
                self._previous = asyncio.create_task(self._front(conn, self._previous))
                sessions.add(self._previous)
                self._previous.add_done_callback(sessions.discard)
        finally:
            for task in sessions:
                task.cancel()
            server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.close_all("keeper stopped")

    async def _front(self, conn: socket.socket, previous: asyncio.Task[None] | None) -> None:
        """One front's session: after the previous front's, its messages in order."""
        self._fronts += 1
        self._cancel_expiry()
        cred = uds.peer_credentials(conn)
        try:
            if previous is not None:
                # Its socket is closed (it died) or about to be: read it to the end.
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(previous), PREVIOUS_S)
            while True:
                try:
                    data, owned = await uds.sock_recv_with_fd(conn, MAX_MESSAGE)
                except (ConnectionError, RemoteFrameError) as exc:
                    log_event(self._log, "conns_front_error", logging.WARNING, error=str(exc))
                    return
                if not data:
                    return  # the front closed (or died)
                try:
                    await self._message(conn, decode(data), owned)
                except HoldError as exc:
                    log_event(self._log, "conns_bad_message", logging.WARNING, error=str(exc))
                finally:
                    if owned is not None:
                        owned.close()  # ours were detached into ``held``
        finally:
            conn.close()
            self._fronts -= 1
            if not self._fronts and self.held:
                loop = asyncio.get_running_loop()
                self._expiry = loop.call_later(self.hold_s, self._expire)
                log_event(
                    self._log, "conns_holding", count=len(self.held), hold_s=self.hold_s,
                    front=str(cred),
                )  # fmt: skip

    async def _message(
        self, conn: socket.socket, msg: dict[str, Any], owned: uds.OwnedFd | None
    ) -> None:
        op = msg["op"]
        if op == "hold":
            if owned is None:
                raise HoldError("hold without a descriptor")
            if len(self.held) >= MAX_HELD and msg["id"] not in self.held:
                raise HoldError(f"more than {MAX_HELD} connections held")
            inode = os.fstat(owned.fd).st_ino
            if self._by_inode.get(inode, msg["id"]) != msg["id"]:
                return  # held already, under its front's id
            self._release(msg["id"])
            self.held[msg["id"]] = uds.OwnedFd(owned.detach())
            self._by_inode[inode] = msg["id"]
            self._inode[msg["id"]] = inode
        elif op == "drop":
            self._release(msg["id"])
        elif op == "adopt":
            for cid, owned_fd in list(self.held.items()):
                await uds.sock_send_frame(conn, encode("held", id=cid), owned_fd.fd)
            await uds.sock_send_frame(conn, encode("adopted", count=len(self.held)))
            log_event(self._log, "conns_adopted", count=len(self.held))
        else:
            raise HoldError(f"{op} is the keeper's to send")

    def _release(self, cid: str) -> None:
        gone = self.held.pop(cid, None)
        if gone is not None:
            del self._by_inode[self._inode.pop(cid)]
            gone.close()

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        self._expiry = None
        if not self._fronts:
            self.close_all(f"no front came back within {self.hold_s}s")

    def close_all(self, why: str) -> None:
        if self.held:
            log_event(self._log, "conns_closed", logging.WARNING, count=len(self.held), why=why)
        for owned in self.held.values():
            owned.close()
        self.held.clear()
        self._by_inode.clear()
        self._inode.clear()


# ------------------------------------------------------------- the front --


class Holder:
    """The front's side: ``hold`` and ``drop`` without waiting (queued while
    the keeper is slow, or restarting), ``adopt`` once at start. A keeper
    that restarts lost its copies: once it is back, every connection open
    here is held again (``live``), then the holds that waited."""

    def __init__(self, path: Path, log: logging.Logger) -> None:
        self.path = path
        self._log = log
        self._sock: socket.socket | None = None
        # In order: (message, a copy of its descriptor, taken when it was queued)
        self._pending: deque[tuple[bytes, int | None]] = deque()
        self._writing = False
        self._task: asyncio.Task[None] | None = None
        # What to hold again after the keeper restarted: (id, fd) of every
        # connection open now (the front's).
        self.live: Callable[[], Iterable[tuple[str, int]]] = lambda: ()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, timeout: float = 1.0) -> bool:
        self._sock = _dial(self.path, timeout)
        return self._sock is not None

    def adopt(self, timeout: float = ADOPT_S) -> list[tuple[str, uds.OwnedFd]]:
        """Every connection the keeper holds, each as a new descriptor here
        (blocking: called once, before this front serves; ``watch`` next).
        No ``adopted`` within ``timeout``: TimeoutError, never a part."""
        assert self._sock is not None
        got: list[tuple[str, uds.OwnedFd]] = []
        deadline = time.monotonic() + timeout
        try:
            self._sock.settimeout(timeout)
            self._sock.sendmsg([encode("adopt")])
            while True:
                self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
                data, owned = _recv(self._sock)
                msg = decode(data)
                if msg["op"] == "adopted":
                    return got
                if msg["op"] == "held" and owned is not None:
                    got.append((msg["id"], owned))
                elif owned is not None:
                    owned.close()
        except BaseException:
            for _, owned in got:
                owned.close()
            raise

    def watch(self) -> None:
        """The keeper never speaks unasked: anything readable is its end."""
        assert self._sock is not None
        self._sock.setblocking(False)
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._readable)

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(exc)
            return
        self._lost(ConnectionResetError("the keeper closed" if not data else "the keeper spoke"))

    def hold(self, cid: str, fd: int) -> None:
        self._send(encode("hold", id=cid), fd)

    def drop(self, cid: str) -> None:
        self._send(encode("drop", id=cid), None)

    def _send(self, data: bytes, fd: int | None) -> None:
        if self._sock is None:
            return  # every connection open then is held when the keeper is back
        if self._pending or failpoints.hit("conns.hold.queued"):
            # Behind what waits. A copy of the descriptor is taken now: the
            # connection may close meanwhile.
            self._pending.append((data, None if fd is None else os.dup(fd)))
            return
        try:
            self._sock.sendmsg([data], [] if fd is None else [uds.rights(fd)])
        except (BlockingIOError, InterruptedError):
            self._pending.append((data, None if fd is None else os.dup(fd)))
            self._wait_writable()
        except OSError as exc:
            self._lost(exc)

    def _wait_writable(self) -> None:
        if self._writing or self._sock is None:
            return
        self._writing = True
        asyncio.get_running_loop().add_writer(self._sock.fileno(), self._flush)

    def _flush(self) -> None:
        while self._pending and self._sock is not None:
            data, fd = self._pending[0]
            try:
                self._sock.sendmsg([data], [] if fd is None else [uds.rights(fd)])
            except (BlockingIOError, InterruptedError):
                self._wait_writable()
                return
            except OSError as exc:
                self._lost(exc)
                return
            self._pending.popleft()
            if fd is not None:
                os.close(fd)
        self._stop_writing()

    def _stop_writing(self) -> None:
        if self._writing and self._sock is not None:
            asyncio.get_running_loop().remove_writer(self._sock.fileno())
        self._writing = False

    def _lost(self, exc: OSError) -> None:
        """The keeper went away (it restarts in place): reconnect, then hold
        every connection open then (a new keeper has none of them)."""
        if self._sock is None:
            return
        log_event(self._log, "conns_keeper_lost", logging.WARNING, error=str(exc))
        self._stop_writing()
        asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        self._discard_pending()
        self.keep_trying()

    def keep_trying(self) -> None:
        """Not connected (the keeper is not up yet, or restarts): connect as
        soon as it is, then hold every connection open."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._reconnect(), name="conns-reconnect"
            )

    async def _reconnect(self) -> None:
        # Until a keeper took every hold: one that dies while it is sent them
        # (the lock server restarting twice within milliseconds) ends its
        # socket here, in this very task (``_send`` → ``_lost``), where
        # ``keep_trying`` cannot start another.
        while self._sock is None:
            for n in itertools.count():  # the keeper restarts in place: it comes back
                # Dialled in a thread, but taken here, in the loop: a hold sent
                # meanwhile sees no socket and is left to ``live`` below, never
                # half-sent to a socket this task has not watched yet.
                sock = await asyncio.to_thread(_dial, self.path, 1.0)
                if sock is not None:
                    break
                # Often while a restart takes (what is accepted meanwhile is
                # held once it is back), then seldom: a pod whose lock server
                # keeps nothing.
                await asyncio.sleep(_RECONNECT_S if n < _RECONNECT_TRIES else _RECONNECT_MAX_S)
            self._sock = sock
            self.watch()
            live = list(self.live())
            for cid, fd in live:
                self.hold(cid, fd)
            if self._sock is not None:
                log_event(self._log, "conns_keeper_back", held_again=len(live))

    def _discard_pending(self) -> None:
        for _, fd in self._pending:
            if fd is not None:
                os.close(fd)
        self._pending.clear()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._stop_writing()
        self._discard_pending()
        if self._sock is not None:
            with contextlib.suppress(ValueError, RuntimeError):  # no loop, or never watched
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None


def _dial(path: Path, timeout: float) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def _recv(sock: socket.socket) -> tuple[bytes, uds.OwnedFd | None]:
    data, anc, flags, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(4))
    fds = uds.fds_from(anc)
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or len(fds) > 1:
        for fd in fds:
            os.close(fd)
        raise HoldError("a truncated message, or more than one descriptor")
    if not data:
        raise ConnectionResetError("the keeper closed the connection")
    return data, (uds.OwnedFd(fds[0]) if fds else None)
