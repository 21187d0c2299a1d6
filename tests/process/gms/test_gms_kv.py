"""The KV pool through real GMS server and client processes: granted to the
lock's holder only, handed on after the holder's kill -9 with its bytes as
they were, refused to a stale epoch, lost with GMS; the cuda backend through
the CUDA driver double (UNVERIFIED on a GPU)."""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.request
from pathlib import Path

import pytest
from doubles.gpu import GpuDouble
from gmsprocs import Agent, Gms
from localpod import free_port_block
from procs import PYTHON, Proc, understudy, wait_for

from understudy.gms.fsm import LockWord
from understudy.gms.lockword import read_lock_word
from understudy.wire import lockrecord

pytestmark = pytest.mark.process

MiB = 1 << 20


_seq = [0]


def lock_record(path: Path, holder: str | None, epoch: int) -> None:
    """What the lock server writes before a grant (a copy replaced whole, as it does)."""
    _seq[0] += 1
    copy = lockrecord.copy_paths(path)[_seq[0] % 2]
    tmp = copy.with_suffix(".tmp")
    tmp.write_bytes(lockrecord.encode(_seq[0], {"holder": holder, "epoch": epoch}))
    tmp.replace(copy)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def acquire(a: Agent, gms: Gms, epoch: int, name: str, timeout: float = 5) -> dict[str, object]:
    return a(
        "kv_acquire", path=str(gms.path()), epoch=epoch, size=3 * MiB, name=name, timeout=timeout
    )


@pytest.fixture
def lock_state(gms: Gms) -> Path:
    return gms.tmp / "lock.state"


def test_the_holder_gets_the_pool_and_the_next_holder_gets_it_as_it_was(
    gms: Gms, lock_state: Path
) -> None:
    port = free_port_block(1)
    gms.server(0, "--lock-state", str(lock_state), "--metrics-port", str(port))
    lock_record(lock_state, "e1", 1)
    first = gms.agent("first")
    got = acquire(first, gms, 1, "e1")
    assert got["ok"] and got["created"] and got["previous_epoch"] is None, got
    first.ok("kv_fill", seed=5)
    assert metric(port, "understudy_gms_kv_pool_holder_epoch") == 1
    assert metric(port, "understudy_gms_kv_pool_bytes") == 4 * MiB

    stale = gms.agent("stale")  # an engine that never held the lock
    got = acquire(stale, gms, 0, "e0")
    assert not got["ok"] and "stale_epoch" in got["message"], got
    twice = gms.agent("twice")  # the holder's epoch, from another process: never mapped twice
    got = acquire(twice, gms, 1, "e1")
    assert not got["ok"] and "maps the KV pool" in got["message"], got

    # The holder dies; the lock server grants the next engine (its record says so).
    lock_record(lock_state, "e2", 2)
    second = gms.agent("second")
    second.send(op="kv_acquire", path=str(gms.path()), epoch=2, size=3 * MiB, name="e2", timeout=20)
    assert second.no_line(1.0)  # waits: epoch 1 still maps the pool
    first.kill9()
    got = second.json_line(20)
    assert got["ok"] and not got["created"] and got["previous_epoch"] == 1, got
    assert second.ok("kv_verify", seed=5)["equal"]  # the bytes epoch 1 left
    state = gms.state()
    assert state["kv"]["holder_epoch"] == 2 and state["kv"]["grants"] == 2
    assert metric(port, "understudy_gms_kv_pool_holder_epoch") == 2
    assert state["kv"]["bytes"] == 4 * MiB  # 3 MiB, aligned to the host's 2 MiB

    # The old epoch, back from the dead, is refused: the lock moved on.
    again = gms.agent("again")
    got = acquire(again, gms, 1, "e1")
    assert not got["ok"] and "epoch 2" in got["message"], got


