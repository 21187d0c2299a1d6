"""Which python runs a vllm engine (engine_shim.python_env), and `engine run`
re-executing itself under it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from understudy.engine_shim import python_env

ROOT = Path(__file__).resolve().parents[3]


def test_this_is_a_checkout_and_its_sources_are_listed() -> None:
    assert python_env.checkout_root() == ROOT
    dirs = python_env.source_dirs(ROOT)
    assert str(ROOT / "engine_shim" / "src") in dirs
    assert all(Path(d, "understudy").is_dir() for d in dirs)


def test_explicit_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(python_env.ENV, "/from/env/python")
    assert python_env.vllm_python("/explicit/python") == "/explicit/python"
    assert python_env.vllm_python() == "/from/env/python"


def test_another_python_gets_this_checkouts_sources_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = python_env.engine_env("/other/python")
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[-1] == "/somewhere/else"
    assert str(ROOT / "engine_shim" / "src") in paths[:-1]
    assert "PYTHONPATH" not in python_env.engine_env(sys.executable)


def test_engine_run_reexecutes_under_the_engine_python(tmp_path: Path) -> None:
    """A stand-in for the vLLM venv's python records how it was started."""
    record = tmp_path / "record"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\necho "$PYTHONPATH" >> {record}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != python_env.REEXEC_MARK}
    env.pop("UNDERSTUDY_ENGINE_ADAPTER", None)
    done = subprocess.run(
        [sys.executable, "-m", "understudy.cli", "engine", "run", "--engine", "vllm",
         "--engine-python", str(fake)],
        env={**env, "ENGINE_ROLE": "primary"},
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    argv, pythonpath = record.read_text().splitlines()
    assert argv == "-m understudy.cli engine run"
    assert str(ROOT / "engine_shim" / "src") in pythonpath.split(os.pathsep)
