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

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.llama import LlamaEngine

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from vllmserver import vllm_server  # noqa: E402


def _installed(name: str) -> bool:
    # Not a namespace package: this very folder is one named vllm once tests/
    # is on sys.path.
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin not in (None, "namespace")


MISSING = [m for m in ("torch", "transformers", "vllm") if not _installed(m)]
SKIP_REASON = (
    f"needs {', '.join(MISSING)}: run tests/vllm with the vLLM venv's python (hack/vllm/venv)"
)


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
    with vllm_server(model_dir, tmp_path_factory.mktemp("vllm") / "server.log") as port:
        yield port
