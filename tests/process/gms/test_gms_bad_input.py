"""Bad input as for a lock server: the server survives and stays consistent."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from gmsprocs import Gms, memfd_holders
from procs import wait_for

from understudy.gms import messages as m
from understudy.wire.uds import recv_frame, send_frame

pytestmark = pytest.mark.process

MiB = 1 << 20


def raw(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def frame(doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack(">I", len(body)) + body


def ask(s: socket.socket, doc: dict[str, Any], fd: int | None = None) -> dict[str, Any]:
    send_frame(s, frame(doc), fd)
    body, got_fd = recv_frame(s, m.MAX_REPLY_FRAME)
    if got_fd is not None:
        got_fd.close()
    out: dict[str, Any] = json.loads(body)
    return out


def closed_after_error(s: socket.socket, data: bytes) -> dict[str, Any]:
    """Send ``data``; expect one protocol error reply, then EOF."""
    s.sendall(data)
    body, _ = recv_frame(s, m.MAX_REPLY_FRAME)
    reply: dict[str, Any] = json.loads(body)
    assert s.recv(1) == b""  # the server closed this connection
    return reply


@pytest.fixture
def committed(gms: Gms) -> tuple[Gms, int, str]:
    server = gms.server()
    writer = gms.agent("writer")
    writer.ok("connect", path=str(gms.path()), mode="RW", timeout=10)
    writer.ok("allocate", size=MiB)
    digest = writer.ok("commit")["layout_hash"]
    writer.ok("close")
    return gms, server.pid, digest


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: gms\r\n\r\n",  # garbage: its "length" is huge
        b"\xff\xff\xff\xff",  # a 4 GB length prefix
        struct.pack(">I", 5) + b"nope!",  # not JSON
        frame({"type": "format_disk"}),  # unknown message
        frame({"type": "allocate", "size": -5}),  # invalid field
        frame({"type": "get_state", "extra": True}),  # extra field
    ],
    ids=["garbage", "4GB-prefix", "not-json", "unknown-type", "invalid-field", "extra-field"],
)
def test_undecodable_input_gets_an_error_and_a_close(
    committed: tuple[Gms, int, str], data: bytes
) -> None:
    gms, _, digest = committed
    with raw(gms.path()) as s:
        reply = closed_after_error(s, data)
    assert reply["type"] == "error" and reply["code"] == "protocol"
    st = gms.state()
    assert st["committed"] and st["layout_hash"] == digest and st["allocations"] == 1


def test_a_frame_cut_in_half_blocks_no_one(committed: tuple[Gms, int, str]) -> None:
    gms, _, digest = committed
    whole = frame({"type": "get_state"})
    half = raw(gms.path())
    half.sendall(whole[: len(whole) // 2])
    assert gms.state()["layout_hash"] == digest  # others are served meanwhile
    half.sendall(whole[len(whole) // 2 :])  # the rest arrives: one reply
    body, _ = recv_frame(half, m.MAX_REPLY_FRAME)
    assert json.loads(body)["type"] == "state"
    half.sendall(whole[:3])
    half.close()  # and then it goes away mid-frame
    assert gms.state()["sessions"] == {"RW": 0, "RO": 0, "ADOPT": 0}


def test_rw_operations_in_an_ro_session_are_refused(committed: tuple[Gms, int, str]) -> None:
    gms, _, digest = committed
    with raw(gms.path()) as s:
        assert ask(s, {"type": "hello", "mode": "RO", "timeout_s": 5})["granted"] == "RO"
        for doc in (
            {"type": "allocate", "size": 4096},
            {"type": "commit"},
            {"type": "put_metadata", "key": "x", "value": {}},
        ):
            reply = ask(s, doc)
            assert reply["type"] == "error" and reply["code"] == "refused", reply
            assert "RW-only" in reply["message"]
        reply = ask(s, {"type": "export", "id": 424242})
        assert reply["code"] == "not_found"
        reply = ask(s, {"type": "export_many", "ids": [0, 424242]})
        assert reply["code"] == "not_found"  # one error, no fds
        reply = ask(s, {"type": "hello", "mode": "RW", "timeout_s": 5})
        assert reply["code"] == "refused"  # one hello per connection
        assert ask(s, {"type": "get_state"})["sessions"]["RO"] == 1  # the session goes on
    st = gms.state()
    assert st["layout_hash"] == digest and st["allocations"] == 1 and st["sessions"]["RO"] == 0


def test_requests_before_hello_are_refused(committed: tuple[Gms, int, str]) -> None:
    gms, _, _ = committed
    with raw(gms.path()) as s:
        assert ask(s, {"type": "export", "id": 0})["code"] == "refused"
        assert ask(s, {"type": "list_allocations"})["code"] == "refused"
        assert ask(s, {"type": "get_state"})["type"] == "state"


def test_fds_sent_by_a_client_are_never_accepted(committed: tuple[Gms, int, str]) -> None:
    gms, server_pid, digest = committed
    name = "understudy-test-client-sent-fd"
    fd = os.memfd_create(name)
    try:
        fds_before = len(list(Path(f"/proc/{server_pid}/fd").iterdir()))
        with raw(gms.path()) as s:
            for _ in range(5):
                reply = ask(s, {"type": "get_state"}, fd=fd)
                assert reply["type"] == "state" and reply["layout_hash"] == digest
            assert ask(s, {"type": "get_state"})["type"] == "state"
            holders = [h for h in memfd_holders(name) if h.startswith(f"{server_pid} ")]
            assert holders == []  # the kernel dropped them: never installed in the server
            assert (
                len(list(Path(f"/proc/{server_pid}/fd").iterdir())) <= fds_before + 1
            )  # + this socket
    finally:
        os.close(fd)


def test_hello_that_cannot_be_granted_times_out_on_the_server(gms: Gms) -> None:
    gms.server()
    with raw(gms.path()) as s:
        reply = ask(s, {"type": "hello", "mode": "RO", "timeout_s": 0.3})
        assert reply["type"] == "error" and reply["code"] == "timeout"
        assert ask(s, {"type": "get_state"})["waiting"] == 0


def test_a_reply_that_cannot_be_sent_ends_the_session(gms: Gms) -> None:
    """A reply the server fails to send ends that session, and only that one.

    The client stops reading (its SHUT_RD fails the server's sends, as a client
    that dies just as its reply goes out does). The server used to close the
    socket under its own pending read, which then never woke: the writer's
    session, and its lock, outlived the client for good. Found by
    tests/process/fuzz/test_fuzz_gms.py."""
    gms.server()
    with raw(gms.path()) as s:
        assert ask(s, {"type": "hello", "mode": "RW", "timeout_s": 5})["granted"] == "RW"
        s.shutdown(socket.SHUT_RD)
        s.sendall(frame({"type": "get_state"}))  # its reply cannot be sent
        wait_for(lambda: gms.state()["sessions"]["RW"] == 0, 5, what="the session ended")
    for _ in range(3):  # whichever fd number the next clients are given
        with raw(gms.path()) as t:
            assert ask(t, {"type": "hello", "mode": "RW", "timeout_s": 5})["granted"] == "RW"
