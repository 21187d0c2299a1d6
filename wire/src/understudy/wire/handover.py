"""The pod's serving socket, handed from process to process so it outlives each one.

The front accepts the pod's connections, but it is not the only process that
holds the listening socket: the lock server keeps a copy (it binds the port
itself, from its own configuration), as systemd holds a socket-activated
service's socket and as Envoy's hot restart passes it on. When the front dies,
the socket lives on in the keeper: new connections wait in its accept queue
(the kernel's backlog) instead of being refused, and the restarted front asks
for the socket and accepts them.

Asking is connecting: a process connects to a holder's Unix socket, and the
holder sends one frame (an :class:`Offer`, JSON) with the listening socket's
descriptor in the same ``sendmsg`` (SCM_RIGHTS), then closes. There is no
request message, so the holder reads nothing from its peers, and no server
ever receives a descriptor: the front is a client of the lock server's
``keeper.sock``; a lock server that restarts while the front holds the port
(it cannot bind it again) is a client of the front's ``front.sock``. A process
that finds nobody to ask binds the port itself.

Cheap to import (the standard library, ``framing`` and ``uds``): the front
asks for the socket before it imports anything heavy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from understudy.wire import uds
from understudy.wire.framing import encode
from understudy.wire.obs import log_event

KEEPER_SOCKET = "keeper.sock"  # the lock server's, in the pod's run directory
FRONT_SOCKET = "front.sock"  # the front's, for a keeper that restarted
MAX_OFFER = 4096
# Connections that wait while no front accepts (net.core.somaxconn caps it:
# 4096 by default since Linux 5.4).
BACKLOG = 4096


class HandoverError(Exception):
    """What was offered is not the pod's listening socket (or not an offer)."""


@dataclass(frozen=True, slots=True)
class Offer:
    """What comes with the descriptor: whose it was, and the lock's holder as
    the sender knows it, so that a restarted front can route at once."""

    port: int
    keeper: str  # "lockserver" | "front"
    pid: int
    holder: str | None = None
    epoch: int = 0

    def encode(self) -> bytes:
        return json.dumps(
            {
                "port": self.port,
                "keeper": self.keeper,
                "pid": self.pid,
                "holder": self.holder,
                "epoch": self.epoch,
            }
        ).encode()

    @classmethod
    def decode(cls, body: bytes) -> Offer:
        try:
            d = json.loads(body)
            offer = cls(d["port"], d["keeper"], d["pid"], d["holder"], d["epoch"])
        except (ValueError, KeyError, TypeError) as exc:
            raise HandoverError(f"not an offer: {exc}") from None
        ints = (offer.port, offer.pid, offer.epoch)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints):
            raise HandoverError(f"not an offer: {body[:200]!r}")
        if not isinstance(offer.keeper, str) or not (
            offer.holder is None or isinstance(offer.holder, str)
        ):
            raise HandoverError(f"not an offer: {body[:200]!r}")
        return offer


def bind_serving(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """The pod's listening socket on ``host:port`` (non-blocking, CLOEXEC)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=backlog)
    sock.setblocking(False)
    return sock


def check_listener(sock: socket.socket, port: int) -> None:
    """Raise HandoverError unless ``sock`` is a listening TCP socket on ``port``."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        raise HandoverError(f"not a TCP socket: {sock!r}")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise HandoverError("the socket does not listen")
    bound = sock.getsockname()[1]
    if bound != port:
        raise HandoverError(f"the socket listens on port {bound}, not {port}")


def fetch(path: Path, port: int, timeout: float = 2.0) -> tuple[socket.socket, Offer] | None:
    """Ask the holder at ``path`` for the listening socket on ``port``.

    None when nobody holds it there (no such socket, or nobody answers);
    HandoverError when what comes is not that socket."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        try:
            conn.connect(str(path))
            body, owned = uds.recv_frame(conn, MAX_OFFER)
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
            return None
        except TimeoutError:
            raise HandoverError(f"no offer from {path} within {timeout}s") from None
    finally:
        conn.close()
    if owned is None:
        raise HandoverError(f"{path} sent no descriptor")
    with owned:
        listener = socket.socket(fileno=owned.detach())
    try:
        offer = Offer.decode(body)
        check_listener(listener, port)
    except BaseException:
        listener.close()
        raise
    listener.setblocking(False)
    return listener, offer


def obtain(holders: list[Path], host: str, port: int) -> tuple[socket.socket, Offer | None, str]:
    """The listening socket on ``port``: from the first holder that offers it,
    else bound here. Returns the socket, the offer (None if bound here) and
    where it came from. Raises OSError (EADDRINUSE) when the port is taken
    but nobody offers it: the caller asks again a moment later."""
    for path in holders:
        got = fetch(path, port)
        if got is not None:
            return got[0], got[1], str(path)
    return bind_serving(host, port), None, "bound"


def in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE


async def offer_forever(
    path: Path,
    listener: Callable[[], socket.socket | None],
    offer: Callable[[], Offer],
    log: logging.Logger,
) -> None:
    """Offer the listening socket to every process that connects to ``path``
    (bound 0660 in the pod's run directory) until cancelled. ``listener()``
    None: nothing to offer yet (the connection is closed unanswered)."""
    server = uds.bind_unix(path, mode=0o660, backlog=64)
    loop = asyncio.get_running_loop()
    try:
        while True:
            conn, _ = await loop.sock_accept(server)
            with conn:
                sock = listener()
                cred = uds.peer_credentials(conn)
                if sock is None:
                    log_event(log, "handover_unavailable", logging.WARNING, peer=str(cred))
                    continue
                try:
                    o = offer()
                    await uds.sock_send_frame(conn, encode(o.encode(), MAX_OFFER), sock.fileno())
                except OSError as exc:  # the asker left: its loss
                    log_event(log, "handover_failed", logging.WARNING, peer=str(cred), error=exc)
                    continue
                log_event(log, "handed_over", peer=str(cred), port=o.port)
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # ours: nobody else binds it while we serve
