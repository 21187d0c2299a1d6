"""The lock server as real processes: kill -9, SIGSTOP, restarts, bad input.

Each way a lock server crash can meet its holder (healthy, dead, hung, or
dying with it) is a test here. Holders and waiters are
``understudy lock acquire`` processes (the same client library the engine
shim uses), so the reconnect/resume path is exercised for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

import pytest
from localpod import free_port_block
from procs import Proc, understudy, wait_for

from understudy.lockserver import client
from understudy.lockserver.statefile import StateFile, copy_paths
from understudy.wire import priority
from understudy.wire.serving import heartbeat_path

pytestmark = pytest.mark.process


class Pod:
    """A lock server and its state file in one directory, restartable."""

    def __init__(self, tmp: Path, window: float = 1.0, extra: tuple[str, ...] = ()) -> None:
        self.dir = tmp
        self.sock = tmp / "lock.sock"
        self.state = tmp / "lock.state"
        self.window = window
        self.extra = extra
        self.server: Proc | None = None
        self.procs: list[Proc] = []
        self.log = tmp / "lockserver.log"

    def start_server(self) -> Proc:
        self.server = Proc(
            understudy(
                "lockserver",
                "serve",
                "--socket",
                str(self.sock),
                "--state-file",
                str(self.state),
                "--reconnect-window",
                str(self.window),
                *self.extra,
            ),
            log=self.log,
        )
        wait_for(self._answers, 15, what="lock server socket")
        return self.server

    def _answers(self) -> bool:
        try:
            client.status(self.sock, timeout=0.5)
            return True
        except client.LockError:
            return False

    def acquire(self, engine_id: str, *more: str) -> Proc:
        p = Proc(
            understudy(
                "lock",
                "acquire",
                "--socket",
                str(self.sock),
                "--id",
                engine_id,
                "--reconnect-timeout",
                str(self.window + 4),
                *more,
            ),
            log=self.dir / f"{engine_id}.log",
        )
        self.procs.append(p)
        return p

    def status(self) -> client.StatusReply:
        return client.status(self.sock, timeout=2)

    def wait_waiting(self, *ids: str) -> None:
        wait_for(lambda: set(ids) <= set(self.status().waiters), 10, what=f"waiters {ids}")

    def close(self) -> None:
        for p in self.procs:
            p.stop()
        if self.server:
            self.server.stop()


@pytest.fixture
def pod(tmp_path):
    p = Pod(tmp_path)
    p.start_server()
    yield p
    p.close()


def granted(p: Proc, timeout: float = 10.0) -> int:
    line = p.json_line(timeout)
    assert line["event"] == "granted", line
    return line["epoch"]


def test_holder_kill9_grants_waiter_without_heartbeat(pod):
    a = pod.acquire("a")
    ea = granted(a)
    b = pod.acquire("b")
    pod.wait_waiting("b")
    assert b.no_line(0.3)  # really blocked
    a.kill9()
    eb = granted(b, timeout=5)
    assert eb > ea
    assert pod.status().holder == "b"
    assert StateFile(pod.state).read().record.holder == "b"


def test_lockserver_crash_healthy_holder_keeps_lock_and_epoch(pod):
    """Server crash, holder healthy: A reconnects and continues; no failover."""
    a = pod.acquire("a")
    ea = granted(a)
    b = pod.acquire("b")
    pod.wait_waiting("b")
    pod.server.kill9()
    pod.start_server()
    wait_for(lambda: pod.status().holder == "a", 10, what="a resumes")
    st = pod.status()
    assert st.epoch == ea and not st.window_open  # window closed by the reclaim
    time.sleep(pod.window + 0.5)  # well past the window
    assert a.alive() and a.no_line(0.1)  # A never heard it lost anything
    assert pod.status().holder == "a"
    assert b.no_line(0.1)  # B still waiting: no failover
    assert "b" in pod.status().waiters
    a.kill9()  # and the lock still works afterwards
    assert granted(b) == ea + 1


def test_lockserver_crash_dead_holder_window_expires_then_waiter_wins(pod):
    """Server crash, holder dead: the window expires, then the waiter wins."""
    a = pod.acquire("a")
    ea = granted(a)
    b = pod.acquire("b")
    pod.wait_waiting("b")
    pod.server.kill9()
    a.kill9()
    t0 = time.monotonic()
    pod.start_server()
    assert pod.status().window_open and pod.status().window_holder == "a"
    eb = granted(b, timeout=10)  # b's acquire reconnected to the new server by itself
    assert time.monotonic() - t0 >= pod.window * 0.9  # not before the window
    assert eb == ea + 1


def test_lockserver_crash_hung_holder_loses_and_learns_it(pod):
    """Server crash, holder hung: A is SIGSTOPped; B wins after the window; A is told."""
    a = pod.acquire("a")
    ea = granted(a)
    b = pod.acquire("b")
    pod.wait_waiting("b")
    a.signal(signal.SIGSTOP)
    pod.server.kill9()
    pod.start_server()
    eb = granted(b, timeout=10)
    assert eb > ea
    a.signal(signal.SIGCONT)
    line = a.json_line(10)
    assert line["event"] == "lost" and "superseded" in line["reason"]
    assert a.wait(5) == 3  # the lost-lock callback ends the holder
    assert pod.status().holder == "b"


def test_both_crash_first_to_acquire_after_window_wins(tmp_path):
    """Server, holder and waiter all die; fresh engines race after the window."""
    pod = Pod(tmp_path, window=4.0)  # long enough to see both restarted engines queue
    pod.start_server()
    try:
        _both_crash(pod)
    finally:
        pod.close()


def _both_crash(pod):
    a = pod.acquire("a")
    ea = granted(a)
    b = pod.acquire("b")
    pod.wait_waiting("b")
    for p in (pod.server, a, b):
        p.kill9()
    pod.start_server()
    a2 = pod.acquire("a2")  # the restarted engines: new ids
    pod.wait_waiting("a2")
    b2 = pod.acquire("b2")
    pod.wait_waiting("a2", "b2")
    assert granted(a2, timeout=10) == ea + 1
    assert b2.no_line(0.3)
    assert pod.status().waiters == ("b2",)


def _damage_both(pod: Pod) -> None:
    for copy in copy_paths(pod.state):
        copy.write_text('{"holder": "a", "epo')  # by hand: never by us


_BEATER = """
import sys, time
from pathlib import Path
from understudy.wire.heartbeat import HeartbeatWriter
w = HeartbeatWriter(Path(sys.argv[1]))
print('{"event": "beating"}', flush=True)
while True:
    w.beat(int(sys.argv[2]))
    time.sleep(0.1)
