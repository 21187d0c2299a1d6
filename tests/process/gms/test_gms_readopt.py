"""GMS re-adoption with real processes: GMS killed (-9) under a client that maps
the committed layout; the restarted server gets that very memory back.

No process re-reads anything: the restarted server holds the memory the dead
one created (its memfds, by name), a sleeping reader remaps the same layout
hash and bytes, and a loader that came meanwhile is granted RO instead of
loading. Run on host memory and on the CUDA driver double (its handles
re-exported and imported again; UNVERIFIED on a GPU).
"""

from __future__ import annotations

import signal
import time

import pytest
from gmsprocs import Agent, Gms, memfd_holders
from procs import wait_for

pytestmark = pytest.mark.process

MiB = 1 << 20
SIZES = (3 * MiB, 1 * MiB)


@pytest.fixture(params=["host", "cuda"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda":
        request.getfixturevalue("cuda_double")  # the double in every process's environment
    return str(request.param)


def _loaded(gms: Gms) -> Agent:
    """An engine that loaded the weights and serves from them: RW, commit, mapped RO."""
    w = gms.agent("active")
    assert w.ok("connect", path=str(gms.path()), mode="RW_OR_RO", timeout=30)["granted"] == "RW"
    for i, size in enumerate(SIZES):
        w.ok("allocate", size=size)
        w.ok("fill", index=i, seed=40 + i)
    w.ok("put_metadata", key="layer.0", value={"alloc": 0, "offset": 0})
    w.ok("commit")
    return w


def _dies(gms: Gms, server: object) -> None:
    server.popen.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
    server.popen.wait(10)  # type: ignore[attr-defined]


def test_the_restarted_gms_gets_the_same_memory_back(gms: Gms, backend: str) -> None:
    first = gms.server(0, "--backend", backend, "--adopt-window", "20")
    active = _loaded(gms)
    digest = gms.state()["layout_hash"]
    standby = gms.agent("standby")
    standby.ok("connect", path=str(gms.path()), mode="RO", timeout=30)
    standby.ok("import")
    standby.ok("unmap")  # asleep: no session, nothing mapped

    _dies(gms, first)
    wait_for(lambda: any(e.get("event") == "lost" for e in active.events)
             or active("device_health").get("ok") is False, 10, what="the loss seen")  # fmt: skip
    second = gms.server(0, "--backend", backend, "--adopt-window", "20")
    assert gms.state()["state"] == "ORPHANED"
    # A restarted primary asks to load: it waits for the layout on its way back.
    loader = gms.agent("loader")
    loader.send(op="connect", path=str(gms.path()), mode="RW_OR_RO", timeout=30)
    time.sleep(0.5)
    assert gms.state()["waiting"] == 1

    got = active.ok("readopt", timeout=10)
    assert got == {"ok": True, "how": "adopted", "layout_hash": digest}
    assert loader.json_line(30)["granted"] == "RO"  # no reload
    state = gms.state()
    assert state["committed"] and state["layout_hash"] == digest
    assert state["allocations"] == len(SIZES)
    # The serving engine's bytes never moved; the sleeper wakes over the same layout.
    for i in range(len(SIZES)):
        assert active.ok("verify", index=i, seed=40 + i)["equal"]
    standby.ok("remap", timeout=10)
    for i in range(len(SIZES)):
        assert standby.ok("verify", index=i, seed=40 + i)["equal"]
    if backend == "host":
        # The new server holds the memory the dead one created, and created none.
        old, new = first.popen.pid, second.popen.pid  # type: ignore[attr-defined]
        holders = memfd_holders(f"understudy-gms-{old}-")
        assert any(h.startswith(f"{new} fd") for h in holders), holders
        assert not [h for h in memfd_holders(f"understudy-gms-{new}-") if "fd" in h]


def test_an_engine_that_slept_through_it_is_told_to_wait_not_to_fail(gms: Gms) -> None:
    """A standby woken while the layout is on its way back waits in its remap."""
    first = gms.server(0, "--adopt-window", "20")
    active = _loaded(gms)
    standby = gms.agent("standby")
    standby.ok("connect", path=str(gms.path()), mode="RO", timeout=30)
    standby.ok("import")
    standby.ok("unmap")
    _dies(gms, first)
    gms.server(0, "--adopt-window", "20")
    standby.send(op="remap", timeout=30)
    time.sleep(0.5)
    active.ok("readopt", timeout=10)
    assert standby.json_line(30)["ok"]


def test_with_nobody_to_give_it_back_the_pod_loads_anew_after_the_window(gms: Gms) -> None:
    first = gms.server(0, "--adopt-window", "3")
    active = _loaded(gms)
    active.ok("close")  # nobody maps the layout any more
    _dies(gms, first)
    t0 = time.monotonic()
    gms.server(0, "--adopt-window", "3")
    assert gms.state()["state"] == "ORPHANED"
    loader = gms.agent("loader")
    got = loader.ok("connect", path=str(gms.path()), mode="RW_OR_RO", timeout=30)
    assert got["granted"] == "RW"  # today's path: the primary loads the checkpoint
    assert time.monotonic() - t0 >= 3.0  # but only once the window closed


def test_an_adopter_of_another_layout_is_refused_and_nothing_changes(gms: Gms) -> None:
    first = gms.server(0, "--adopt-window", "20")
    active = _loaded(gms)
    _dies(gms, first)
    gms.server(0, "--adopt-window", "20")
    # Another engine loaded and committed a different layout meanwhile? Not
    # while orphaned: it waits. After the window, a new layout wins and the
    # old adopter is refused with stale_layout.
    gms.procs[-1].popen.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
    gms.procs[-1].popen.wait(10)  # type: ignore[attr-defined]
    (gms.dir / "gms_0_weights.layout").unlink()  # a record lost with it
    gms.server(0)
    other = gms.agent("other")
    other.ok("connect", path=str(gms.path()), mode="RW", timeout=30)
    other.ok("allocate", size=MiB)
    other.ok("commit")
    refused = active("readopt", timeout=10)
    assert not refused["ok"] and "stale_layout" in refused["message"], refused
