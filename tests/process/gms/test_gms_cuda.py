"""The cuda backend end to end: GMS servers, writer and reader processes, a
TP engine, sleep and wake, and the death of every process in turn.

Each test runs twice:
  double  against the CUDA driver double (hack/cuda-double: host memory, not a
          GPU), always: it proves our calls and their semantics against our
          model of the driver;
  gpu     against a real NVIDIA driver and GPU (marked ``gpu``), skipped where
          there is none. The backend stays UNVERIFIED on a GPU until this
          variant has passed on one.
Every client is its own process, so the test process never loads a driver.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from doubles.gpu import GpuDouble
from gmsprocs import Agent, Engine, Gms, gms_cli, run_cli
from procs import PYTHON, Proc, wait_for

pytestmark = pytest.mark.process

MiB = 1 << 20


def _gpu_reason() -> str | None:
    """Why the gpu variant cannot run here (None: it can). In a child process,
    so that this one never loads a driver."""
    code = (
        "from understudy.gms.backends.cuda_vmm import CudaVmmBackend\n"
        "b = CudaVmmBackend(0)\n"
        "from cuda.bindings import driver\n"
        "print(driver.cuDeviceGetName(100, b._dev)[1].split(b'\\0')[0].decode())\n"
    )
    out = subprocess.run(
        [PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return lines[-1].rpartition("BackendUnavailable: ")[2][:120] if lines else "no answer"
    if "double" in out.stdout:
        return "the CUDA driver double is on the library path, not a GPU"
    return None


GPU_REASON = _gpu_reason()


@pytest.fixture(
    params=[
        "double",
        pytest.param(
            "gpu",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(GPU_REASON is not None, reason=f"no GPU: {GPU_REASON}"),
            ],
        ),
    ]
)
def platform(request: pytest.FixtureRequest) -> GpuDouble | None:
    """The double (its settings in the environment) or, for ``gpu``, None."""
    if request.param == "double":
        double: GpuDouble = request.getfixturevalue("cuda_double")
        return double
    return None


def writer(gms: Gms, sizes: tuple[int, ...], seed: int = 0, device: int = 0) -> Agent:
    w = gms.agent("writer")
    got = w.ok("connect", path=str(gms.path(device)), mode="RW", timeout=30)
    assert got["granted"] == "RW"
    for i, size in enumerate(sizes):
        w.ok("allocate", size=size)
        w.ok("fill", index=i, seed=seed + i)
    w.ok("commit")
    return w


def reader(gms: Gms, device: int = 0) -> Agent:
    r = gms.agent("reader")
    r.ok("connect", path=str(gms.path(device)), mode="RO", timeout=30)
    r.ok("import")
    return r


def used(platform: GpuDouble | None, probe: Agent) -> int:
    """Device memory in use: the double's memfds counted from /proc (independent
    of the double's own bookkeeping), or cuMemGetInfo on a GPU."""
    if platform is not None:
        return platform.used_bytes(0)
    info = probe.ok("mem_info")
    return int(info["total"] - info["free"])


def test_write_commit_import_sleep_wake_at_the_same_addresses(
    gms: Gms, platform: GpuDouble | None
) -> None:
    gms.server(0, "--backend", "cuda")
    sizes = (5 * MiB, 2 * MiB)
    w = writer(gms, sizes)
    r = reader(gms)
    for i in range(len(sizes)):
        assert r.ok("verify", index=i, seed=i)["equal"]
        assert not r.ok("verify", index=i, seed=i + 7)["equal"]
    for p in (w, r):
        before = p.ok("addresses")["addresses"]
        kept = [p.ok("keep_view", index=i)["kept"] for i in range(len(sizes))]
        p.ok("unmap")
        p.ok("remap", timeout=10)
        assert p.ok("addresses")["addresses"] == before
        for i, k in enumerate(kept):  # pointers kept from before the sleep
            assert p.ok("verify_kept", kept=k, seed=i)["equal"]
    state = gms.state()
    assert state["backend"] == "cuda" and state["sessions"] == {"RW": 0, "RO": 2, "ADOPT": 0}


