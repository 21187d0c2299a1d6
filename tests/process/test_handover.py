"""The serving socket's handover and the front's ledger, with real sockets and
descriptors (no pod): what ``understudy.wire.handover`` promises."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.front.ledger import Ledger
from understudy.wire import handover, uds
from understudy.wire.framing import encode
from understudy.wire.handover import HandoverError, Offer

pytestmark = pytest.mark.process

log = logging.getLogger("test")


@contextlib.contextmanager
def offering(path: Path, listener: socket.socket | None, offer: Offer) -> Iterator[None]:
    """``offer_forever`` on its own loop, in a thread, until the block ends."""
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def main() -> None:
        task = asyncio.ensure_future(
            handover.offer_forever(path, lambda: listener, lambda: offer, log)
        )
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    started.wait(5)
    for _ in range(200):
        if path.exists():
            break
        threading.Event().wait(0.01)
    try:
        yield
    finally:
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        thread.join(5)
        loop.close()


def test_an_offer_reads_back_and_junk_is_refused():
    o = Offer(8000, "lockserver", 42, "engine-primary/aa", 7)
    assert Offer.decode(o.encode()) == o
    for junk in (b"", b"{", b"[]", b'{"port": 1}', b'{"port": -1, "keeper": "x", "pid": 1, '
                 b'"holder": null, "epoch": 0}'):  # fmt: skip
        with pytest.raises(HandoverError):
            Offer.decode(junk)


def test_the_socket_handed_over_is_the_same_socket(tmp_path):
    """A connection made after the handover waits in the one queue both
    processes hold: either side can accept it."""
    listener = handover.bind_serving("127.0.0.1", 0)
    port = listener.getsockname()[1]
    path = tmp_path / handover.KEEPER_SOCKET
    with offering(path, listener, Offer(port, "lockserver", os.getpid(), "e/1", 3)):
        # The keeper's socket file exists from its bind, before its listen:
        # a connect in between is refused (None), as CI met once. Ask again.
        got = None
        for _ in range(250):
            got = handover.fetch(path, port)
            if got is not None:
                break
            threading.Event().wait(0.02)
    assert got is not None
    mine, offer = got
    assert offer == Offer(port, "lockserver", os.getpid(), "e/1", 3)
    assert mine.fileno() != listener.fileno()
    listener.close()  # the keeper's copy gone: the queue lives on in ours
    client = socket.create_connection(("127.0.0.1", port), timeout=2)
    mine.setblocking(True)
    mine.settimeout(2)
    conn, _ = mine.accept()
    client.sendall(b"x")
    assert conn.recv(1) == b"x"
    for s in (conn, client, mine):
        s.close()


def test_nobody_to_ask_is_none_and_bind_is_the_fallback(tmp_path):
    assert handover.fetch(tmp_path / "nope.sock", 1234) is None
    sock, offer, source = handover.obtain([tmp_path / "nope.sock"], "127.0.0.1", 0)
    assert (offer, source) == (None, "bound")
    handover.check_listener(sock, sock.getsockname()[1])
    sock.close()


def test_a_port_taken_but_not_offered_raises_address_in_use(tmp_path):
    taken = handover.bind_serving("127.0.0.1", 0)
    port = taken.getsockname()[1]
    with pytest.raises(OSError) as info:
        handover.obtain([tmp_path / "nope.sock"], "127.0.0.1", port)
    assert handover.in_use(info.value)
    taken.close()


def test_what_is_not_the_listening_socket_is_refused(tmp_path):
    listener = handover.bind_serving("127.0.0.1", 0)
    port = listener.getsockname()[1]
    with pytest.raises(HandoverError, match="not 1"):  # another port
        handover.check_listener(listener, 1)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with pytest.raises(HandoverError, match="not a TCP socket"):
        handover.check_listener(udp, port)
    idle = socket.socket()
    idle.bind(("127.0.0.1", 0))
    with pytest.raises(HandoverError, match="does not listen"):
        handover.check_listener(idle, idle.getsockname()[1])
    # A holder that sends some other descriptor, or none: refused, and closed.
    path = tmp_path / "bad.sock"
    server = uds.bind_unix(path)
    server.setblocking(True)

    def answer(fd: int | None) -> None:
        conn, _ = server.accept()
        uds.send_frame(conn, encode(Offer(port, "x", 1).encode()), fd)
        conn.close()

    for fd, why in ((udp.fileno(), "not a TCP socket"), (None, "no descriptor")):
        t = threading.Thread(target=answer, args=(fd,))
        t.start()
        with pytest.raises(HandoverError, match=why):
            handover.fetch(path, port)
        t.join()
    for s in (server, udp, idle, listener):
        s.close()


def test_an_empty_keeper_closes_unanswered(tmp_path):
    path = tmp_path / handover.KEEPER_SOCKET
    with offering(path, None, Offer(1, "lockserver", 1)):
        assert handover.fetch(path, 1) is None


def test_the_ledger_hands_the_busy_count_to_the_next_front(tmp_path):
    path = tmp_path / "front.ledger"
    first = Ledger(path)
    before = first.take_over()
    assert (before.pid, before.busy, first.lost, first.starts) == (0, 0, 0, 1)
    first.busy(3, 1)
    first.busy(5, 2)
    first.close()  # as a kill -9 leaves it: the last count stays in the page
    second = Ledger(path)
    before = second.take_over()
    assert (before.busy, before.idle, before.torn) == (5, 2, False)
    assert (second.lost, second.idle_lost, second.starts) == (5, 2, 2)
    second.busy(0, 0)  # a clean exit: nothing in flight
    second.close()
    third = Ledger(path)
    third.take_over()
    assert (third.lost, third.idle_lost, third.starts) == (5, 2, 3)
    third.close()
