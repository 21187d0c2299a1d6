"""The front door with real processes: every rule of zero-loss failover.

A local pod (``understudy local up``: lock server, GMS, front, engines) of
the synthetic engine, whose ``hold_ms`` keeps a request in flight as long as a
test needs; real signals to real processes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import itertools
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from localpod import LocalPod, free_port_block, http_json
from procs import Proc, shm_dir, understudy, wait_for

pytestmark = [pytest.mark.process, pytest.mark.slow]


def _pod(*extra: str, shadows: int = 1) -> LocalPod:
    return LocalPod(*extra, shadows=shadows, engine="synthetic")


@pytest.fixture
def pod():
    p = _pod()
    yield p
    p.close()


def checksum(pod: LocalPod, hold_ms: int = 0, timeout: float = 60) -> tuple[int, dict]:
    return http_json(pod.serve_port, "/v1/checksum", {"hold_ms": hold_ms}, timeout=timeout)


def front_state(pod: LocalPod) -> dict:
    return http_json(pod.front_port, "/state")[1]


def wait_at_engine(pod: LocalPod, n: int, engine: dict | None = None) -> dict:
    """Wait until ``n`` requests have gone out to an engine (``engine``: the
    one the front routes to) and none has come back: the front's /state."""

    def there() -> dict | None:
        state = front_state(pod)
        route = state["route"] or {}
        if engine is not None and route.get("engine_id") != engine["engine_id"]:
            return None
        return state if state["at_engine"] == n and state["inflight"] == n else None

    return wait_for(there, 20, 0.005, what=f"{n} request(s) at the engine")


def engine_state(pod: LocalPod, engine: dict) -> str | None:
    return next((e["state"] for e in pod.engines() if e.get("name") == engine["name"]), None)


def wait_answered(clients: Clients, more: int) -> None:
    """Wait until the clients got ``more`` answers than they have now."""
    target = len(clients.outcomes) + more
    wait_for(lambda: len(clients.outcomes) >= target, 30, what=f"{more} more answers")


def _other_active(pod: LocalPod, than: dict) -> dict:
    return wait_for(
        lambda: next((e for e in pod.by_state("Active") if e["name"] != than["name"]), None),
        20,
        0.01,
        what="another engine Active",
    )


def test_in_flight_requests_move_to_the_next_engine(pod):
    active = pod.wait_armed()
    _, expected = checksum(pod)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(checksum, pod, 1500) for _ in range(4)]
        wait_at_engine(pod, 4, active)  # all four are inside the Active engine
        os.kill(active["pid"], signal.SIGKILL)
        answers = [f.result() for f in futures]
    assert answers == [(200, expected)] * 4
    assert pod.metric("understudy_front_migrations_total", kind="new") == 4
    assert pod.metric("understudy_front_failovers_total") == 1


