"""A checkout's vLLM python and sources, for engines started from it (tools.checkout)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from understudy.engine_shim import python_env
from understudy.tools import checkout

ROOT = Path(__file__).resolve().parents[3]


def test_this_is_a_checkout_and_its_sources_are_listed() -> None:
    assert checkout.root() == ROOT
    dirs = checkout.source_dirs(ROOT)
    assert str(ROOT / "engine_shim" / "src") in dirs
    assert all(Path(d, "understudy").is_dir() for d in dirs)


def test_outside_a_checkout_there_is_none(tmp_path: Path) -> None:
    assert checkout.root(tmp_path / "a" / "b.py") is None


def test_explicit_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(python_env.ENV, "/from/env/python")
    assert checkout.vllm_python("/explicit/python") == "/explicit/python"
    assert checkout.vllm_python() == "/from/env/python"


def test_another_python_gets_this_checkouts_sources_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = checkout.engine_env("/other/python")
    assert env[python_env.ENV] == "/other/python"
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[-1] == "/somewhere/else"
    assert str(ROOT / "engine_shim" / "src") in paths[:-1]
    assert "PYTHONPATH" not in checkout.engine_env(sys.executable)
