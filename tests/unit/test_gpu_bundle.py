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
        [sys.executable, str(ROOT / "hack" / "gpu" / "gpu_check.py"), "--steps", "drill"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert got.returncode == 3, got.stderr
    assert got.stdout.startswith("no GPU found: the CUDA driver:")
    doc = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert doc["detect"]["gpu"] is False
    assert doc["drill"] == {"ran": False, "why": "no GPU found (the drill needs GMS on a real GPU)"}
    assert doc["wake_bench"]["ran"] is False
    assert doc["exit"] == 3
    assert (tmp_path / "out" / "summary.txt").read_text().startswith("no GPU found")


@pytest.mark.parametrize("script", ["check", "run"])
def test_the_scripts_are_executable(script: str) -> None:
    assert os.access(ROOT / "hack" / "gpu" / script, os.X_OK)