def test_requests_wait_for_an_engine_instead_of_failing(pod):
    """Both engines killed at once: nobody can serve until one restarts,
    re-imports the weights and wakes. Requests are held, then answered."""
    pod.wait_armed()
    _, expected = checksum(pod)
    for e in pod.engines():
        os.kill(e["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        answers = list(ex.map(lambda _: checksum(pod), range(3)))
    assert answers == [(200, expected)] * 3
    assert time.monotonic() - t0 > 0.3  # they did wait for a restarted engine
    assert pod.metric("understudy_front_held_requests_total") >= 3
    assert pod.metric("understudy_front_hold_seconds_count") >= 3
    assert http_json(pod.front_port, "/ready")[0] == 200


def test_a_request_that_outlives_its_migration_limit_gets_a_clear_503():
    pod = _pod("--migration-limit", "1", shadows=2)
    try:
        first = pod.wait_armed()
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(checksum, pod, 3000)
            wait_at_engine(pod, 1, first)
            os.kill(first["pid"], signal.SIGKILL)  # migration 1: allowed
            second = _other_active(pod, first)
            wait_at_engine(pod, 1, second)  # the request sleeps inside the second
            os.kill(second["pid"], signal.SIGKILL)  # would be migration 2
            status, body = fut.result()
        assert status == 503
        assert body["error"]["type"] == "server_error"
        assert "migration limit is 1" in body["error"]["message"]
        assert pod.metric("understudy_front_migrations_failed_total", reason="limit") == 1
    finally:
        pod.close()


def test_an_engine_4xx_is_relayed_and_never_replayed(pod):
    pod.wait_armed()
    status, body = http_json(pod.serve_port, "/v1/checksum", {"hold_ms": -5})
    assert status == 400 and "hold_ms" in body["error"]["message"]
    assert pod.metric("understudy_front_requests_total", code="4xx") == 1
    assert pod.metric("understudy_front_migrations_total", kind="new") == 0


def test_sigterm_drains_the_active_engine_without_losing_a_request(pod):
    active = pod.wait_armed()
    _, expected = checksum(pod)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        inflight = [ex.submit(checksum, pod, 1500) for _ in range(2)]
        wait_at_engine(pod, 2, active)
        os.kill(active["pid"], signal.SIGTERM)
        # Draining now: new requests wait for the next engine.
        wait_for(lambda: engine_state(pod, active) == "Draining", 10, what="draining")
        later = [ex.submit(checksum, pod) for _ in range(2)]
        answers = [f.result() for f in inflight + later]
    assert answers == [(200, expected)] * 4
    # The in-flight ones finished where they were: nothing was migrated.
    assert pod.metric("understudy_front_migrations_total", kind="new") == 0, pod.log("front")
    new = _other_active(pod, active)
    assert new["epoch"] > active["epoch"]

    def exits() -> list[str]:
        log = pod.log(active["name"])
        return [ln for ln in log.splitlines() if "understudy.respawn event=restart" in ln]

    # The engine gives the lock up before its process ends, so the next one
    # can be Active before its container's respawner has seen the exit: wait
    # for it. (SIGTERM to the engine alone; the container's own SIGTERM would
    # end the respawner with it.)
    first = wait_for(exits, 15, what="the drained engine's exit")[0]
    assert "code=0" in first, first  # drained, then a clean exit
    assert "reason=drained" in pod.log(active["name"])


def test_an_engine_refuses_a_request_of_another_epoch(pod):
    """The fence on the engine's side: only the epoch it holds is served."""
    active = pod.wait_armed()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(active["serving_socket"])
    conn = http.client.HTTPConnection("engine")
    conn.sock = sock
    conn.request(
        "POST", "/v1/checksum", "{}",
        {"X-Understudy-Epoch": str(active["epoch"] - 1), "Content-Type": "application/json"},
    )  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 409
    assert "X-Understudy-Not-Active" in resp.headers
    conn.close()


class Clients:
    """Clients that each send one request per new connection, as fast as they
    are answered; every outcome is kept by the exception's name."""

    def __init__(self, pod: LocalPod, n: int, hold_ms: int) -> None:
        self.pod, self.hold_ms = pod, hold_ms
        self.stop = False
        self.outcomes: list[str] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(n)
        self.futures = [self.pool.submit(self._run) for _ in range(n)]

    def _run(self) -> None:
        while not self.stop:
            try:
                status, _ = checksum(self.pod, self.hold_ms, timeout=30)
                self.outcomes.append("ok" if status == 200 else f"HTTP {status}")
            except (OSError, http.client.HTTPException) as exc:
                # Asked again at once: the next connection waits in the
                # serving socket's queue for the next front.
                self.outcomes.append(type(exc).__name__)

    def close(self) -> None:
        self.stop = True
        for f in self.futures:
            f.result(60)
        self.pool.shutdown()


def test_a_killed_front_refuses_no_connection_and_counts_what_it_lost(pod):
    """The front dies (kill -9, three times) under 8 clients: the lock server
    keeps the serving socket, so new connections wait for the next front
    instead of being refused, and a copy of every accepted one, which the
    next front finishes: nothing fails, and nothing is reported lost."""
    active = pod.wait_armed()
    clients = Clients(pod, 8, hold_ms=20)
    starts = []
    try:
        for _ in range(3):
            wait_answered(clients, 32)  # the front (a restarted one) serves them
            old = pod.front_pid()
            assert old is not None
            t0 = time.monotonic()
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: pod.front_pid() not in (old, None), 20, 0.01, what="the next front")  # noqa: B023
            starts.append(time.monotonic() - t0)
        wait_answered(clients, 32)
    finally:
        clients.close()
    outcomes = clients.outcomes
    failed = [o for o in outcomes if o != "ok"]
    lost = pod.metric("understudy_front_lost_requests_total")
    idle = pod.metric("understudy_front_lost_idle_connections_total")
    log = pod.log("front")
    print(
        f"{len(outcomes)} requests, failed {len(failed)} {sorted(set(failed))}, reported lost "
        f"{lost:g}; next front answering after {[round(s * 1000) for s in starts]} ms; "
        f"load {os.getloadavg()}"
    )
    assert failed == [] and lost + idle == 0
    assert pod.metric("understudy_front_restarts_total") == 3
    assert log.count("event=took_over") == 3 and "source=" in log
    state = http_json(pod.front_port, "/state")[1]
    assert state["route"]["engine_id"] == active["engine_id"]


def test_a_restarted_lock_server_takes_the_socket_from_the_front(pod):
    """The lock server dies while the front holds the port: it cannot bind it
    again, so it takes the front's socket (a client of the front's
    front.sock), and keeps it for the front's next death; the front holds
    its connections with it again, so that death fails nothing either."""
    pod.wait_armed()
    old = pod.process("lockserver")
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: pod.log("lockserver").count("event=serving_socket_kept") == 2, 20,
             what="the restarted lock server keeps the socket")  # fmt: skip
    assert f"source={pod.dir / 'front.sock'}" in pod.log("lockserver")
    wait_for(lambda: "event=conns_keeper_back" in pod.log("front"), 20,
             what="the front holding its connections with it again")  # fmt: skip
    clients = Clients(pod, 4, hold_ms=20)
    try:
        wait_answered(clients, 16)
        front = pod.front_pid()
        assert front is not None
        os.kill(front, signal.SIGKILL)
        wait_for(lambda: pod.front_pid() not in (front, None), 20, 0.01, what="the next front")
        wait_answered(clients, 16)
    finally:
        clients.close()
    failed = [o for o in clients.outcomes if o != "ok"]
    # The restarted lock server keeps the connections too: the front held
    # them again as soon as it was back (connhold).
    assert failed == [], failed
    assert pod.metric("understudy_front_lost_requests_total") == 0