"""


def _engine_beat(pod: Pod, engine_id: str, epoch: int) -> Proc:
    """A process that beats as an engine holding ``epoch`` would."""
    beater = Proc(
        [sys.executable, "-c", _BEATER, str(heartbeat_path(pod.dir, engine_id)), str(epoch)]
    )
    pod.procs.append(beater)
    assert beater.json_line(10) == {"event": "beating"}
    return beater


def test_a_damaged_record_waits_while_an_engine_holds_an_epoch_and_says_so(tmp_path):
    """Both copies damaged: the holder is unknown. While an engine of the pod
    beats with an epoch (it may be the holder, and may claim its grant back),
    acquires wait; once it is gone, the window closes at once."""
    pod = Pod(tmp_path, window=30.0)
    _damage_both(pod)
    holder = _engine_beat(pod, "engine-primary/aa", 12)
    pod.start_server()
    try:
        st = pod.status()
        assert st.window_open and st.window_holder is None
        b = pod.acquire("b")
        pod.wait_waiting("b")
        assert b.no_line(1.0)  # the engine that may hold the lock still lives
        holder.kill9()
        t0 = time.monotonic()
        epoch = granted(b, timeout=10)
        assert time.monotonic() - t0 < 2.0  # not the 30 s window
        assert epoch > 10**15  # restarted above any counter epoch
        log = pod.log.read_text()
        assert "state_file_corrupt" in log and "ERROR" in log
        assert "event=window_closed reason=holder_gone" in log
        assert len(list(tmp_path.glob("lock.state.?.corrupt-*"))) == 2
    finally:
        pod.close()


def test_one_damaged_copy_restores_the_holder_from_the_other(tmp_path):
    pod = Pod(tmp_path, window=30.0)
    pod.start_server()
    try:
        a = pod.acquire("a")
        ea = granted(a)
        pod.server.kill9()
        copy_paths(pod.state)[1].write_bytes(b"\x00not json{")
        pod.start_server()
        st = pod.status()
        assert (st.window_holder, st.epoch) in {("a", ea), (None, ea)}  # a may be back already
        wait_for(lambda: pod.status().holder == "a", 10, what="a resumes its grant")
        assert pod.status().epoch == ea  # the same grant: nothing failed over
        log = pod.log.read_text()
        assert "event=state_copy_damaged" in log and "state_file_corrupt" not in log
        a_copy, b_copy = copy_paths(pod.state)
        assert a_copy.read_bytes() == b_copy.read_bytes()  # written whole again
    finally:
        pod.close()


def test_lost_lock_when_server_never_comes_back(tmp_path):
    pod = Pod(tmp_path)
    pod.start_server()
    try:
        a = pod.acquire("a")
        granted(a)
        pod.server.kill9()
        line = a.json_line(pod.window + 10)
        assert line["event"] == "lost" and "did not come back" in line["reason"]
        assert a.wait(5) == 3
    finally:
        pod.close()


# ------------------------------------------------------------ bad input --


def raw(sock_path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock_path))  # blocking: waits if the backlog is momentarily full
    s.settimeout(5)
    return s


def read_error(s: socket.socket) -> dict:
    header = s.recv(4)
    (n,) = struct.unpack(">I", header)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return json.loads(body)


def test_bad_input_never_costs_the_holder_its_lock(pod):
    a = pod.acquire("a")
    ea = granted(a)
    b = pod.acquire("b")
    pod.wait_waiting("b")

    garbage = raw(pod.sock)
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n")
    err = read_error(garbage)
    assert err["type"] == "error" and err["code"] == "bad_request"
    assert garbage.recv(10) == b""  # and the server closed that connection

    huge = raw(pod.sock)
    huge.sendall(struct.pack(">I", 4 * 1024**3 - 1))
    assert "exceeds the maximum" in read_error(huge)["message"]

    half = raw(pod.sock)
    frame = b'{"type":"acquire","engine_id":"h"}'
    half.sendall(struct.pack(">I", len(frame)) + frame[:10])
    half.shutdown(socket.SHUT_WR)  # half-closed mid-frame

    silent = [raw(pod.sock) for _ in range(3)]  # connect and never speak

    bad_json = raw(pod.sock)
    body = b'{"type":"acquire","engine_id":5}'
    bad_json.sendall(struct.pack(">I", len(body)) + body)
    assert "engine_id" in read_error(bad_json)["message"]

    many = []
    for _ in range(1000):
        many.append(raw(pod.sock))
    st = pod.status()  # still answering with 1000 idle connections open
    assert st.holder == "a" and st.epoch == ea and st.waiters == ("b",)
    for s in [garbage, huge, half, bad_json, *silent, *many]:
        s.close()

    assert pod.server.alive() and a.alive()
    wait_for(lambda: pod.status().waiters == ("b",), 5, what="idle connections gone")
    assert pod.status().holder == "a"
    a.kill9()
    assert granted(b) == ea + 1


def test_second_acquire_on_holder_connection_is_refused_without_release(pod):
    s = raw(pod.sock)
    body = b'{"type":"acquire","engine_id":"x"}'
    frame = struct.pack(">I", len(body)) + body
    s.sendall(frame)
    assert read_error(s)["type"] == "granted"
    s.sendall(frame)
    err = read_error(s)
    assert err["code"] == "bad_request" and "holds the lock" in err["message"]
    assert pod.status().holder == "x"
    s.close()
    wait_for(lambda: pod.status().holder is None, 5, what="release on close")


# ------------------------------------------------------------------ TCP --


def free_port() -> int:
    return free_port_block(1)  # below the ephemeral range (tests/localpod.py)


def test_tcp_needs_the_token_and_releases_on_death(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    port = free_port()
    pod = Pod(tmp_path, extra=("--tcp", f"127.0.0.1:{port}", "--token-file", str(token)))
    pod.start_server()
    addr = f"tcp:127.0.0.1:{port}"
    try:
        with pytest.raises(client.LockRefused, match="unauthorized"):
            client.status(addr, timeout=2)
        wrong = tmp_path / "wrong"
        wrong.write_text("nope")
        bad = Proc(
            understudy("lock", "acquire", "--socket", addr, "--id", "m", "--token-file", str(wrong))
        )
        assert bad.json_line()["event"] == "error"
        assert bad.wait() == 1
        a = Proc(
            understudy("lock", "acquire", "--socket", addr, "--id", "a", "--token-file", str(token))
        )
        pod.procs.append(a)
        ea = granted(a)
        b = Proc(understudy("lock", "acquire", "--socket", str(pod.sock), "--id", "b"))
        pod.procs.append(b)
        pod.wait_waiting("b")
        a.kill9()  # a RST/FIN on loopback: seen at once, keepalive is the backstop
        assert granted(b) == ea + 1
        assert client.status(addr, timeout=2, token="s3cret").holder == "b"
    finally:
        pod.close()


def test_tcp_without_token_is_refused_at_start(tmp_path):
    p = Proc(
        understudy(
            "lockserver",
            "serve",
            "--socket",
            str(tmp_path / "s"),
            "--state-file",
            str(tmp_path / "st"),
            "--tcp",
            "127.0.0.1:0",
        )
    )
    assert p.wait(15) == 2


def test_status_cli_prints_one_json_line(pod):
    time.sleep(1.1)  # past the window of a server that started with no file
    p = Proc(understudy("lock", "status", "--socket", str(pod.sock)))
    line = p.json_line()
    assert p.wait() == 0
    # With no state file, epochs start above the wall clock in microseconds:
    # above anything a lost file could have held.
    assert line.pop("epoch") > time.time() * 1e6 - 60e6
    assert line == {
        "holder": None,
        "waiters": [],
        "window_open": False,
        "window_holder": None,
        "window_remaining_s": None,
    }
    gone = Proc(understudy("lock", "status", "--socket", str(pod.dir / "nope.sock")))
    assert "error" in gone.json_line() and gone.wait() == 1


def test_watch_sees_every_holder_and_a_restart(pod):
    """The front's view: the holder now, each grant, and the holder again after a
    lock-server restart (reclaimed within the window, same epoch)."""
    import asyncio

    from understudy.lockserver import watch

    seen: list[tuple[str | None, int]] = []

    async def collect(n: int) -> None:
        async for h in watch(client.Address.parse(pod.sock)):
            item = (h.holder and h.holder.split("/")[0], h.epoch)
            if seen and seen[-1] == item:
                continue  # the window closing: the same holder and epoch
            seen.append(item)
            if len(seen) >= n:
                return

    async def scenario() -> None:
        task = asyncio.create_task(collect(3))
        await asyncio.sleep(0.2)
        a = pod.acquire("a")
        await asyncio.to_thread(granted, a)
        pod.acquire("b")
        await asyncio.to_thread(pod.wait_waiting, "b")
        a.kill9()  # b is granted in the same step: the front never sees "nobody"
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    first = seen[0][1]
    assert seen == [(None, first), ("a", first + 1), ("b", first + 2)]
    # After a restart the watch reports the holder it restored, with its epoch.
    pod.server.kill9()
    pod.start_server()

    async def after_restart() -> None:
        async for h in watch(client.Address.parse(pod.sock)):
            seen.append((h.holder, h.epoch))
            if h.holder is not None:
                return

    asyncio.run(asyncio.wait_for(after_restart(), 10))
    assert seen[-1] == ("b", first + 2)


def _scrape(port: int) -> dict[str, float]:
    """Every sample of the lock server's /metrics: {'name{labels}': value}."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_failover_counters_survive_the_lock_servers_kill9(tmp_path):
    """The counters are the lock server's durable record: a handover counted
    before a kill -9 of the lock server is still counted after its restart
    (the engines die, the lock server may die: the count stays)."""
    port = free_port_block(1)
    pod = Pod(tmp_path, extra=("--metrics-port", str(port)))
    pod.start_server()
    try:
        a = pod.acquire("a")
        granted(a)
        b = pod.acquire("b")
        pod.wait_waiting("b")
        a.kill9()  # a failover: b is granted a new epoch
        granted(b, timeout=5)
        assert _scrape(port)["understudy_lock_rearm_seconds_count"] == 0
        pod.acquire("a2")  # a's restart queues up: the pod is armed again
        pod.wait_waiting("a2")
        m = _scrape(port)
        assert m["understudy_lock_rearm_seconds_count"] == 1
        assert m['understudy_lock_grants_total{resumed="false"}'] == 2
        assert m["understudy_lock_handovers_total"] == 1
        assert m["understudy_lock_handover_seconds_count"] == 1
        assert m['understudy_lock_handover_seconds_bucket{le="1.0"}'] == 1  # EOF → grant, fast
        assert StateFile(pod.state).read().counters.handovers == 1
        pod.server.kill9()  # before any further write or scrape
        pod.start_server()
        wait_for(lambda: pod.status().holder == "b", 10, what="b resumes")
        after = _scrape(port)
        assert after['understudy_lock_grants_total{resumed="false"}'] == 2
        assert after['understudy_lock_grants_total{resumed="true"}'] == 1  # b's resume
        assert after["understudy_lock_handovers_total"] == 1  # the resume is no failover
        assert after["understudy_lock_handover_seconds_count"] == 1
        assert after["understudy_lock_rearm_seconds_count"] == 1  # a2 waiting again is no re-arm
        assert after['understudy_lock_window_closed_total{reason="reclaimed"}'] == 1
        assert (
            after["understudy_lock_handover_seconds_sum"]
            == m["understudy_lock_handover_seconds_sum"]
        )
    finally:
        pod.close()


