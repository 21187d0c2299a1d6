"""A connection's record (``front.connlog``): what the next front reads back,
and how it finishes the connection, on real files and real TCP sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.front import connlog, downstream
from understudy.front.connlog import ConnLog, LogError, kernel_count, kernel_read, parse, plan

REQUEST = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _reread(record: ConnLog) -> tuple[int, list[tuple[bytes, bytes]]]:
    _, tx_base, records = ConnLog.reopen(record.path.parent, record.cid)
    return tx_base, records


def test_a_stream_under_way_is_resumed_after_the_ended_exchanges(tmp_path: Path) -> None:
    r = ConnLog.create(tmp_path, "c-1")
    r.received(REQUEST + REQUEST[:20])  # one request whole, the next begun
    r.wrote(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", connlog.F)
    r.received(REQUEST[20:])
    r.opened({"request_id": "cmpl-1", "created": 7}, HEAD)
    r.event([5, 6], _chunk(b"data: a\n\n"))
    r.event([], _chunk(b"data: b\n\n"))
    r.event([9], _chunk(b"data: c\n\n"))
    tx_base, records = _reread(r)
    written = sum(len(connlog.tx_bytes(k, p)) for k, p in records)
    p = plan(tx_base, records, written)  # the kernel took everything
    assert p.rx == REQUEST + REQUEST
    assert p.done == 1 and p.tail == b"" and not p.refused
    assert p.stream == connlog.Stream({"request_id": "cmpl-1", "created": 7}, (5, 6, 9), True)


def test_the_bytes_the_kernel_never_took_are_the_tail(tmp_path: Path) -> None:
    r = ConnLog.create(tmp_path, "c-2")
    r.received(REQUEST)
    r.opened({"request_id": "x", "created": 1}, HEAD)
    r.event([1], _chunk(b"data: one\n\n"))
    tx_base, records = _reread(r)
    p = plan(tx_base, records, len(HEAD) + 3)
    assert p.tail == (HEAD + _chunk(b"data: one\n\n"))[len(HEAD) + 3 :]
    # head only, no event yet: resumed from its first token, not started
    r2 = ConnLog.create(tmp_path, "c-3")
    r2.received(REQUEST)
    r2.opened({"request_id": "y", "created": 2}, HEAD)
    tx_base, records = _reread(r2)
    assert plan(tx_base, records, len(HEAD)).stream == connlog.Stream(
        {"request_id": "y", "created": 2}, (), False
    )


def test_compaction_leaves_an_idle_connection_with_its_base(tmp_path: Path) -> None:
    r = ConnLog.create(tmp_path, "c-4")
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    for _ in range(3):
        r.received(REQUEST)
        r.wrote(answer, connlog.F)
        r.compact()
    assert r.idle
    tx_base, records = _reread(r)
    assert (tx_base, records) == (3 * len(answer), [])
    p = plan(tx_base, records, 3 * len(answer))
    assert (p.rx, p.done, p.tail, p.stream) == (b"", 0, b"", None)
    with pytest.raises(LogError, match="fewer than"):
        plan(tx_base, records, 10)  # a socket that took less than went before: not ours


def test_a_torn_last_record_is_left_out_and_cut(tmp_path: Path) -> None:
    r = ConnLog.create(tmp_path, "c-5")
    r.received(REQUEST)
    r.wrote(b"HTTP/1.1 200 OK\r\n", connlog.W)
    whole = r.path.stat().st_size
    os.truncate(r.path, whole - 3)  # its writer died in the middle of it
    _, records = _reread(r)
    assert records == [(connlog.R, REQUEST)]
    assert r.path.stat().st_size < whole - 3  # cut back to the last whole record


@pytest.mark.parametrize("size", [0, 10])
def test_a_record_whose_front_died_before_its_header_starts_again(
    tmp_path: Path, size: int
) -> None:
    """Killed between the file and its header (CI's empty record): nothing
    went either way, and the next front goes on writing it as new."""
    (tmp_path / "c-h").write_bytes(connlog.MAGIC[: min(size, 4)] + bytes(max(size - 4, 0)))
    r, tx_base, records = ConnLog.reopen(tmp_path, "c-h", inode=77)
    assert (tx_base, records, r.inode, r.idle) == (0, [], 77, True)
    r.received(REQUEST)
    assert _reread(r) == (0, [(connlog.R, REQUEST)])
    assert plan(0, [], 0, read=0) == plan(0, [], 0)  # nothing to skip, nothing owed


def test_a_record_names_its_socket_whatever_its_id(tmp_path: Path) -> None:
    with socket.socket() as s:
        inode = os.fstat(s.fileno()).st_ino
        ConnLog.create(tmp_path, "a-1", inode + 1).received(b"other")
        ConnLog.create(tmp_path, "a-2", inode).received(REQUEST)
        ConnLog.create(tmp_path, "a-3")  # not said
        (tmp_path / "junk").write_bytes(b"xy")
        names = ["junk", "a-3", "a-1", "a-2", "gone"]
        assert connlog.inodes(tmp_path, names) == {inode: "a-2", inode + 1: "a-1"}
        r = ConnLog.reopen(tmp_path, "a-2")[0]
        r.compact()  # the header keeps it
        assert connlog.inodes(tmp_path, ["a-2"]) == {inode: "a-2"}


def test_a_refusal_is_written_again_never_answered_twice(tmp_path: Path) -> None:
    r = ConnLog.create(tmp_path, "c-6")
    r.received(b"NOT HTTP\r\n\r\n")
    r.wrote(b"HTTP/1.1 400 Bad Request\r\n\r\n", connlog.X)
    tx_base, records = _reread(r)
    assert plan(tx_base, records, 0).refused


@pytest.mark.parametrize(
    "data",
    [b"", b"XXXX" + bytes(20), b"USC2" + bytes(20) + b"Z\x01\x00\x00\x00z"],
    ids=["empty", "magic", "kind"],
)
def test_what_is_not_a_record_is_refused(data: bytes) -> None:
    with pytest.raises(LogError):
        parse(data)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("RWVF"), st.binary(max_size=40), st.lists(st.integers(0, 2**31))),
        max_size=12,
    )
)
def test_records_read_back_as_written(tmp_path_factory: pytest.TempPathFactory, ops: list) -> None:
    d = tmp_path_factory.mktemp("rec")
    r = ConnLog.create(d, "h")
    written = []
    for kind, data, ids in ops:
        if kind == "R":
            r.received(data)
        elif kind == "V":
            r.event(ids, data)
        else:
            r.wrote(data, kind.encode())
        written.append((kind, data))
    _, _, records = ConnLog.reopen(d, "h")
    assert [(k.decode(), connlog.tx_bytes(k, p) if k != connlog.R else p) for k, p in records] == (
        written
    )


# ------------------------------------------------------------ real sockets --


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        server, _ = srv.accept()
    return server, client


def test_the_kernel_count_is_what_the_socket_took() -> None:
    server, client = _pair()
    with server, client:
        assert kernel_count(server) == 0
        server.sendall(b"x" * 1000)
        time.sleep(0.05)
        assert kernel_count(server) == 1000  # acked
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        server.setblocking(False)
        sent = 1000
        with pytest.raises(BlockingIOError):  # the client reads nothing: its queues fill
            while True:
                sent += server.send(b"y" * 65536)
        assert kernel_count(server) == sent  # acked, plus still queued


def test_an_adopted_connection_gets_the_tail_then_the_next_answer(tmp_path: Path) -> None:
    """The dead front wrote down a whole answer but the kernel took only
    part of it; then the client's next request, already read. The adopted
    connection writes the rest of the first answer, none of it twice, and
    answers the second."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"
    server, client = _pair()
    record = ConnLog.create(tmp_path, "c-7")
    second = b"GET /two HTTP/1.1\r\n\r\n"
    record.received(b"GET /one HTTP/1.1\r\n\r\n" + second)
    record.wrote(answer, connlog.F)
    server.sendall(answer[:10])  # the dead front's write, cut short
    time.sleep(0.05)
    tx_base, records = _reread(record)
    p = plan(tx_base, records, kernel_count(server))
    assert p.tail == answer[10:] and p.done == 1

    async def adopt() -> bytes:
        def handle(ex: downstream.Exchange) -> None:
            ex.answer(200, [], ex.target)

        srv = downstream.Server(handle, downstream.Limits())
        srv.adopt(server, record, p)
        got = b""
        loop = asyncio.get_running_loop()
        client.setblocking(False)
        while not got.endswith(b"/two"):
            got += await loop.sock_recv(client, 4096)
        srv.close()
        return got

    got = asyncio.run(adopt())
    client.close()
    assert got.startswith(answer)  # the first answer whole, once
    assert got.count(b"first") == 1 and got.endswith(b"Content-Length: 4\r\n\r\n/two")


def test_an_answered_request_that_closes_its_connection_is_closed_on_adoption(
    tmp_path: Path,
) -> None:
    """HTTP/1.0 without keep-alive, answered whole by the front that died
    before it closed the connection: the next front closes it, and serves
    nothing more on it."""
    server, client = _pair()
    record = ConnLog.create(tmp_path, "c-8")
    record.received(b"GET /one HTTP/1.0\r\n\r\n")
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\none"
    record.wrote(answer, connlog.F)
    server.sendall(answer)
    time.sleep(0.05)
    tx_base, records = _reread(record)
    p = plan(tx_base, records, kernel_count(server))

    async def adopt() -> bytes:
        srv = downstream.Server(lambda ex: ex.answer(200, [], b"again"), downstream.Limits())
        srv.adopt(server, record, p)
        loop = asyncio.get_running_loop()
        client.setblocking(False)
        got = b""
        while True:
            data = await asyncio.wait_for(loop.sock_recv(client, 4096), 5)
            if not data:
                return got
            got += data

    got = asyncio.run(adopt())
    client.close()
    assert got == answer  # once, then the close


def test_the_read_count_is_what_readers_took_from_the_socket() -> None:
    """Peeked bytes, unread bytes and the client's FIN are not counted."""
    server, client = _pair()
    with server, client:
        assert kernel_read(server) == 0
        client.sendall(b"x" * 1000)
        time.sleep(0.05)
        assert kernel_read(server) == 0  # received, not read
        assert len(server.recv(300, socket.MSG_PEEK)) == 300
        assert kernel_read(server) == 0  # a peek takes nothing
        assert len(server.recv(300)) == 300
        assert kernel_read(server) == 300
        client.shutdown(socket.SHUT_WR)  # the FIN takes a sequence number, not a byte
        time.sleep(0.05)
        assert kernel_read(server) == 300
        assert len(server.recv(2000)) == 700
        assert server.recv(10) == b""  # the end, read
        assert kernel_read(server) == 1000


def test_the_read_base_survives_a_compaction(tmp_path: Path) -> None:
    r = ConnLog.create(tmp_path, "c-10")
    r.received(REQUEST)
    r.wrote(b"HTTP/1.1 204 No Content\r\n\r\n", connlog.F)
    r.compact()
    r.received(REQUEST[:7])
    again, _, records = ConnLog.reopen(tmp_path, "c-10")
    assert (again.rx_base, again.rx) == (len(REQUEST), 7)
    assert (
        plan(again.tx_base, records, again.tx_base, rx_base=again.rx_base, read=len(REQUEST)).skip
        == 7
    )


def test_bytes_read_but_never_written_down_cannot_be_finished(tmp_path: Path) -> None:
    """A front that took bytes from the kernel and died before it wrote them
    down: the request is gone, and the next front says so."""
    server, client = _pair()
    with server, client:
        record = ConnLog.create(tmp_path, "c-11")
        client.sendall(REQUEST)
        time.sleep(0.05)
        server.recv(10)
        tx_base, records = _reread(record)
        with pytest.raises(LogError, match="10 bytes were read"):
            plan(tx_base, records, kernel_count(server), read=kernel_read(server))


def test_a_record_whose_front_died_compacting_it_takes_the_sockets_counts(
    tmp_path: Path,
) -> None:
    """Killed between ``compact``'s cut and its new header: the old bases
    and no records. The socket says more went both ways than that; the
    exchange was over (a front compacts only then), so the next front takes
    the socket's counts as the bases and owes nothing."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    server, client = _pair()
    with server, client:
        record = ConnLog.create(tmp_path, "c-14")
        header = record.path.stat().st_size
        client.sendall(REQUEST)
        time.sleep(0.05)
        record.received(server.recv(100, socket.MSG_PEEK))
        server.recv(100)
        record.wrote(answer, connlog.F)
        server.sendall(answer)
        time.sleep(0.05)
        os.truncate(record.path, header)
        reopened, tx_base, records = ConnLog.reopen(tmp_path, "c-14")
        assert (tx_base, records) == (0, [])  # the cut made, the new header not
        p = plan(tx_base, records, kernel_count(server), read=kernel_read(server))
        assert p.rebase == (len(answer), len(REQUEST))
        assert (p.rx, p.skip, p.tail, p.done, p.stream) == (b"", 0, b"", 0, None)
        reopened.rebase(*p.rebase)
        # the next exchange is planned from the socket's counts
        client.sendall(REQUEST)
        time.sleep(0.05)
        reopened.received(server.recv(100, socket.MSG_PEEK))
        again, tx_base, records = ConnLog.reopen(tmp_path, "c-14")
        p = plan(tx_base, records, kernel_count(server), rx_base=again.rx_base,
                 read=kernel_read(server))  # fmt: skip
        assert (p.rx, p.skip, p.rebase) == (REQUEST, len(REQUEST), None)
        # a record the next front made itself, finding none: nothing to go on
        with pytest.raises(LogError, match="never written down"):
            plan(0, [], kernel_count(server), read=kernel_read(server) + 1, found=False)


def test_bytes_written_down_but_still_in_the_socket_are_answered_once(tmp_path: Path) -> None:
    """The dead front peeked at a request and wrote it down, and died before
    it took it from the kernel: the next front takes it from the socket
    unread, answers the record's copy once, then what the client sends next."""
    first = b"GET /one HTTP/1.1\r\n\r\n"
    server, client = _pair()
    record = ConnLog.create(tmp_path, "c-12")
    client.sendall(first)
    time.sleep(0.05)
    record.received(server.recv(100, socket.MSG_PEEK))
    tx_base, records = _reread(record)
    p = plan(tx_base, records, kernel_count(server), rx_base=0, read=kernel_read(server))
    assert p.skip == len(first) and p.rx == first

    async def adopt() -> bytes:
        srv = downstream.Server(lambda ex: ex.answer(200, [], ex.target), downstream.Limits())
        srv.adopt(server, record, p)
        loop = asyncio.get_running_loop()
        client.setblocking(False)
        await loop.sock_sendall(client, b"GET /two HTTP/1.1\r\n\r\n")
        got = b""
        while not got.endswith(b"/two"):
            got += await asyncio.wait_for(loop.sock_recv(client, 4096), 5)
        srv.close()
        return got

    got = asyncio.run(adopt())
    client.close()
    assert got.count(b"/one") == 1 and got.count(b"/two") == 1
    assert got.index(b"/one") < got.index(b"/two")


def test_a_volume_that_refuses_what_was_read_leaves_it_served_but_not_kept(
    tmp_path: Path,
) -> None:
    """The volume refuses the record of a request (ENOSPC, from ``/dev/full``
    under the record's descriptor): the request is answered all the same,
    and the connection is no longer kept (its keeper copy dropped at once)."""
    dropped: list[str] = []

    def keep(conn: socket.socket) -> ConnLog:
        record = ConnLog.create(tmp_path, "c-13")
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, record._fd)  # every write from now on: ENOSPC
        os.close(full)
        return record

    async def run() -> bytes:
        srv = downstream.Server(lambda ex: ex.answer(200, [], ex.target), downstream.Limits())
        srv.keep = keep
        srv.on_closed = lambda record: dropped.append(record.cid)
        with socket.create_server(("127.0.0.1", 0)) as listener:
            srv.serve_on(listener, 16)
            reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            writer.write(b"GET /one HTTP/1.1\r\n\r\n")
            got = await asyncio.wait_for(reader.readuntil(b"/one"), 5)
            assert dropped == ["c-13"]  # at the failed write, not at the close
            writer.close()
            srv.close()
        return got

    assert asyncio.run(run()).startswith(b"HTTP/1.1 200 OK")
