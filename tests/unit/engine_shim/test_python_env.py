"""Which python runs a vllm engine (engine_shim.python_env), and `engine run`
re-executing itself under it with the environment it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from understudy.engine_shim import python_env


def test_explicit_then_environment_then_this_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(python_env.ENV, "/from/env/python")
    assert python_env.vllm_python("/explicit/python") == "/explicit/python"
    assert python_env.vllm_python() == "/from/env/python"
    monkeypatch.delenv(python_env.ENV)
    assert python_env.vllm_python() == sys.executable


def test_the_runtime_never_looks_for_a_checkout() -> None:
    source = Path(python_env.__file__).read_text()
    assert "parents[" not in source and "subprocess" not in source


def test_engine_run_reexecutes_under_the_engine_python(tmp_path: Path) -> None:
    """A stand-in for the vLLM venv's python records how it was started: the
    same command, and the caller's PYTHONPATH as it was."""
    record = tmp_path / "record"
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/sh\necho "$@" > {record}\necho "$PYTHONPATH" >> {record}\n'
        f'echo "${python_env.REEXEC_MARK}" >> {record}\n'
    )
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != python_env.REEXEC_MARK}
    env.pop("UNDERSTUDY_ENGINE_ADAPTER", None)
    done = subprocess.run(
        [sys.executable, "-m", "understudy.cli", "engine", "run", "--engine", "vllm",
         "--engine-python", str(fake)],
        env={**env, "ENGINE_ROLE": "primary", "PYTHONPATH": "/the/callers/sources"},
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    argv, pythonpath, mark = record.read_text().splitlines()
    assert argv == "-m understudy.cli engine run"
    assert pythonpath == "/the/callers/sources"
    assert mark == "1"