# A holder as an engine holds the lock, its death word armed beside its
# heartbeat (as the engine shim's main loop does) or not, and its lock
# connection open in a forked child too: its death then never closes that
# connection, so only the word can tell the lock server it died.
HOLDER = """
import json, os, sys, time
from pathlib import Path
from understudy.lockserver import client
from understudy.wire import deathword
from understudy.wire.heartbeat import HeartbeatWriter
from understudy.wire.serving import heartbeat_path
sock, engine_id, arm = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "arm"
if arm:
    beat = heartbeat_path(sock.parent, engine_id)
    HeartbeatWriter(beat).beat(0)
    deathword.arm(deathword.word_path(beat))
memory = bytearray(256 << 20)  # to tear down, as an engine's heaps
for i in range(0, len(memory), 4096):
    memory[i] = 1
held = client.acquire(str(sock), engine_id, 10)
child = os.fork()
if child == 0:
    time.sleep(3600)
    os._exit(0)
print(json.dumps({"event": "granted", "epoch": held.epoch, "child": child}), flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize(
    ("armed", "at_death"),
    [(True, True), (False, True), (True, False)],
    ids=["word", "no-word", "word-but-gpu-pod"],
)
def test_a_dead_holder_whose_connection_lives_on_is_released_by_its_death_word(
    tmp_path, armed, at_death
):
    pod = Pod(tmp_path, extra=("--grant-at-death",) if at_death else ())
    pod.start_server()
    a = Proc([sys.executable, "-c", HOLDER, str(pod.sock), "a", "arm" if armed else "bare"])
    pod.procs.append(a)
    first = a.json_line(15)
    child = first["child"]
    try:
        b = pod.acquire("b")
        pod.wait_waiting("b")
        a.signal(signal.SIGKILL)  # not reaped yet: its leader stays, on its way out
        if armed and at_death:
            assert granted(b, timeout=5) > first["epoch"]
            log = pod.log.read_text()
            assert "event=holder_died engine_id=a " in log and "signal=death_word" in log
            assert "reason=process_died was_holder=True" in log
            # ...and the dead holder's teardown waited for idle CPU, for a
            # while: its pid from its heartbeat, its threads found on their
            # way out, and put back (as root; else it is left as it was).
            done = "event=teardown_restored" if priority.may_restore() else "teardown_priority_kept"
            wait_for(lambda: done in pod.log.read_text(), 5)
            log = pod.log.read_text()
            if priority.may_restore():
                idle = log.split("event=teardown_idle ")[1].splitlines()[0]
                assert f"pid={a.pid}" in idle and "threads=0" not in idle, idle
                assert f"event=teardown_restored engine_id=a pid={a.pid} threads=" in log
        else:
            # Without a word, or in a pod whose devices are free only once
            # the process is gone, a connection that outlives its holder
            # keeps the lock: what the word is for, and where it must not be.
            assert b.no_line(1.5)
            assert pod.status().holder == "a"
            os.kill(child, signal.SIGKILL)
            assert granted(b, timeout=5) > first["epoch"]
            assert "holder_died" not in pod.log.read_text()
            assert "teardown_" not in pod.log.read_text()
        a.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        pod.close()
