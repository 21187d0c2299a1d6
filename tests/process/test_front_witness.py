"""The front's witness (``understudy.front.witness``): a connection the front
accepted and was killed holding alone, before the lock server had its copy,
is kept all the same, because the witness shares the front's descriptor
table and gives it to the keeper once the front is dead.

The first test is the mechanism alone: a process makes its witness, accepts
one connection and SIGKILLs itself without handing it to anyone; a real
keeper gets it from the witness, and the client's bytes are read and
answered through the kept copy. The same process without its witness loses
the connection (the control: what the window cost before). The second is
the pod: the front is killed at the failpoint before the copy, on every
connection it accepts, and the next front answers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from localpod import LocalPod, http_json
from procs import shm_dir, wait_for

from understudy.wire import connhold

pytestmark = [pytest.mark.process]

log = logging.getLogger("test")

# A front reduced to the window: witness, keeper session, accept, death.
FRONT = textwrap.dedent(
    """
    import os, signal, socket, sys
    from pathlib import Path
    from understudy.front import witness
    from understudy.wire import connhold

    run, witnessed = Path(sys.argv[1]), sys.argv[2] == "1"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if witnessed:
        assert witness.start(run, port)
    session = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session.connect(str(run / connhold.CONNS_SOCKET))
    print(port, flush=True)
    conn, _ = listener.accept()  # ... and killed before its copy goes to the keeper
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


async def _killed_in_the_window(witnessed: bool) -> tuple[list[tuple[str, int]], bytes]:
    """Run FRONT against a real keeper and one client; what the next front
    adopts, and what the client reads after the next front answered."""
    with shm_dir() as run:
        return await _killed_in(run, witnessed)


async def _killed_in(run: Path, witnessed: bool) -> tuple[list[tuple[str, int]], bytes]:
    keeper = connhold.Keeper(run / connhold.CONNS_SOCKET, log)
    task = asyncio.create_task(keeper.serve_forever())
    await asyncio.to_thread(wait_for, keeper.path.exists, 10, what="the keeper's socket")
    front = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FRONT, str(run), "1" if witnessed else "0",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    client = None
    try:
        assert front.stdout is not None
        port = int(await front.stdout.readline())
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        client.sendall(b"asked")
        assert await asyncio.wait_for(front.wait(), 10) == -9
        nxt = connhold.Holder(keeper.path, log)
        assert await asyncio.to_thread(nxt.connect)
        adopted = await asyncio.to_thread(nxt.adopt)
        answered = [(cid, owned.fd) for cid, owned in adopted]
        for _, owned in adopted:
            kept = socket.socket(fileno=owned.detach())
            assert kept.recv(16) == b"asked"  # never read: the kernel has it all
            kept.sendall(b"answered")
            kept.close()  # the keeper's copy stays open
        for cid, _ in answered:
            nxt.drop(cid)
        nxt.close()
        try:
            got = client.recv(16)
        except ConnectionResetError:
            got = b"reset"
        return answered, got
    finally:
        if client is not None:
            client.close()
        if front.returncode is None:
            front.kill()
            await front.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_connection_the_front_died_holding_alone_is_kept_by_its_witness() -> None:
    adopted, got = await _killed_in_the_window(witnessed=True)
    assert len(adopted) == 1 and adopted[0][0].startswith("w"), adopted
    assert got == b"answered"


async def test_without_the_witness_that_connection_is_lost() -> None:
    adopted, got = await _killed_in_the_window(witnessed=False)
    assert adopted == []
    assert got in (b"", b"reset")


def test_a_front_killed_at_the_accept_before_the_copy_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", "front.accept.copy=kill")
    pod = LocalPod(shadows=1, engine="reference")
    try:
        pod.wait_armed(120)
        first = wait_for(pod.front_pid, 30, what="the front answering")
        [its_witness] = _children(first)
        # One connection: the front that accepts it dies before its copy; its
        # witness gives it to the lock server, and the next front answers it.
        status, body = http_json(
            pod.serve_port,
            "/v1/embeddings",
            {"input": "a request whose front dies before its copy", "encoding_format": "base64"},
            timeout=60,
        )
        assert status == 200, body
        assert body["data"][0]["embedding"]
        second = wait_for(pod.front_pid, 30, what="the next front answering")
        assert second != first
        log_text = pod.log("front")
        assert "event=witness_kept" in log_text and "event=adopted" in log_text
        assert "event=adopt_connection_failed" not in log_text
        assert pod.metric("understudy_front_lost_requests_total") == 0
        assert pod.metric("understudy_front_lost_idle_connections_total") == 0
        # the dead front's witness ended once it had given the connection away
        wait_for(lambda: not Path(f"/proc/{its_witness}").exists(), 10, what="the witness's end")
        assert len(_children(second)) == 1  # the next front has its own
    finally:
        pod.close()


def _children(pid: int) -> list[int]:
    """A process's children (a front's: its witness)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_the_witness_is_made_only_before_threads() -> None:
    code = textwrap.dedent(
        """
        import threading, time
        from pathlib import Path
        from understudy.front import witness
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        assert witness.start(Path("/nonexistent"), 1) is None
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "event=witness_unmade" in done.stderr
