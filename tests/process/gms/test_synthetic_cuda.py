"""The synthetic engine on GMS's cuda backend, against the CUDA driver double
(hack/cuda-double: host memory, not a GPU): its ``load`` writes through
``Allocation.write`` (cuMemcpyHtoD) and its ``checksum`` reads through
``Allocation.read`` (cuMemcpyDtoH), so a reader's checksums are the host
backend's for the same model, byte for byte. Every client is its own process
(synthetic_client.py); the test process never loads a driver.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from doubles.gpu import GpuDouble
from gmsprocs import HERE, Gms
from procs import PYTHON

pytestmark = pytest.mark.process

# Two allocations of 3 MiB + 4 KiB each: two granules apiece, the second
# mostly padding (which load writes as zeros on either backend).
MODEL = ("synthetic:6152KiB", "--allocations", "2")


def client(op: str, gms: Gms, device: int = 0) -> dict[str, Any]:
    got = subprocess.run(
        [PYTHON, str(HERE / "synthetic_client.py"), op, str(gms.path(device)), *MODEL],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    doc: dict[str, Any] = json.loads(got.stdout.strip().splitlines()[-1])
    return doc


def load_and_check(tmp: Path, backend: str, device: int = 0) -> dict[str, Any]:
    gms = Gms(tmp / backend)
    try:
        gms.server(device, "--backend", backend)
        loaded = client("load", gms, device)
        assert loaded["backend"] == backend
        assert loaded["write_refused"].startswith("allocation is read-only")
        checked = client("check", gms, device)
        assert checked["backend"] == backend
        assert gms.state(device)["backend"] == backend
        return checked
    finally:
        gms.stop()


def test_synthetic_checksums_on_cuda_are_the_host_backends(
    tmp_path: Path, cuda_double: GpuDouble
) -> None:
    cuda = load_and_check(tmp_path, "cuda")
    assert cuda_double.used_bytes(0) == 0  # every process gone, the memory with them
    host = load_and_check(tmp_path, "host")
    assert cuda["sizes"] == host["sizes"] == [4 << 20, 4 << 20]
    assert (cuda["sample"], cuda["full"]) == (host["sample"], host["full"])
    assert cuda["sample"] != cuda["full"]
    for got in (cuda, host):
        assert got["asleep"] == "allocation is not mapped (sleeping or closed)"
        assert got["sample_after_wake"] == got["sample"]
