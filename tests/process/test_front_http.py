"""The front's two HTTP/1.1 ends over real sockets, without a pod.

``downstream``: the server clients talk to (TCP on loopback), with a small
application of the test's own as its handler. ``upstream``: the client the
front forwards with, against a small engine-like server on a Unix socket in
``tmp_path`` whose answers the test chooses byte for byte.

What aiohttp's server used to do for the front is the front's own now, so
each rule is here: pipelining in order, HTTP/1.0, ``Expect: 100-continue``,
chunked bodies, HEAD, the limits and their statuses, the idle timeout, a
departed client's task cancelled, write back-pressure; and on the upstream
side Unreachable / Stale / Broken, every body framing, and the callback path.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from understudy.front import downstream, upstream

pytestmark = [pytest.mark.process, pytest.mark.timeout(30)]

# ------------------------------------------------------------- the server --

App = Callable[[downstream.Exchange], None]


@contextlib.asynccontextmanager
async def serving(
    app: App, refused: list[int] | None = None, **limits: float
) -> AsyncIterator[int]:
    record = refused.append if refused is not None else (lambda status: None)
    server = downstream.Server(app, downstream.Limits(**limits), record)  # type: ignore[arg-type]
    port = await server.listen("127.0.0.1", 0)
    try:
        yield port
    finally:
        server.close()


def echo(ex: downstream.Exchange) -> None:
    """Answers with what it got: method, target, body and header names."""
    doc = {
        "method": ex.method.decode(),
        "target": ex.target.decode("latin-1"),
        "body": ex.body.decode("latin-1"),
        "headers": [n.decode().lower() for n, _ in ex.headers],
        "version": ex.version,
    }
    ex.answer(200, [downstream.JSON], json.dumps(doc).encode())


Answered = list[tuple[int, dict[str, str], bytes]]


async def exchange(port: int, data: bytes, answers: int = 1) -> Answered:
    """Send raw bytes, read ``answers`` answers (http.client parses them, in a thread)."""

    def run() -> Answered:
        out = []
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(data)
            stream = _Stream(s)
            for _ in range(answers):
                r = http.client.HTTPResponse(stream)  # type: ignore[arg-type]
                r.begin()
                out.append((r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()))
        return out

    return await asyncio.to_thread(run)


class _KeepOpen(io.BufferedReader):
    def close(self) -> None:
        pass  # http.client closes its reader after each answer; the next needs it


class _Stream:
    """A socket as http.client sees it, with one buffered reader for every answer."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = _KeepOpen(socket.SocketIO(sock, "rb"))

    def makefile(self, *args: object, **kwargs: object) -> io.BufferedReader:
        return self.file


async def test_pipelined_requests_are_answered_in_order() -> None:
    def app(ex: downstream.Exchange) -> None:
        if ex.target == b"/slow":

            async def later() -> None:
                await asyncio.sleep(0.2)
                echo(ex)

            ex.task = asyncio.get_running_loop().create_task(later())
        else:
            echo(ex)

    async with serving(app) as port:
        req = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /fast HTTP/1.1\r\nHost: x\r\n\r\n"
        answers = await exchange(port, req, answers=2)
    assert [json.loads(b)["target"] for _, _, b in answers] == ["/slow", "/fast"]


async def test_http_1_0_is_answered_and_closed_unless_kept_alive() -> None:
    async with serving(echo) as port:
        [(status, headers, body)] = await exchange(port, b"GET /a HTTP/1.0\r\n\r\n")
        assert status == 200 and headers["connection"] == "close"
        assert json.loads(body)["version"] == "1.0"
        answers = await exchange(
            port, b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" * 2, answers=2
        )
        assert [a[1]["connection"] for a in answers] == ["keep-alive", "keep-alive"]


