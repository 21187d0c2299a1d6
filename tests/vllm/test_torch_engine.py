"""The torch engine (``adapters.torch``) on the CPU against the numpy llama engine:
greedy tokens identical on five prompts (tiny-llama and SmolLM2, fp32), the
determinism contract the llama engine keeps (batched == alone, a continuation
after resumed ids == the uninterrupted run), weights as tensors over the
engine's buffer (no copy), and a KV cache over the pool's arrays.

Needs torch (the vLLM venv); see conftest for how to run tests/vllm."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from understudy.engine_shim.adapters import models, smollm2
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.generation import SamplingParams

torch = pytest.importorskip("torch", reason="needs torch: run with the vLLM venv's python")

from understudy.engine_shim.adapters.torch import TorchEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TEXTS = (
    "Hello, my name is",
    "The shadow engine wakes when the lock is granted",
    "1, 2, 3,",
    "東京と大阪 café",
    "user: what is the capital of France?",
)
GREEDY = SamplingParams(max_tokens=40, temperature=0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)


@pytest.fixture(scope="module", autouse=True)
def torch_threads() -> Iterator[None]:
    """The torch engine runs torch on one thread, a setting of the whole process
    (an engine's own, in a pod). Here the process is pytest's: put it back, or
    vLLM-CPU tests after these one run its attention with metadata built for
    another thread count ('Check failed: thread_num == thread_num (2 vs. 1)')
    and the engine exits."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def make(cls: type[LlamaEngine], model_dir: Path, *args: str) -> LlamaEngine:
    engine = cls(str(model_dir), args)
    engine.attach_private()
    engine.wake()
    return engine


async def run(
    engine: LlamaEngine, prompt: list[int], params: SamplingParams, resume: list[int] | None = None
) -> list[int]:
    async with asyncio.timeout(300):
        return [s.token_id async for s in engine.generate(prompt, params, resume or [])]


async def greedy_of(
    cls: type[LlamaEngine], model_dir: Path, params: SamplingParams
) -> list[list[int]]:
    engine = make(cls, model_dir)
    try:
        return [await run(engine, engine.encode(t), params) for t in TEXTS]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def torch_engine(model_dir: Path) -> Iterator[LlamaEngine]:
    engine = make(TorchEngine, model_dir)
    yield engine
    engine.close()


async def test_greedy_tokens_equal_the_numpy_engines(model_dir: Path) -> None:
    numpy_ids = await greedy_of(LlamaEngine, model_dir, GREEDY)
    torch_ids = await greedy_of(TorchEngine, model_dir, GREEDY)
    assert torch_ids == numpy_ids
    assert len({tuple(i) for i in torch_ids}) == len(TEXTS)  # the prompts matter


async def test_smollm2_greedy_tokens_equal_the_numpy_engines() -> None:
    """The real model: a near tie between two logits would show here first."""
    try:
        smol = smollm2.cached()
    except (ValueError, OSError) as exc:
        pytest.skip(f"builtin:smollm2-135m cannot be built here: {exc}")
    params = SamplingParams(max_tokens=24, temperature=0)
    numpy_ids = await greedy_of(LlamaEngine, smol, params)
    torch_ids = await greedy_of(TorchEngine, smol, params)
    assert torch_ids == numpy_ids


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_batched_tokens_equal_one_at_a_time(
    torch_engine: LlamaEngine, params: SamplingParams
) -> None:
    prompts = [torch_engine.encode(t) for t in TEXTS]
    alone = [await run(torch_engine, p, params) for p in prompts]
    together = await asyncio.gather(*(run(torch_engine, p, params) for p in prompts))
    assert together == alone


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_continuing_after_resumed_ids_gives_the_same_tokens(
    torch_engine: LlamaEngine, model_dir: Path, params: SamplingParams
) -> None:
    """What a migrated stream does: another torch engine continues after the first 17."""
    other = make(TorchEngine, model_dir)
    try:
        for text in TEXTS[:3]:
            prompt = torch_engine.encode(text)
            whole = await run(torch_engine, prompt, params)
            assert await run(other, prompt, params, whole[:17]) == whole[17:]
    finally:
        other.close()


def test_weights_are_tensors_over_the_engines_buffer(torch_engine: LlamaEngine) -> None:
    """No copy: every weight's storage lies inside the packed buffer."""
    buffer = torch_engine._private
    assert buffer is not None and torch_engine.model is not None
    base = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    tensors = torch_engine.model.tensors  # type: ignore[attr-defined]
    assert tensors
    for name, t in tensors.items():
        assert base <= t.data_ptr() < base + len(buffer), name


def test_the_engine_names_itself_and_its_model() -> None:
    engine = TorchEngine("builtin:tiny-llama")
    assert engine.name == "torch"
    assert engine.model_id == models.served_name("builtin:tiny-llama")