def test_a_reader_maps_the_pool_read_only_as_it_is(gms: Gms, lock_state: Path) -> None:
    """``kv_peek``: a standby's view of the pool, before and across a failover.
    It sees the holder's bytes as they are written, never holds the pool up,
    and cannot write: the kernel kills a process that tries."""
    port = free_port_block(1)
    gms.server(0, "--lock-state", str(lock_state), "--metrics-port", str(port))
    reader = gms.agent("reader")
    peek = {"path": str(gms.path()), "size": 3 * MiB}
    got = reader("kv_peek", **peek)
    assert not got["ok"] and "not_found" in got["message"] and "no KV pool" in got["message"]

    lock_record(lock_state, "e1", 1)
    first = gms.agent("first")
    assert acquire(first, gms, 1, "e1")["ok"]
    first.ok("kv_fill", seed=5)
    got = reader("kv_peek", **peek, spec="another")
    assert not got["ok"] and "another geometry" in got["message"], got
    got = reader.ok("kv_peek", **peek)
    assert not got["writable"] and got["previous_epoch"] == 1 and got["size"] == 4 * MiB
    assert reader.ok("kv_peek_verify", seed=5) == {"ok": True, "equal": True, "alive": True}
    first.ok("kv_fill", seed=6)  # the same memory: the reader sees writes at once
    assert reader.ok("kv_peek_verify", seed=6)["equal"]
    assert gms.state()["kv"]["readers"] == 1
    assert metric(port, "understudy_gms_kv_pool_readers") == 1

    # The holder dies: the next one gets the pool at once, the reader mapping it.
    first.kill9()
    lock_record(lock_state, "e2", 2)
    second = gms.agent("second")
    got = acquire(second, gms, 2, "e2")
    assert got["ok"] and got["previous_epoch"] == 1, got
    assert reader.ok("kv_peek_verify", seed=6)["equal"]

    reader.send(op="kv_peek_write")
    assert reader.wait(10) == -signal.SIGSEGV
    assert second.ok("kv_verify", seed=6)["equal"]  # not a byte changed
    wait_for(lambda: gms.state()["kv"]["readers"] == 0, 10, what="the reader's end")
    assert metric(port, "understudy_gms_kv_pool_readers") == 0


def test_without_a_lock_record_the_epoch_fences(gms: Gms) -> None:
    gms.server(0, "--lock-state", "none")
    a = gms.agent("a")
    assert acquire(a, gms, 4, "e4")["ok"]
    a.ok("kv_close")  # unmapped and ended: the pool passes on
    b = gms.agent("b")
    got = acquire(b, gms, 3, "e3")
    assert not got["ok"] and "older than 4" in got["message"], got
    got = acquire(b, gms, 5, "e5")
    assert got["ok"] and got["previous_epoch"] == 4, got


def test_a_wait_for_the_pool_has_a_deadline(gms: Gms, lock_state: Path) -> None:
    gms.server(0, "--lock-state", str(lock_state))
    lock_record(lock_state, "e1", 1)
    a = gms.agent("a")
    assert acquire(a, gms, 1, "e1")["ok"]
    lock_record(lock_state, "e2", 2)
    b = gms.agent("b")
    got = acquire(b, gms, 2, "e2", timeout=0.5)
    assert not got["ok"] and got["error"] == "GmsTimeoutError", got


def test_gms_dying_loses_the_pool(gms: Gms, lock_state: Path) -> None:
    server = gms.server(0, "--lock-state", str(lock_state))
    lock_record(lock_state, "e1", 1)
    a = gms.agent("a")
    assert acquire(a, gms, 1, "e1")["ok"]
    a.ok("kv_fill", seed=9)
    server.kill9()
    wait_for(lambda: any(e.get("event") == "kv_lost" for e in _events(a)), 10, what="kv_lost")
    # The holder's mapping stays valid: its memory is not GMS's to take back.
    assert a.ok("kv_verify", seed=9)["equal"]
    gms.procs.remove(server)
    gms.path().unlink(missing_ok=True)
    gms.server(0, "--lock-state", str(lock_state))
    assert gms.state()["kv"] is None
    lock_record(lock_state, "e2", 2)
    b = gms.agent("b")
    got = acquire(b, gms, 2, "e2")
    assert got["ok"] and got["created"], got  # a new pool: the next engine recomputes
    assert not b.ok("kv_verify", seed=9)["equal"]


def _events(a: Agent) -> list[dict[str, object]]:
    while not a.no_line(0.05):
        a.events.append(a.json_line(1))
    return a.events