async def test_nothing_after_a_connection_close_request_is_served() -> None:
    """Nor refused: what follows such a request is not one (it was counted,
    and a 400 written into the closing connection)."""
    served: list[bytes] = []
    refused: list[int] = []

    def app(ex: downstream.Exchange) -> None:
        served.append(ex.target)
        echo(ex)

    async with serving(app, refused) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        everything = await asyncio.wait_for(reader.read(), 3)  # to the server's close
        writer.close()
    assert everything.count(b"HTTP/1.1 200") == 1 and b"Connection: close" in everything
    assert served == [b"/1"] and refused == []


async def test_expect_100_continue_gets_its_interim_answer_before_the_body() -> None:
    async with serving(echo) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"body")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert json.loads(await reader.readexactly(length))["body"] == "body"
        writer.close()


async def test_a_chunked_request_body_reaches_the_handler_whole() -> None:
    async with serving(echo) as port:
        head = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        req = head + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        [(status, _, body)] = await exchange(port, req)
    assert status == 200 and json.loads(body)["body"] == "abcde"


@pytest.mark.parametrize(
    ("request_bytes", "status", "words"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n", 413, "larger than 100"),
        (b"GET /" + b"a" * 300 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "longer than 256"),
        (
            b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 600 + b"\r\n\r\n",
            431,
            "larger than 512",
        ),
        (b"GET / HTTP/1.1\r\nHost x\r\n\r\n", 400, "malformed"),
        (b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n", 405, "CONNECT"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nExpect: magic\r\n\r\n", 417, "magic"),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n"
            b"Content-Length: 2\r\n\r\n{}",
            400,
            "Upgrade",
        ),
    ],
)
async def test_requests_past_a_limit_get_their_status_and_a_reason(
    request_bytes: bytes, status: int, words: str
) -> None:
    refused: list[int] = []
    async with serving(echo, refused, max_body=100, max_target=256, max_head=512) as port:
        [(got, headers, body)] = await exchange(port, request_bytes)
        assert got == status and refused == [status]
        assert headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert words in error["message"] and error["code"] == status
        # The server is still fine for everyone else.
        assert (await exchange(port, b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"))[0][0] == 200


async def test_a_body_over_the_limit_is_refused_when_it_arrives_chunked() -> None:
    async with serving(echo, max_body=10) as port:
        chunk = b"8\r\n12345678\r\n"
        req = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 3
        [(status, _, _)] = await exchange(port, req)
    assert status == 413


async def test_an_upgrade_without_a_body_is_answered_in_http_1_1() -> None:
    async with serving(echo) as port:
        req = b"GET /u HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
        [(status, headers, body)] = await exchange(port, req)
    assert status == 200 and json.loads(body)["target"] == "/u"
    assert headers["connection"] == "close"  # the client asked for a switch: no reuse


async def test_head_gets_the_length_but_no_body() -> None:
    def app(ex: downstream.Exchange) -> None:
        ex.answer(200, [], b"", content_length=1234)

    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\nHEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(2):  # no body between the two answers
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: 1234" in head
        writer.close()


async def test_an_idle_connection_is_closed_and_a_trickled_request_gets_408() -> None:
    async with serving(echo, idle_s=0.3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 3) == b""  # closed, nothing said
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost")
        answer = await asyncio.wait_for(reader.read(), 3)
        assert answer.startswith(b"HTTP/1.1 408")
        writer.close()


async def test_a_client_that_leaves_cancels_its_request_task() -> None:
    cancelled = asyncio.Event()

    def app(ex: downstream.Exchange) -> None:
        async def forever() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                cancelled.set()

        ex.task = asyncio.get_running_loop().create_task(forever())

    async with serving(app) as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()  # its end, as a client that gives up sends
        await asyncio.wait_for(cancelled.wait(), 3)


async def test_a_handler_that_fails_gives_a_500_and_the_connection_goes_on() -> None:
    def app(ex: downstream.Exchange) -> None:
        if ex.target == b"/bug":
            raise RuntimeError("a bug")
        echo(ex)

    async with serving(app) as port:
        req = b"GET /bug HTTP/1.1\r\nHost: x\r\n\r\nGET /ok HTTP/1.1\r\nHost: x\r\n\r\n"
        answers = await exchange(port, req, answers=2)
    assert [a[0] for a in answers] == [500, 200]
    assert "RuntimeError" in json.loads(answers[0][2])["error"]["message"]


async def test_a_stream_waits_for_a_slow_reader_instead_of_buffering() -> None:
    """Write back-pressure: with a client that does not read, the stream's
    sends block once the socket buffers are full, far below what it has to say."""
    sent = 0
    finished = asyncio.Event()
    part = b"x" * 65536

    def app(ex: downstream.Exchange) -> None:
        async def stream() -> None:
            nonlocal sent
            ex.open_stream(200, [(b"Content-Type", b"text/plain")])
            for _ in range(512):  # 32 MiB
                await ex.send(part)
                sent += len(part)
            ex.end_stream()
            finished.set()

        ex.task = asyncio.get_running_loop().create_task(stream())

    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        writer.transport.pause_reading()  # type: ignore[attr-defined]
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.5)
        assert sent < 16 * 1024 * 1024, sent  # blocked, not buffered
        writer.transport.resume_reading()  # type: ignore[attr-defined]
        await reader.readuntil(b"\r\n\r\n")
        total = 0
        while True:  # the chunked body, to its end
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            total += len(data) - 2
        assert total == 512 * len(part)
        await asyncio.wait_for(finished.wait(), 5)
        writer.close()


# ----------------------------------------------------------- the upstream --

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def engine(tmp_path: Path, answer: Answer) -> AsyncIterator[str]:
    path = str(tmp_path / "engine.sock")
    server = await asyncio.start_unix_server(answer, path)
    try:
        yield path
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


def answers(*replies: bytes | None) -> Answer:
    """An engine that gives each request on a connection the next reply in
    turn; None: close the connection without a word."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for reply in replies:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            if reply is None:
                break
            writer.write(reply)
            await writer.drain()
        writer.close()

    return answer


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


async def test_no_engine_is_unreachable(tmp_path: Path) -> None:
    up = upstream.Upstream(str(tmp_path / "nobody.sock"))
    with pytest.raises(upstream.Unreachable):
        await up.request(b"GET", b"/", [], b"")


@pytest.mark.parametrize(
    ("reply", "body"),
    [
        (OK, b"ok"),
        (
            CHUNKED + b"2\r\nok\r\n1\r\n!\r\n0\r\n\r\n",
            b"ok!",
        ),
        (b"HTTP/1.1 100 Continue\r\n\r\n" + OK, b"ok"),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close", b"until close"),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
    ],
)
async def test_every_body_framing_is_read_whole(tmp_path: Path, reply: bytes, body: bytes) -> None:
    async with engine(tmp_path, answers(reply)) as path:
        up = upstream.Upstream(path)
        r = await up.request(b"GET", b"/", [(b"X-A", b"1")], b"")
        assert r.status in (200, 204)
        assert await r.read() == body


async def test_a_large_answer_is_read_whole_both_ways(tmp_path: Path) -> None:
    """Back-pressure is for streams a client reads slowly: an answer read whole
    (a big embeddings batch) must not stop at the read buffer's mark (it did,
    and waited forever)."""
    big = b"e" * (5 * 1024 * 1024)
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(big), big)
    async with engine(tmp_path, answers(reply, reply)) as path:
        up = upstream.Upstream(path)
        r = await asyncio.wait_for(up.request(b"GET", b"/", [], b""), 5)
        assert await asyncio.wait_for(r.read(), 5) == big
        done = asyncio.Event()
        sent = up.send_idle(b"GET", b"/", [], b"")
        assert sent is not None
        sent.on_complete(done.set)
        await asyncio.wait_for(done.wait(), 5)
        assert sent.body() == big


async def test_a_streamed_answer_read_slowly_holds_the_engine_back(tmp_path: Path) -> None:
    written = 0
    part = b"s" * 65536

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        await read_request(reader)
        writer.write(CHUNKED)
        for _ in range(512):  # 32 MiB
            writer.write(b"%x\r\n%b\r\n" % (len(part), part))
            await writer.drain()
            written += len(part)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with engine(tmp_path, stream) as path:
        r = await upstream.Upstream(path).request(b"GET", b"/", [], b"")
        parts = r.chunks()
        total = len(await anext(parts))
        await asyncio.sleep(0.5)  # a slow client
        assert written < 16 * 1024 * 1024, written  # the engine waits, not the front's memory
        async for data in parts:
            total += len(data)
        assert total == 512 * len(part)


async def test_a_kept_alive_connection_is_reused_and_a_dead_one_is_stale(tmp_path: Path) -> None:
    async with engine(tmp_path, answers(OK, None)) as path:
        up = upstream.Upstream(path)
        r = await up.request(b"GET", b"/", [], b"")
        assert await r.read() == b"ok"
        # The second request goes out on the same connection, which the
        # engine closes without an answer: stale (try a new connection).
        with pytest.raises(upstream.Stale):
            await up.request(b"GET", b"/", [], b"")


async def test_a_connection_the_engine_closed_while_idle_is_not_taken_again(
    tmp_path: Path,
) -> None:
    async with engine(tmp_path, answers(OK)) as path:  # one answer, then it closes
        up = upstream.Upstream(path)
        assert await (await up.request(b"GET", b"/", [], b"")).read() == b"ok"
        await asyncio.sleep(0.1)  # its end arrives
        assert up.send_idle(b"GET", b"/", [], b"") is None  # no dead connection kept
        assert await (await up.request(b"GET", b"/", [], b"")).read() == b"ok"  # a new one


async def test_a_new_connection_closed_without_an_answer_is_broken(tmp_path: Path) -> None:
    async with engine(tmp_path, answers(None)) as path:
        with pytest.raises(upstream.Broken):
            await upstream.Upstream(path).request(b"GET", b"/", [], b"")


async def test_an_answer_cut_short_is_broken(tmp_path: Path) -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    async with engine(tmp_path, answers(cut)) as path:  # then it closes
        r = await upstream.Upstream(path).request(b"GET", b"/", [], b"")
        with pytest.raises(upstream.Broken):
            await r.read()


async def test_not_http_is_broken(tmp_path: Path) -> None:
    async with engine(tmp_path, answers(b"SSH-2.0-OpenSSH\r\n\r\n")) as path:
        with pytest.raises(upstream.Broken):
            await upstream.Upstream(path).request(b"GET", b"/", [], b"")


async def test_a_head_answer_ends_at_its_head_and_its_connection_is_not_reused(
    tmp_path: Path,
) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"
    async with engine(tmp_path, answers(head, OK)) as path:
        up = upstream.Upstream(path)
        r = await up.request(b"HEAD", b"/", [], b"")
        assert await r.read() == b"" and r.header(b"content-length") == b"99"
        assert up.send_idle(b"GET", b"/", [], b"") is None  # nothing kept


async def test_send_idle_calls_back_with_the_whole_answer(tmp_path: Path) -> None:
    async with engine(tmp_path, answers(OK, OK, None)) as path:
        up = upstream.Upstream(path)
        assert up.send_idle(b"GET", b"/", [], b"") is None  # no connection yet
        await (await up.request(b"GET", b"/", [], b"")).read()
        done = asyncio.Event()
        sent = up.send_idle(b"POST", b"/", [], b"{}")
        assert sent is not None
        sent.on_complete(done.set)
        await asyncio.wait_for(done.wait(), 3)
        assert sent.complete and sent.status == 200 and sent.body() == b"ok"
        # The engine closes the next one: the callback comes with the failure,
        # and the caller can still await it to learn which.
        failed = asyncio.Event()
        again = up.send_idle(b"GET", b"/", [], b"")
        assert again is not None
        again.on_complete(failed.set)
        await asyncio.wait_for(failed.wait(), 3)
        assert not again.complete
        with pytest.raises(upstream.Stale):
            await again.head()
