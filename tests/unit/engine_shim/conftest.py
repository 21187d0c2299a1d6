"""Shared by the engine shim's unit tests: the built-in checkpoints, built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from understudy.engine_shim.adapters import smollm2, tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:smollm2-135m, converted once per session (~10 s, 540 MB)."""
    return smollm2.build(tmp_path_factory.mktemp("smollm2"))