def test_read_only_is_enforced_by_access_flags(gms: Gms, platform: GpuDouble | None) -> None:
    gms.server(0, "--backend", "cuda")
    w = writer(gms, (2 * MiB,))
    r = reader(gms)
    for p in (w, r):  # the writer's mapping became read-only at commit
        got = p("write", index=0)
        assert not got["ok"] and got["error"] == "DeviceCopyError", got
        if platform is not None:  # what the double answers; a GPU may differ
            assert "CUDA_ERROR_ILLEGAL_ADDRESS" in got["message"]
    assert r.ok("verify", index=0, seed=0)["equal"]


def test_remap_against_a_different_layout_is_stale(gms: Gms, platform: GpuDouble | None) -> None:
    server = gms.server(0, "--backend", "cuda")
    w = writer(gms, (2 * MiB,))
    w.ok("unmap")
    server.kill9()
    gms.server(0, "--backend", "cuda")
    other = writer(gms, (4 * MiB,), seed=9)
    got = w("remap", timeout=10)
    assert not got["ok"] and got["error"] == "StaleMemoryLayoutError", got
    other.ok("close")


def test_memory_lives_while_any_process_holds_it_and_goes_with_the_last(
    gms: Gms, platform: GpuDouble | None
) -> None:
    """The process-death fence: the server's handle, the writer's and the
    reader's imports each keep the memory alive; it goes with the last."""
    size = 64 * MiB
    probe = gms.agent("probe")
    probe.ok("cuda_context", device=0)
    baseline = used(platform, probe)
    server = gms.server(0, "--backend", "cuda")
    w = writer(gms, (size,), seed=3)
    r = reader(gms)
    assert used(platform, probe) - baseline >= size
    server.kill9()  # the creator's handle is gone...
    w.kill9()  # ...and the writer's mapping...
    time.sleep(0.5)
    assert used(platform, probe) - baseline >= size  # ...the reader's import keeps it
    assert r.ok("verify", index=0, seed=3)["equal"]  # with its bytes
    r.kill9()
    wait_for(lambda: used(platform, probe) - baseline < size, 10, what="memory freed")
    if platform is not None:
        assert platform.used_bytes() == 0, platform.holders()


def test_supervisor_and_two_tp_engines_share_and_survive_each_other(
    gms: Gms, platform: GpuDouble | None
) -> None:
    """`understudy gms serve --backend cuda` over two devices; a TP=2 engine
    loads, a second imports; both sleep and wake at the same addresses; the
    loader dies and the other still wakes with the same bytes."""
    sup = Proc(
        gms_cli("serve", "--socket-dir", str(gms.dir), "--devices", "0,1", "--backend", "cuda"),
        log=gms.tmp / "serve.log",
    )
    gms.procs.append(sup)
    ready = run_cli(
        "wait-ready", "--socket-dir", str(gms.dir), "--devices", "0,1", "--timeout", "30"
    )
    assert ready.returncode == 0, ready.stderr + (gms.tmp / "serve.log").read_text()
    status = json.loads(run_cli("status", "--socket", str(gms.path(1))).stdout)
    assert status["backend"] == "cuda" and status["device"] == 1

    engines: list[Engine] = []
    for trial in (1, 2):
        e = gms.engine(f"engine{trial}")
        engines.append(e)
        for device in (0, 1):
            e.send(
                op="worker",
                trial=trial,
                device=device,
                devices=2,
                socket=str(gms.path(device)),
                mode="RW_OR_RO",
                timeout=30,
                size=8 * MiB,
            )
        loaded = {e.wait_event(60, event="done", device=d)["loaded"] for d in (0, 1)}
        assert loaded == {trial == 1}, e.events
    first, second = engines
    for e, trial in ((first, 1), (second, 2)):
        e.send(op="sleep_wake", trial=trial, timeout=10)
        for device in (0, 1):
            woke = e.wait_event(30, event="rewoken", device=device)
            assert woke["same_address"] and woke["equal"], woke
    first.kill9()
    second.events.clear()
    second.send(op="sleep_wake", trial=2, timeout=10)
    for device in (0, 1):
        woke = second.wait_event(30, event="rewoken", device=device)
        assert woke["same_address"] and woke["equal"], woke
    assert not any(ev.get("event") == "error" for ev in second.events), second.events
    sup.signal(signal.SIGTERM)
    assert sup.wait(15) == 0
