"""Shared by the engine shim's unit tests: the tiny Llama checkpoint, built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from understudy.engine_shim.adapters import tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"), seed=0)