@contextlib.contextmanager
def front_without_engines(tmp_path: Path, hold: float) -> Iterator[int]:
    """A lock server and a front, and no engine ever: the front's port."""
    port = free_port_block(4)
    with shm_dir() as run:
        lock = Proc(
            understudy("lockserver", "serve", "--socket", str(run / "lock.sock"),
                       "--state-file", str(run / "lock.state")),
            log=tmp_path / "lock.log",
        )  # fmt: skip
        front = Proc(
            understudy("front", "serve", "--run-dir", str(run), "--port", str(port),
                       "--status-port", str(port + 1), "--hold", str(hold)),
            log=tmp_path / "front.log",
        )  # fmt: skip
        try:
            wait_for(lambda: _answers(port + 1), 20, what="front up")
            yield port
        finally:
            front.stop()
            lock.stop()


def test_hold_expiry_answers_503_with_retry_after(tmp_path):
    """No engine at all: a request waits the whole hold, then is told why."""
    with front_without_engines(tmp_path, hold=1) as port:
        assert http_json(port + 1, "/ready")[0] == 503  # never had an engine
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi"}))
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert body["error"]["type"] == "server_error"
        assert "within the hold of 1.0s" in body["error"]["message"]
        assert 0.9 < time.monotonic() - t0 < 3