def test_the_lock_servers_own_record_is_what_gms_reads(tmp_path: Path) -> None:
    """The record a real lock server writes on a grant, read by GMS's reader."""
    state = tmp_path / "lock.state"
    sock = tmp_path / "lock.sock"
    server = Proc(
        understudy("lockserver", "serve", "--socket", str(sock), "--state-file", str(state)),
        log=tmp_path / "lock.log",
    )
    code = (
        "import sys, time\n"
        "from understudy.lockserver import client\n"
        f"held = client.acquire({str(sock)!r}, 'engine-a/1', 10)\n"
        "print(held.epoch, flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = Proc([PYTHON, "-c", code], log=tmp_path / "holder.log")
    try:
        epoch = int(holder.lines.get(timeout=30))
        assert read_lock_word(state) == (LockWord("engine-a/1", epoch), "")
        holder.kill9()
        wait_for(lambda: read_lock_word(state)[0] == LockWord(None, epoch), 10, what="release")
    finally:
        holder.stop()
        server.stop()
    assert read_lock_word(tmp_path / "nothing") == (
        None,
        f"no lock record at {tmp_path / 'nothing'}",
    )
    (tmp_path / "bad").write_text("{not json")
    assert read_lock_word(tmp_path / "bad")[0] is None
    assert read_lock_word(None) == (None, "no lock record configured")


def test_the_cuda_backend_hands_the_pool_on(
    gms: Gms, lock_state: Path, cuda_double: GpuDouble
) -> None:
    """Through the CUDA driver double (host memory, not a GPU): UNVERIFIED on a GPU."""
    gms.server(0, "--backend", "cuda", "--lock-state", str(lock_state))
    lock_record(lock_state, "e1", 1)
    first = gms.agent("first")
    got = acquire(first, gms, 1, "e1")
    assert got["ok"] and got["created"], got
    first.ok("kv_fill", seed=3)
    first.kill9()
    lock_record(lock_state, "e2", 2)
    second = gms.agent("second")
    got = acquire(second, gms, 2, "e2", timeout=20)
    assert got["ok"] and not got["created"] and got["previous_epoch"] == 1, got
    assert second.ok("kv_verify", seed=3)["equal"]


@pytest.mark.parametrize(
    ("armed", "backend"),
    [(True, "host"), (False, "host"), (True, "cuda")],
    ids=["word", "no-word", "word-but-gpu"],
)
def test_a_dead_holder_whose_connection_lives_on_gives_the_pool_at_its_death_word(
    gms: Gms, lock_state: Path, armed: bool, backend: str, request: pytest.FixtureRequest
) -> None:
    """The holder's KV connection is kept open by a forked child, so its death
    never closes it: only its death word can tell GMS the pool is free. GMS
    reads it for host memory; a GPU's (here the CUDA driver double's) is free
    only once the process is gone, so there it waits for the close."""
    if backend == "cuda":
        request.getfixturevalue("cuda_double")
    gms.server(0, "--backend", backend, "--lock-state", str(lock_state))
    lock_record(lock_state, "e1", 1)
    first = gms.agent("first")
    if armed:
        first.ok("arm_death_word", run_dir=str(lock_state.parent), name="e1")
    assert acquire(first, gms, 1, "e1")["ok"]
    first.ok("kv_fill", seed=9)
    child = first.ok("fork_holder")["child"]
    try:
        lock_record(lock_state, "e2", 2)
        second = gms.agent("second")
        second.send(
            op="kv_acquire", path=str(gms.path()), epoch=2, size=3 * MiB, name="e2", timeout=20
        )
        assert second.no_line(0.5)  # epoch 1 maps the pool
        first.kill9()
        if armed and backend == "host":
            got = second.json_line(5)
            assert got["ok"] and got["previous_epoch"] == 1, got
            log = (gms.tmp / "server0.log").read_text()
            assert "event=kv_holder_died" in log and "client=e1" in log
        else:
            assert second.no_line(1.5)  # the connection lives on: so does the hold
            os.kill(child, signal.SIGKILL)
            got = second.json_line(10)
            assert got["ok"] and got["previous_epoch"] == 1, got
            assert "kv_holder_died" not in (gms.tmp / "server0.log").read_text()
        assert second.ok("kv_verify", seed=9)["equal"]  # as the dead holder left it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
