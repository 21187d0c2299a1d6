"""The status port before the shim (engine_shim.early_status): answered from the
first moments of the process, then handed over without a refused connection."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from understudy.engine_shim.early_status import EarlyStatus


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture
def early(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ENGINE_ROLE", "shadow")
    monkeypatch.setenv("UNDERSTUDY_ENGINE_NAME", "engine-shadow-1")
    monkeypatch.setenv("UNDERSTUDY_RESTARTS", "4")
    e = EarlyStatus.start(0, host="127.0.0.1", budget_s=600)
    yield e
    e.handover().close()


def test_a_starting_engine_is_alive_in_init_and_not_ready(early: EarlyStatus) -> None:
    assert _get(early.port, "/live")[0] == 200
    assert _get(early.port, "/startup")[0] == 503
    assert _get(early.port, "/ready")[0] == 503
    assert _get(early.port, "/metrics")[0] == 503
    assert _get(early.port, "/nope")[0] == 404
    status, body = _get(early.port, "/state")
    doc = json.loads(body)
    assert status == 200 and doc["state"] == "Init" and doc["restarts"] == 4
    assert (doc["role"], doc["name"]) == ("shadow", "engine-shadow-1")


def test_past_the_startup_budget_it_is_not_alive() -> None:
    e = EarlyStatus.start(0, host="127.0.0.1", budget_s=0.0)
    try:
        status, body = _get(e.port, "/live")
        assert status == 503 and b"> 0s" in body
    finally:
        e.handover().close()


def test_the_handover_keeps_the_port_listening(early: EarlyStatus) -> None:
    """A probe that arrives during the handover waits in the backlog and is
    answered by whoever takes the socket; it is never refused."""
    port = early.port
    sock = early.handover()
    client = socket.create_connection(("127.0.0.1", port), timeout=5)  # not refused
    client.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.setblocking(True)
    conn, _ = sock.accept()  # the new owner answers it
    with conn:
        assert conn.recv(1024).startswith(b"GET /live")
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert client.recv(1024).startswith(b"HTTP/1.1 200")
    client.close()


def test_a_port_in_use_is_an_error() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        with pytest.raises(OSError):
            EarlyStatus.start(holder.getsockname()[1], host="127.0.0.1")
    finally:
        holder.close()
