"""The router's view of real engine processes: their CPU time, from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from understudy.front.router import PodEngines
from understudy.front.upstream import Broken, Upstream, UpstreamError


def test_cpu_ticks_advance_while_a_process_works_and_stop_when_it_is_stopped(
    tmp_path: Path,
) -> None:
    engines = PodEngines(tmp_path)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = engines.cpu_ticks(busy.pid)
        assert first is not None
        deadline = time.monotonic() + 10
        while (engines.cpu_ticks(busy.pid) or 0) <= first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (engines.cpu_ticks(busy.pid) or 0) > first
        os.kill(busy.pid, signal.SIGSTOP)
        time.sleep(0.05)  # the stop takes effect
        stopped = engines.cpu_ticks(busy.pid)
        time.sleep(0.3)
        assert engines.cpu_ticks(busy.pid) == stopped
    finally:
        busy.kill()
        busy.wait()
    assert engines.cpu_ticks(busy.pid) is None  # reaped: no such process


# An engine as the front sees one: its death word armed beside its heartbeat
# (as the engine shim does), answering every request with an event stream
# that never ends, on its serving socket; and a child that keeps its
# sockets open, so that only the word can tell the front it died.
ENGINE = """
import os, socket, sys, threading, time
from pathlib import Path
from understudy.wire import deathword
from understudy.wire.serving import heartbeat_path, serving_socket
run, engine_id = Path(sys.argv[1]), sys.argv[2]
deathword.arm(deathword.word_path(heartbeat_path(run, engine_id)))
listener = socket.socket(socket.AF_UNIX)
listener.bind(str(serving_socket(run, engine_id)))
listener.listen()
def serve(conn):
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\n"
                 b"transfer-encoding: chunked\\r\\n\\r\\n")
    conn.sendall(b"8\\r\\ndata: 1\\n\\r\\n")
    time.sleep(3600)
print("ready", flush=True)
for _ in range(2):
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
child = os.fork()
if child == 0:
    time.sleep(3600)
print(child, flush=True)
time.sleep(3600)
"""


async def test_a_dead_engines_requests_break_at_its_word_and_count_together(
    tmp_path: Path,
) -> None:
    """The front breaks every request on an engine the moment its death word
    says it died, and keeps how many it broke (each is resent with that
    count: wire.serving.COHORT_HEADER)."""
    (tmp_path / "serve").mkdir()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ENGINE, str(tmp_path), "e/1", stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    child = 0
    try:
        assert await proc.stdout.readline() == b"ready\n"
        up = PodEngines(tmp_path).upstream("e/1")
        heads = [await (await up.send(b"POST", b"/v1/completions", [], b"{}")).head() for _ in "ab"]
        child = int(await proc.stdout.readline())
        assert up.busy == 2 and up.broke_together == 0
        proc.kill()
        for r in heads:
            with pytest.raises(UpstreamError):
                async with asyncio.timeout(5):  # the child keeps the sockets open
                    async for _ in r.chunks():
                        pass
        assert up.closed and up.broke_together == 2
    finally:
        for pid in (proc.pid, child):
            with contextlib.suppress(ProcessLookupError):
                if pid:
                    os.kill(pid, signal.SIGKILL)
        await proc.wait()


# An engine that answers its first request in full, takes a second and
# answers nothing, and exits (as a drained engine does at its drain's end).
ANSWERS_THEN_EXITS = """
import socket, sys
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
print("ready", flush=True)
served, unserved = listener.accept()[0], listener.accept()[0]
served.recv(65536), unserved.recv(65536)
served.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nok")
"""


async def test_an_answer_written_before_its_engine_died_is_kept(tmp_path: Path) -> None:
    """The death word can be handled in the loop's turn before the answer's
    bytes are read: the engine's finished answer still counts (a drain that
    ended is not a death to its requests), and only the unanswered request
    breaks, alone in its cohort."""
    path = str(tmp_path / "engine.sock")
    # Blocking on purpose: the loop must not turn while the engine answers.
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", ANSWERS_THEN_EXITS, path], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == b"ready\n"
        up = Upstream(path)
        served = await up.send(b"POST", b"/v1/checksum", [], b"{}")
        unserved = await up.send(b"POST", b"/v1/checksum", [], b"{}")
        # Not a turn of the loop from here to the abort: the answer and the
        # end of both connections wait in the kernel, unread, as they do
        # when the word's callback runs first.
        assert proc.wait(10) == 0
        assert not served.complete and up.busy == 2
        assert up.abort() == 1
        assert served.complete and served.status == 200 and served.body() == b"ok"
        with pytest.raises(Broken):
            await unserved.head()
        assert up.closed
    finally:
        proc.kill()
        proc.wait()
