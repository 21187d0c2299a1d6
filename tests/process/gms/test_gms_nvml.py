"""GMS and NVML: the device's UUID, memory and health in ``understudy gms
status``, the metrics and an engine's health reason; faults through the NVML
double (hack/cuda-double: host memory, not a GPU); and GMS without NVML,
which behaves as before.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from typing import Any

import pytest
from doubles.gpu import GpuDouble
from gmsprocs import Gms, run_cli
from procs import wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.process

MiB = 1 << 20


def status(gms: Gms, device: int = 0) -> dict[str, Any]:
    done = run_cli("status", "--socket", str(gms.path(device)))
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def samples(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("understudy_gms_device_")
    }


def test_without_nvml_status_has_no_gpu_and_the_server_says_why(gms: Gms) -> None:
    gms.server(0)
    assert status(gms)["gpu"] is None
    log = (gms.tmp / "server0.log").read_text()
    assert "event=nvml_unavailable" in log and "Traceback" not in log, log


def test_status_names_the_cuda_device_by_uuid_with_its_memory(
    gms: Gms, cuda_double: GpuDouble
) -> None:
    gms.server(1, "--backend", "cuda")
    w = gms.agent("writer")
    w.ok("connect", path=str(gms.path(1)), mode="RW", timeout=10)
    w.ok("allocate", size=6 * MiB)
    gpu = status(gms, 1)["gpu"]
    log = (gms.tmp / "server1.log").read_text()
    assert f"uuid={gpu['uuid']}" in log.split("event=cuda_device", 1)[1].splitlines()[0]
    assert "not a GPU" in gpu["name"] and gpu["healthy"] and gpu["reason"] == ""
    assert cuda_double.used_bytes(1) == 6 * MiB
    wait_for(lambda: status(gms, 1)["gpu"]["memory_used"] == 6 * MiB, 5)  # at most 1 s old
    assert w.ok("device_health") == {"ok": True, "healthy": True, "reason": ""}


def test_host_backend_reports_the_device_by_index(gms: Gms, cuda_double: GpuDouble) -> None:
    gms.server(0)
    gpu = status(gms)["gpu"]
    assert gpu is not None and gpu["healthy"] and gpu["uuid"].startswith("GPU-")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("xid=79", "Xid 79"),
        ("ecc_uncorrected=2", "2 uncorrectable ECC errors"),
        ("retired_pending=1", "retired pages pending (the GPU needs a reset)"),
        ("lost=1", "GPU is lost (fell off the bus)"),
    ],
)
def test_a_sick_gpu_is_unhealthy_in_status_metrics_and_the_engines_reason(
    gms: Gms, cuda_double: GpuDouble, line: str, reason: str
) -> None:
    port = free_port()
    gms.server(0, "--backend", "cuda", "--metrics-port", str(port))
    r = gms.agent("engine")
    r.ok("connect", path=str(gms.path(0)), mode="RW", timeout=10)
    assert status(gms)["gpu"]["healthy"]
    assert samples(port)["understudy_gms_device_healthy"] == 1
    cuda_double.control_line(0, "xid=13")  # the application's fault: still healthy
    wait_for(lambda: status(gms) and "xid=13" in (gms.tmp / "server0.log").read_text(), 5)
    assert status(gms)["gpu"]["healthy"]

    cuda_double.control_line(0, line)
    gpu = wait_for(lambda: (g := status(gms)["gpu"]) and not g["healthy"] and g, 5)
    assert gpu["reason"] == reason
    got = r.ok("device_health")
    assert not got["healthy"] and got["reason"] == f"device 0 ({gpu['uuid']}): {reason}"
    assert samples(port)["understudy_gms_device_healthy"] == 0
    log = (gms.tmp / "server0.log").read_text()
    assert "event=device_unhealthy" in log and "Traceback" not in log, log
    if line.startswith("xid"):
        assert samples(port)["understudy_gms_device_xid_events_total"] >= 1
    r.ok("allocate", size=2 * MiB)  # GMS itself goes on serving


def test_an_xid_is_sticky(gms: Gms, cuda_double: GpuDouble) -> None:
    gms.server(0, "--backend", "cuda")
    cuda_double.control_line(0, "xid=48")
    wait_for(lambda: not status(gms)["gpu"]["healthy"], 5)
    (cuda_double.control / "gpu0").write_text("")  # nothing pending any more
    assert status(gms)["gpu"]["reason"] == "Xid 48"  # a GPU needs a reset


def test_nvml_that_fails_to_start_leaves_gms_as_without_it(
    gms: Gms, cuda_double: GpuDouble
) -> None:
    cuda_double.set(UNDERSTUDY_NVML_DOUBLE_FAIL="nvmlInit:DRIVER_NOT_LOADED")
    gms.server(0, "--backend", "cuda")
    assert status(gms)["gpu"] is None
    log = (gms.tmp / "server0.log").read_text()
    assert "event=nvml_unavailable" in log and "Driver Not Loaded" in log, log
    w = gms.agent("writer")
    w.ok("connect", path=str(gms.path(0)), mode="RW", timeout=10)
    w.ok("allocate", size=2 * MiB)
    assert w.ok("device_health")["healthy"]


def test_nvml_calls_that_fail_later_keep_the_last_report(gms: Gms, cuda_double: GpuDouble) -> None:
    cuda_double.set(UNDERSTUDY_NVML_DOUBLE_FAIL="nvmlDeviceGetMemoryInfo:UNKNOWN@3")
    gms.server(0, "--backend", "cuda")
    first = status(gms)["gpu"]
    assert first is not None
    log = gms.tmp / "server0.log"
    wait_for(lambda: status(gms) and "event=nvml_failed" in log.read_text(), 10)
    assert status(gms)["gpu"] == first
