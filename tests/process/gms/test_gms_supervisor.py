"""``understudy gms serve``: one process per device, wait -n, SIGTERM, metrics;
``status`` and ``wait-ready``; the cuda backend without a driver."""

from __future__ import annotations

import json
import signal
import socket
import urllib.request
from pathlib import Path

import pytest
from gmsprocs import Gms, gms_cli, run_cli
from procs import Proc, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.process


def children_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(x) for x in path.read_text().split()]
    except OSError:
        return []


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve(gms: Gms, *extra: str) -> Proc:
    proc = Proc(
        gms_cli("serve", "--socket-dir", str(gms.dir), "--devices", "0,1", "--grace", "2", *extra),
        log=gms.tmp / "serve.log",
    )
    gms.procs.append(proc)
    return proc


def test_serve_runs_one_process_per_device_and_dies_with_any(gms: Gms) -> None:
    sup = serve(gms)
    done = run_cli(
        "wait-ready", "--socket-dir", str(gms.dir), "--devices", "0,1", "--timeout", "20"
    )
    assert done.returncode == 0, done.stderr
    kids = wait_for(lambda: len(children_of(sup.pid)) == 2 and children_of(sup.pid), 10)
    status = run_cli("status", "--socket", str(gms.path(1)))
    assert status.returncode == 0
    doc = json.loads(status.stdout)
    assert doc["state"] == "EMPTY" and doc["device"] == 1 and doc["allocations"] == 0
    assert set(doc) >= {"committed", "sessions", "waiting_writers", "bytes", "layout_hash"}

    Proc(["kill", "-9", str(kids[1])]).wait()
    assert sup.wait(15) != 0  # wait -n: the container restarts as a whole
    wait_for(lambda: not pid_alive(kids[0]), 10, what="the other child stopped")


def test_sigterm_is_forwarded_and_exits_zero(gms: Gms) -> None:
    sup = serve(gms)
    assert (
        run_cli(
            "wait-ready", "--socket-dir", str(gms.dir), "--devices", "0,1", "--timeout", "20"
        ).returncode
        == 0
    )
    kids = children_of(sup.pid)
    sup.signal(signal.SIGTERM)
    assert sup.wait(15) == 0
    assert not any(pid_alive(k) for k in kids)
    assert not gms.path(0).exists() and not gms.path(1).exists()


def test_wait_ready_fails_when_a_device_is_missing(gms: Gms) -> None:
    gms.server(0)
    done = run_cli(
        "wait-ready", "--socket-dir", str(gms.dir), "--devices", "0,1", "--timeout", "0.5"
    )
    assert done.returncode != 0 and "gms_1_weights.sock" in done.stderr
    assert run_cli("status", "--socket", str(gms.path(1)), "--timeout", "0.3").returncode == 1


def test_metrics_of_all_children_on_one_port(gms: Gms) -> None:
    port = free_port()
    serve(gms, "--metrics-port", str(port))
    assert (
        run_cli(
            "wait-ready", "--socket-dir", str(gms.dir), "--devices", "0,1", "--timeout", "20"
        ).returncode
        == 0
    )
    writer = gms.agent("writer")
    writer.ok("connect", path=str(gms.path(1)), mode="RW", timeout=10)
    writer.ok("allocate", size=3 << 20)

    def scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    dev1 = frozenset({("device", "1"), ("tag", "weights")})
    dev0 = frozenset({("device", "0"), ("tag", "weights")})
    key = ("understudy_gms_allocated_bytes", dev1)
    got = wait_for(lambda: (m := scrape()).get(key) == 4 << 20 and m, 10, what="metrics")
    assert got[("understudy_gms_allocated_bytes", dev0)] == 0
    assert got[("understudy_gms_sessions", dev1 | {("mode", "RW")})] == 1
    assert (
        got[
            (
                "understudy_gms_lock_wait_seconds_count",
                dev1 | {("mode", "RW"), ("outcome", "granted")},
            )
        ]
        == 1
    )


def test_cuda_backend_without_driver_fails_with_one_line(gms: Gms) -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("an NVIDIA driver is present")
    done = run_cli("server", "--socket", str(gms.path(0)), "--device", "0", "--backend", "cuda")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cuda backend" in lines[0] and "Traceback" not in done.stderr, (
        done.stderr
    )
    sup = Proc(
        gms_cli("serve", "--socket-dir", str(gms.dir), "--devices", "0,1", "--backend", "cuda"),
        log=gms.tmp / "serve-cuda.log",
    )
    gms.procs.append(sup)
    assert sup.wait(30) != 0
    assert "Traceback" not in (gms.tmp / "serve-cuda.log").read_text()