def test_a_held_request_whose_client_leaves_is_let_go(tmp_path):
    """A request held for an engine that never comes, whose client gives up:
    it stops being held and in flight at once (its task is cancelled), and
    counts as a 4xx, the client's doing; not at the end of the hold."""
    with front_without_engines(tmp_path, hold=60) as port:
        for body in (b'{"prompt": "hi"}', b'{"prompt": "hi", "stream": true}'):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
                )
                wait_for(lambda: http_json(port + 1, "/state")[1]["held"] == 1, 5, what="held")
            # The client is gone: nothing holds its request any more.
            wait_for(lambda: _idle(port + 1), 5, what="the request let go")
        text = http_json(port + 1, "/metrics")[1]
        assert 'understudy_front_requests_total{code="4xx"} 2.0' in text, text


def _idle(status_port: int) -> bool:
    view = http_json(status_port, "/state")[1]
    return view["held"] == 0 and view["inflight"] == 0


def _answers(port: int) -> bool:
    try:
        return http_json(port, "/live", timeout=0.5)[0] == 200
    except OSError:
        return False


def exchange(pod: LocalPod, head: str, body: bytes = b"", method: str = "") -> tuple[int, bytes]:
    """One raw request to the serving port, its bytes exactly as given."""
    with socket.create_connection(("127.0.0.1", pod.serve_port), timeout=10) as s:
        s.sendall(head.encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body)
        resp = http.client.HTTPResponse(s, method=method or head.split(" ", 1)[0])
        resp.begin()
        return resp.status, resp.read()


def test_the_request_head_reaches_the_engine_byte_for_byte(pod):
    """A UTF-8 header value or a percent-encoded path is forwarded as it came:
    the front used to re-encode what aiohttp had decoded, as Latin-1 (a 500 for
    a User-Agent of "€") and from the decoded path (a 500 for %E2%82%AC, and a
    CR LF from %0D%0A in the engine's request line). Found by
    tests/process/fuzz/test_fuzz_http.py."""
    pod.wait_armed()
    _, expected = checksum(pod)
    body = b"{}"
    for agent in ("€uro", "caf\udce9"):  # UTF-8, and a lone Latin-1 byte
        head = f"POST /v1/checksum HTTP/1.1\r\nHost: x\r\nUser-Agent: {agent}\r\nContent-Length: 2"
        status, answer = exchange(pod, head, body)
        assert status == 200 and json.loads(answer) == expected, answer[:200]
    head = "POST /v1/checksum?q=%E2%82%AC HTTP/1.1\r\nHost: x\r\nContent-Length: 2"
    status, answer = exchange(pod, head, body)
    assert status == 200 and json.loads(answer) == expected, answer[:200]
    for path in ("/v1/%E2%82%AC", "/v1/checksum%0D%0AX-Injected:%201", "/v1/%FF"):
        status, _ = exchange(pod, f"GET {path} HTTP/1.1\r\nHost: x")
        assert status == 404, path  # the engine's answer for a path it does not serve
    assert checksum(pod) == (200, expected)


def test_a_head_request_is_answered(pod):
    """A HEAD's answer has no body, whatever its Content-Length says: the front
    waited for one, so a HEAD hung until the engine closed the connection.
    Found by tests/process/fuzz/test_fuzz_http.py."""
    pod.wait_armed()
    _, expected = checksum(pod)
    for path, status in (("/health", 200), ("/v1/checksum", 405), ("/nothing", 404)):
        assert exchange(pod, f"HEAD {path} HTTP/1.1\r\nHost: x") == (status, b""), path
    assert checksum(pod) == (200, expected)  # and the kept-alive connections still work
    assert http_json(pod.front_port, "/state")[1]["inflight"] == 0


