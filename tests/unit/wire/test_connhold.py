"""The connections' keeper and the front's side of it (``wire.connhold``), on
real Unix sockets with real descriptors: a connection held by a front that
then goes away is still open, the next front adopts it, a dropped one is
closed, and a front that never comes back has its connections closed."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from procs import shm_dir

from understudy.wire import connhold
from understudy.wire.connhold import Holder, HoldError, Keeper, decode, encode

log = logging.getLogger("test")


@asynccontextmanager
async def keeper(hold_s: float = 30.0) -> AsyncIterator[Keeper]:
    with shm_dir() as run:
        async with _keeper(run, hold_s) as k:
            yield k


@asynccontextmanager
async def _keeper(run: Path, hold_s: float) -> AsyncIterator[Keeper]:
    k = Keeper(run / connhold.CONNS_SOCKET, log, hold_s)
    task = asyncio.create_task(k.serve_forever())
    for _ in range(100):
        if k.path.exists():
            break
        await asyncio.sleep(0.01)
    try:
        yield k
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _front(k: Keeper) -> Holder:
    h = Holder(k.path, log)
    assert await asyncio.to_thread(h.connect)
    return h


async def _adopt(h: Holder) -> list[tuple[str, object]]:
    got = await asyncio.to_thread(h.adopt)  # the keeper answers from this loop
    h.watch()
    return got  # type: ignore[return-value]


async def _settle(cond: object, within: float = 2.0) -> None:
    for _ in range(int(within / 0.01)):
        if callable(cond) and cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not settled")


def _peer_sees_eof(peer: socket.socket) -> bool:
    peer.setblocking(False)
    try:
        return peer.recv(1) == b""
    except BlockingIOError:
        return False


def test_a_held_connection_outlives_its_front_and_the_next_front_adopts_it() -> None:
    async def run() -> None:
        async with keeper() as k:
            a, a_peer = socket.socketpair()
            b, b_peer = socket.socketpair()
            first = await _front(k)
            assert await _adopt(first) == []
            first.hold("c-1", a.fileno())
            first.hold("c-2", b.fileno())
            first.drop("c-2")
            await _settle(lambda: set(k.held) == {"c-1"})
            b.close()  # the front's own copy: with the keeper's dropped, closed
            assert _peer_sees_eof(b_peer)
            first.close()
            a.close()  # the front dies: its descriptors go with it
            assert not _peer_sees_eof(a_peer)  # the keeper's copy keeps it open
            second = await _front(k)
            adopted = await _adopt(second)
            assert [cid for cid, _ in adopted] == ["c-1"]
            ((_, owned),) = adopted
            with socket.socket(fileno=owned.detach()) as again:
                again.sendall(b"still here")
                a_peer.setblocking(True)
                assert a_peer.recv(100) == b"still here"
            second.close()
            a_peer.close()
            b_peer.close()

    asyncio.run(run())


def test_a_connection_held_under_two_ids_is_kept_once() -> None:
    """A front's witness gives every connection of the dead front's table,
    the held ones included, under ids of its own: the keeper compares the
    sockets themselves (their inodes), and keeps each one once, under the
    id it was held by first. A drop lets the socket be held again."""

    async def run() -> None:
        async with keeper() as k:
            a, a_peer = socket.socketpair()
            b, b_peer = socket.socketpair()
            front = await _front(k)
            await _adopt(front)
            front.hold("c-1", a.fileno())
            dup = os.dup(a.fileno())
            front.hold("w1-7", dup)  # the same socket, another descriptor
            front.hold("w1-8", b.fileno())  # one the front never held
            await _settle(lambda: set(k.held) == {"c-1", "w1-8"})
            front.drop("c-1")
            front.hold("w1-7", a.fileno())
            await _settle(lambda: set(k.held) == {"w1-7", "w1-8"})
            front.close()
            os.close(dup)
            for s in (a, a_peer, b, b_peer):
                s.close()

    asyncio.run(run())


def test_a_front_that_never_comes_back_has_its_connections_closed() -> None:
    async def run() -> None:
        async with keeper(hold_s=0.2) as k:
            a, a_peer = socket.socketpair()
            front = await _front(k)
            await _adopt(front)
            front.hold("c-1", a.fileno())
            await _settle(lambda: "c-1" in k.held)
            front.close()
            a.close()
            await _settle(lambda: not k.held)
            assert _peer_sees_eof(a_peer)
            a_peer.close()

    asyncio.run(run())


def test_a_keeper_that_restarts_is_given_every_open_connection_again(shm_path: Path) -> None:
    async def run() -> None:
        run_dir = shm_path
        a, a_peer = socket.socketpair()
        k1 = Keeper(run_dir / connhold.CONNS_SOCKET, log)
        t1 = asyncio.create_task(k1.serve_forever())
        await _settle(k1.path.exists)
        front = Holder(k1.path, log)
        assert await asyncio.to_thread(front.connect)
        await _adopt(front)
        front.live = lambda: [("c-1", a.fileno())]
        t1.cancel()  # the lock server dies: its copies with it
        await asyncio.gather(t1, return_exceptions=True)
        await _settle(lambda: not front.connected)
        k2 = Keeper(run_dir / connhold.CONNS_SOCKET, log)
        t2 = asyncio.create_task(k2.serve_forever())
        await _settle(lambda: "c-1" in k2.held, 5.0)
        front.close()
        t2.cancel()
        await asyncio.gather(t2, return_exceptions=True)
        a.close()
        a_peer.close()

    asyncio.run(run())


def test_bad_messages_are_refused_and_the_session_goes_on() -> None:
    async def run() -> None:
        async with keeper() as k:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(str(k.path))
            for bad in (b"nonsense", encode("hold", id="../x"), encode("held", id="c")):
                s.sendmsg([bad])
            s.sendmsg([encode("hold", id="no-fd")])  # a hold without its descriptor
            s.sendmsg([encode("adopt")])
            s.setblocking(False)
            loop = asyncio.get_running_loop()
            reply = await asyncio.wait_for(loop.sock_recv(s, 256), 2)
            assert decode(reply) == {"op": "adopted", "count": 0}
            assert not k.held
            s.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    "data",
    [b"[]", b'{"op": "steal"}', encode("drop", id=""), encode("adopted")],
)
def test_decode_refuses_what_is_not_a_message(data: bytes) -> None:
    with pytest.raises(HoldError):
        decode(data)


def test_a_keeper_busy_with_a_live_previous_front_answers_adopt_within_the_fronts_wait() -> None:
    """The keeper reads a previous front that has not gone (alive, silent) for
    PREVIOUS_S, then answers the next front's ``adopt``, which waits longer
    (ADOPT_S): the held connection is adopted, not lost to a timeout."""

    async def run() -> None:
        assert connhold.PREVIOUS_S < connhold.ADOPT_S
        async with keeper() as k:
            a, _a_peer = socket.socketpair()
            first = await _front(k)
            assert await _adopt(first) == []
            first.hold("c-1", a.fileno())
            await _settle(lambda: set(k.held) == {"c-1"})
            second = await _front(k)  # the first has not gone
            t0 = asyncio.get_running_loop().time()
            got = await _adopt(second)
            waited = asyncio.get_running_loop().time() - t0
            assert [cid for cid, _ in got] == ["c-1"]
            assert connhold.PREVIOUS_S - 0.1 < waited < connhold.ADOPT_S
            first.close()
            second.close()

    asyncio.run(run())


def test_adopt_without_an_answer_raises_and_keeps_no_part(shm_path: Path) -> None:
    """A keeper that never answers: TimeoutError at the deadline, no list of
    what came before it."""
    run_dir = shm_path
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(run_dir / connhold.CONNS_SOCKET))
    server.listen(1)
    h = Holder(run_dir / connhold.CONNS_SOCKET, log)
    assert h.connect()
    conn, _ = server.accept()
    with pytest.raises(TimeoutError):
        h.adopt(timeout=0.2)
    h.close()
    conn.close()
    server.close()


def test_a_keeper_that_dies_while_it_is_given_them_again_is_redialled(shm_path: Path) -> None:
    """The lock server restarts twice within milliseconds: the keeper the
    front reconnected to closes before it took the holds. The front dials
    again, and the next keeper gets every open connection."""

    async def run() -> None:
        run_dir = shm_path
        path = run_dir / connhold.CONNS_SOCKET
        a, a_peer = socket.socketpair()
        short = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        short.bind(str(path))
        short.listen(1)
        k2 = Keeper(path, log)
        tasks: list[asyncio.Task[None]] = []

        def live() -> list[tuple[str, int]]:
            if not tasks:  # the first keeper dies now, before a hold reaches it
                conn, _ = short.accept()
                conn.close()
                short.close()
                path.unlink()
                tasks.append(asyncio.create_task(k2.serve_forever()))
            return [("c-1", a.fileno())]

        front = Holder(path, log)
        front.live = live
        front.keep_trying()
        await _settle(lambda: "c-1" in k2.held, 5.0)
        front.close()
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        a.close()
        a_peer.close()

    asyncio.run(run())
