"""hack/gpu: the offline GPU machine's bundle (what it carries, its size
bound) and the check's no-GPU mode, without a download (issue 29)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "hack" / "gpu" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bundle = _load("bundle")
gpu_check = _load("gpu_check")


def test_the_bundle_asks_pypi_only_for_what_the_machine_lacks() -> None:
    names = {bundle.project_name(r) for r in bundle.requirements()}
    # Our own distributions are built from the tree, never fetched.
    assert not any(n.startswith("understudy") for n in names)
    assert {"pydantic", "aiohttp", "httptools", "uvloop", "prometheus-client"} <= names
    assert {"pytest", "pytest-timeout", "pytest-asyncio"} <= names  # the test tier
    assert not names & {"torch", "numpy", "safetensors", "tokenizers", "transformers"}
    assert not names & {"cuda-python", "nvidia-ml-py"}
    folders = {p.name for p in bundle.components()}
    assert folders == {"cli", "wire", "respawner", "lockserver", "gms", "engine_shim",
                       "front", "operator", "tools"}  # fmt: skip


def test_downloaded_wheels_the_machine_has_are_left_behind(tmp_path: Path) -> None:
    names = [
        "numpy-2.3.4-cp312-cp312-manylinux_2_28_x86_64.whl",
        "nvidia_cublas_cu12-12.8-py3-none-manylinux_2_27_x86_64.whl",
        "Jinja2-3.1.6-py3-none-any.whl",
        "pydantic_core-2.41-cp312-cp312-manylinux.whl",
    ]
    kept = bundle.machine_lacks(tmp_path / n for n in names)
    assert [p.name for p in kept] == names[2:]


def test_the_size_bound_names_the_biggest_files(tmp_path: Path) -> None:
    small, big = tmp_path / "small.whl", tmp_path / "big.whl"
    small.write_bytes(b"x" * 10)
    big.write_bytes(b"x" * 100)
    assert bundle.check_size([small, big], limit=110) == (110, None)
    total, problem = bundle.check_size([small, big], limit=100)
    assert total == 110
    assert problem is not None and problem.index("big.whl") < problem.index("small.whl")
    assert bundle.LIMIT == 48 << 20


def test_without_a_gpu_the_check_says_so_and_exits_3(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "LD_LIBRARY_PATH": str(tmp_path)}
    got = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "gpu" / "gpu_check.py"), "--steps", "drill,wake"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert got.returncode == 3, got.stderr
    assert got.stdout.startswith("no GPU found: the CUDA driver:")
    doc = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert doc["detect"]["gpu"] is False
    assert doc["drill"] == {"ran": False, "why": "no GPU found (the drill needs GMS on a real GPU)"}
    why = "no GPU found (the wake bench needs GMS on a real GPU)"
    assert doc["wake_bench"] == {"ran": False, "why": why}
    assert doc["tests"] == {"ran": False, "why": "not asked"}
    assert doc["exit"] == 3
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert text.startswith("no GPU found")
    assert f"wake bench: not run: {why}" in text


def test_the_wake_bench_reads_kill_to_active_from_the_drill_report() -> None:
    stats = {"n": 10, "p50": 0.0123, "p95": 0.04, "p99": 0.0456, "max": 0.0612, "min": 0.01}
    figures = gpu_check.wake_figures({"summary": {"kill_to_active_s": stats}})
    assert figures == {"kill_to_active_ms": {"p50": 12.3, "p99": 45.6, "max": 61.2}, "n": 10,
                       "target_p99_ms": 50.0, "target_met": True}  # fmt: skip
    slow = gpu_check.wake_figures({"summary": {"kill_to_active_s": {**stats, "p99": 0.0501}}})
    assert slow["target_met"] is False  # recorded, never a failure of the step
    assert gpu_check.wake_figures({"summary": {"kill_to_active_s": None}})["target_met"] is None
    doc = {
        "detect": {"gpu": True, "why": "NVIDIA H100"},
        "tests": {"ran": False, "why": "not asked"},
        "drill": {"ran": False, "why": "not asked"},
        "wake_bench": {"ran": True, "ok": True, "size": "60GiB", **figures},
        "exit": 0,
    }
    text = gpu_check.summary(doc)
    assert "wake bench: passed\n" in text
    assert (
        "wake bench figures (60GiB, 10 failovers): kill -> Active p50 12.3 ms, p99 45.6 ms, "
        "max 61.2 ms; target p99 <= 50 ms: met"
    ) in text


@pytest.mark.parametrize("script", ["check", "run"])
def test_the_scripts_are_executable(script: str) -> None:
    assert os.access(ROOT / "hack" / "gpu" / script, os.X_OK)