def test_a_client_that_hangs_up_mid_body_is_no_error(pod):
    """A request whose client hangs up before its body is complete is nobody's
    error: the front and the engine logged it as one, with a traceback (what
    aiohttp does with the ConnectionResetError of an unread body). Found by
    tests/process/fuzz/test_fuzz_http.py."""
    active = pod.wait_armed()
    _, expected = checksum(pod)
    # "Expect: 100-continue": the server's 100 says it read the head and now
    # waits for the body; the client sends part of it and hangs up.
    head = (
        b"POST /v1/checksum HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    front = socket.create_connection(("127.0.0.1", pod.serve_port), timeout=5)
    engine = socket.socket(socket.AF_UNIX)
    engine.settimeout(5)
    engine.connect(active["serving_socket"])
    for s in (front, engine):
        with s:
            s.sendall(head)
            assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            s.sendall(b"{")
    assert checksum(pod) == (200, expected)
    wait_for(lambda: http_json(pod.front_port, "/state")[1]["inflight"] == 0, 5, what="idle")
    for name in ("front", active["name"]):
        assert "Traceback" not in pod.log(name), pod.log(name)[-2000:]


def test_json_nested_too_deep_is_a_400_not_a_500(pod):
    """Python's json raises RecursionError, not ValueError, for an array nested
    a thousand deep: the engine answered its checksum with a 500, and the front
    failed a completion request with one before forwarding it. Found by
    tests/process/fuzz/test_fuzz_http.py."""
    pod.wait_armed()
    deep = b"[" * 5000 + b"]" * 5000
    for path, status in (("/v1/checksum", 400), ("/v1/completions", 404)):
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(deep)}"
        assert exchange(pod, head, deep)[0] == status, path  # 404: no completions here


def test_the_fronts_status_port_answers_through_its_kills(pod):
    """kubelet probes the front's ``/live`` every 2 s and restarts the whole
    container after 3 failures: a front restarted in place must never leave
    its status port refusing or resetting. The respawner binds it once
    (``--listen status=…``), so a probe sent while the next front starts
    waits in the kernel's queue and is answered by it. (Before, each front
    bound the port itself: a probe in the gap was refused, and a front that
    bound it while the dead one's witness still held the old listener
    failed its start with EADDRINUSE: CI's container restart.)"""
    pod.wait_armed()
    stop, outcomes = False, []
    runs: list[list[str]] = [[], []]  # each prober's outcomes, in order

    def probe(mine: list[str]) -> None:
        while not stop:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", pod.front_port, timeout=10)
                conn.request("GET", "/live")
                status = conn.getresponse().status
                conn.close()
                outcome = "ok" if status == 200 else f"HTTP {status}"
            except (OSError, http.client.HTTPException) as exc:
                outcome = type(exc).__name__
            mine.append(outcome)
            outcomes.append(outcome)
            time.sleep(0.005)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        probes = [pool.submit(probe, mine) for mine in runs]
        try:
            for _ in range(3):
                old = pod.front_pid()
                assert old is not None
                seen = len(outcomes)
                os.kill(old, signal.SIGKILL)
                wait_for(lambda: pod.front_pid() not in (old, None), 20, 0.01, what="a front")  # noqa: B023
                wait_for(lambda: len(outcomes) > seen + 20, 20, what="probes after it")  # noqa: B023
        finally:
            stop = True
            for f in probes:
                f.result(30)
    # A probe the dead front was answering dies with it (the status port's
    # connections are nobody's to keep): one failure, never two in a row,
    # and never a refusal. kubelet restarts the container at three.
    failed = [o for o in outcomes if o != "ok"]
    assert outcomes and "ConnectionRefusedError" not in failed, sorted(set(failed))
    for mine in runs:
        pairs = itertools.pairwise(mine)
        assert not any(a != "ok" and b != "ok" for a, b in pairs), mine
    assert len(failed) <= 3 * len(runs), failed
    assert "Address already in use" not in pod.log("front")
