"""Sleep and wake, and a GMS that crashed meanwhile. Same addresses; a
restarted GMS fails the wake within its timeout; a different layout is
StaleMemoryLayoutError. And a lost connection while mapped reaches on_lost."""

from __future__ import annotations

import json
import signal
import time

import pytest
from gmsprocs import Agent, Gms
from procs import wait_for

pytestmark = pytest.mark.process

MiB = 1 << 20
SIZES = (3 * MiB, MiB, 5 * MiB)


def load(gms: Gms, sizes: tuple[int, ...] = SIZES, seed: int = 0) -> Agent:
    writer = gms.agent("writer")
    writer.ok("connect", path=str(gms.path()), mode="RW_OR_RO", timeout=10)
    for i, size in enumerate(sizes):
        writer.ok("allocate", size=size)
        writer.ok("fill", index=i, seed=seed + i)
        writer.ok("put_metadata", key=f"t{i}", value={"alloc": i, "offset": 0})
    writer.ok("commit")
    return writer


def reader(gms: Gms) -> Agent:
    r = gms.agent("reader")
    r.ok("connect", path=str(gms.path()), mode="RO", timeout=10)
    r.ok("import")
    return r


def test_sleep_and_wake_at_the_same_addresses(gms: Gms) -> None:
    gms.server()
    writer = load(gms)
    shadow = reader(gms)
    for p in (writer, shadow):
        before = p.ok("addresses")["addresses"]
        kept = [p.ok("keep_view", index=i)["kept"] for i in range(len(SIZES))]
        p.ok("unmap")
        p.ok("remap", timeout=5)
        assert p.ok("addresses")["addresses"] == before
        for i, k in enumerate(kept):  # numpy arrays built from the raw address, before sleep
            assert p.ok("verify_kept", kept=k, seed=i)["equal"]
            assert not p.ok("verify_kept", kept=k, seed=i + 100)["equal"]
    assert gms.state()["sessions"] == {"RW": 0, "RO": 2, "ADOPT": 0}


def test_remap_after_gms_restart_fails_within_its_timeout_then_stale(gms: Gms) -> None:
    server = gms.server()
    writer = load(gms)
    shadow = reader(gms)
    for p in (writer, shadow):
        p.ok("unmap")
    server.kill9()
    gms.server()  # fresh: nothing committed
    timeout = 1.5
    for p in (writer, shadow):
        got = p("remap", timeout=timeout, wait=timeout + 10)
        assert not got["ok"] and got["error"] == "GmsTimeoutError", got
        assert got["elapsed"] < timeout + 2.0  # bounded by its timeout, never hangs
    assert gms.state()["waiting"] == 0  # the expired waits are gone

    # Meanwhile a new engine loads a different layout and commits it.
    other = load(gms, sizes=(2 * MiB, 2 * MiB), seed=50)
    for p in (writer, shadow):
        got = p("remap", timeout=5)
        assert not got["ok"] and got["error"] == "StaleMemoryLayoutError", got
    other.ok("close")


def test_remap_while_gms_is_down_is_bounded(gms: Gms) -> None:
    server = gms.server()
    writer = load(gms, sizes=(MiB,))
    writer.ok("unmap")
    server.kill9()  # no server at all: the socket path is dead
    got = writer("remap", timeout=1.0, wait=15)
    assert not got["ok"] and got["error"] == "GmsTimeoutError" and got["elapsed"] < 3.0


def test_lost_connection_while_mapped_is_reported(gms: Gms) -> None:
    server = gms.server()
    writer = load(gms, sizes=(MiB,))
    shadow = reader(gms)
    sleeper = reader(gms)
    sleeper.ok("unmap")  # sleeping: no socket, nothing to report
    server.signal(signal.SIGKILL)
    for p in (writer, shadow):
        wait_for(lambda p=p: any(e["event"] == "lost" for e in _drain(p)), 10, what="on_lost")
    assert sleeper.no_line(0.5)


def test_a_server_lost_inside_a_remap_is_reported_once_it_maps(
    gms: Gms, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server dies after a remap's exports arrived and before the session
    counts as mapped (the failpoint holds the remap there). The remap still
    ends mapped, and the hang-up reaches on_lost once: a waking engine must not
    serve from a session whose server is gone, for then it never gives its
    layout back and the restarted GMS stays empty (seen on the cluster: a
    shadow waited for weights for ever, 2026-12-05)."""
    server = gms.server()
    load(gms, sizes=(MiB,))
    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", "gms.remap.mapped=sleep(3)")
    shadow = reader(gms)
    shadow.ok("unmap")
    shadow.send(op="remap", timeout=5)
    # Its session is back (the writer's and its own), then its exports take
    # milliseconds: well inside the failpoint's 3 s when the server dies.
    wait_for(lambda: gms.state()["sessions"]["RO"] == 2, 10, what="the remap's session")
    time.sleep(0.5)
    server.kill9()
    got = shadow.json_line(15)
    while "event" in got:  # the reply to the remap, past any event before it
        shadow.events.append(got)
        got = shadow.json_line(15)
    assert got["ok"], got
    wait_for(lambda: any(e["event"] == "lost" for e in _drain(shadow)), 10, what="on_lost")
    assert shadow.no_line(0.5)
    assert sum(e["event"] == "lost" for e in _drain(shadow)) == 1


def _drain(agent: Agent) -> list[dict[str, object]]:
    while not agent.lines.empty():
        agent.events.append(json.loads(agent.lines.get()))
    return agent.events
