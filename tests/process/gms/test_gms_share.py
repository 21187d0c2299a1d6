"""Shared, not copied; read-only enforced; gone when everyone is gone."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from gmsprocs import Gms, memfd_holders
from procs import wait_for

pytestmark = pytest.mark.process

GiB = 1 << 30
MiB = 1 << 20


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_one_gib_written_once_read_by_two_processes_shared_not_copied(gms: Gms) -> None:
    shmem0 = meminfo("Shmem")
    server = gms.server()
    prefix = f"understudy-gms-{server.pid}-"
    writer = gms.agent("writer")
    assert (
        writer.ok("connect", path=str(gms.path()), mode="RW_OR_RO", timeout=10)["granted"] == "RW"
    )
    writer.ok("allocate", size=GiB)
    writer.ok("fill", index=0, seed=7, wait=120)
    writer.ok("put_metadata", key="w", value={"offset": 0, "dtype": "uint64", "shape": [GiB // 8]})
    digest = writer.ok("commit")["layout_hash"]

    readers = [gms.agent(f"reader{i}") for i in range(2)]
    for r in readers:
        got = r.ok("connect", path=str(gms.path()), mode="RO", timeout=10)
        assert got["granted"] == "RO" and got["layout_hash"] == digest
        imported = r.ok("import")
        assert imported["metadata"] == {"w": {"offset": 0, "dtype": "uint64", "shape": [GiB // 8]}}
        assert [a["size"] for a in imported["allocations"]] == [GiB]
    for r in readers:
        assert r.ok("verify", index=0, seed=7, wait=120)["equal"]
        assert not r.ok("verify", index=0, seed=8, wait=120)["equal"]  # the check can fail

    # Three processes map the same 1 GiB: each has it resident, each is charged a third.
    for r in readers:
        sm = r.ok("smaps")
        assert sm["Rss"] >= GiB, sm
        assert sm["Pss"] < 0.6 * GiB, sm  # a private copy would put Pss above 1 GiB
    assert meminfo("Shmem") - shmem0 < 1.5 * GiB  # one physical copy, not three
    assert gms.state()["sessions"] == {"RW": 0, "RO": 3, "ADOPT": 0}

    for p in (*readers, writer):
        p.ok("close")
        p.stop()
    server.signal(signal.SIGTERM)
    assert server.wait(20) == 0
    wait_for(lambda: not memfd_holders(prefix), 10, what="memfds released")
    # Machine-wide Shmem is shared with other workloads: a loose bound.
    wait_for(lambda: meminfo("Shmem") - shmem0 < 256 * MiB, 10, what="Shmem back to baseline")


def test_memory_is_gone_after_kill_9_of_everyone(gms: Gms) -> None:
    server = gms.server()
    prefix = f"understudy-gms-{server.pid}-"
    writer = gms.agent("writer")
    writer.ok("connect", path=str(gms.path()), mode="RW", timeout=10)
    writer.ok("allocate", size=8 * MiB)
    writer.ok("fill", index=0, seed=1)
    writer.ok("commit")
    reader = gms.agent("reader")
    reader.ok("connect", path=str(gms.path()), mode="RO", timeout=10)
    reader.ok("import")
    assert memfd_holders(prefix)
    for p in (writer, reader, server):
        p.kill9()
    wait_for(lambda: not memfd_holders(prefix), 10, what="memfds released")


def test_writer_killed_before_commit_aborts(gms: Gms) -> None:
    server = gms.server()
    prefix = f"understudy-gms-{server.pid}-"
    writer = gms.agent("writer")
    writer.ok("connect", path=str(gms.path()), mode="RW_OR_RO", timeout=10)
    for _ in range(3):
        writer.ok("allocate", size=3 * MiB)
    writer.ok("put_metadata", key="w", value={"offset": 0})
    assert gms.state()["allocations"] == 3
    writer.kill9()
    wait_for(lambda: gms.state()["state"] == "EMPTY", 10, what="abort")
    st = gms.state()
    assert st["allocations"] == 0 and st["bytes"] == 0 and st["layout_hash"] is None
    assert not memfd_holders(prefix)  # the server closed every memfd too
    assert server.alive()


@pytest.mark.parametrize("role", ["reader", "writer_after_commit"])
def test_read_only_mappings_fault_on_write(gms: Gms, role: str) -> None:
    gms.server()
    writer = gms.agent("writer")
    writer.ok("connect", path=str(gms.path()), mode="RW", timeout=10)
    writer.ok("allocate", size=MiB)
    assert writer.ok("write", index=0)["wrote"]  # writable before commit
    writer.ok("commit")
    victim = writer
    if role == "reader":
        victim = gms.agent("reader")
        victim.ok("connect", path=str(gms.path()), mode="RO", timeout=10)
        victim.ok("import")
    assert victim.popen.stdin is not None
    victim.popen.stdin.write(b'{"op": "write", "index": 0}\n')
    victim.popen.stdin.flush()
    assert victim.wait(20) == -signal.SIGSEGV
