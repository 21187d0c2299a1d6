"""The llama engine as a Generator: continuous batching, the determinism contract
(greedy and seeded tokens independent of batching, continuation after resumed
ids identical to the uninterrupted run), finish reasons, validation,
cancellation, and sleep/wake. Weights in a private buffer here; the same
engine over GMS, across processes, is in tests/process/test_llama_gms.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.engine_shim.adapters.base import AdapterError
from understudy.engine_shim.adapters.llama import LlamaEngine, NotServing
from understudy.engine_shim.generation import SamplingParams, Step

TEXTS = (
    "Hello, my name is",
    "The shadow engine wakes when the lock is granted",
    "1, 2, 3,",
    "東京と大阪 café",
    "a",
    "user: what is the capital of France?",
)
GREEDY = SamplingParams(max_tokens=40, temperature=0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)


def make_engine(model_dir: Path, *args: str) -> LlamaEngine:
    engine = LlamaEngine(str(model_dir), args)
    engine.attach_private()
    engine.wake()
    return engine


@pytest.fixture
def engine(tiny_llama_dir: Path) -> Iterator[LlamaEngine]:
    e = make_engine(tiny_llama_dir)
    yield e
    e.close()


async def run(
    engine: LlamaEngine, prompt: list[int], params: SamplingParams, resume: list[int] | None = None
) -> list[Step]:
    async with asyncio.timeout(60):
        return [s async for s in engine.generate(prompt, params, resume or [])]


def ids(steps: list[Step]) -> list[int]:
    return [s.token_id for s in steps]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_batched_tokens_equal_one_at_a_time(engine: LlamaEngine, params: SamplingParams):
    prompts = [engine.encode(t) for t in TEXTS]
    alone = [await run(engine, p, params) for p in prompts]
    together = await asyncio.gather(*(run(engine, p, params) for p in prompts))
    assert together == alone
    for steps in alone:
        assert len(steps) == 40
        assert [s.finish_reason for s in steps] == [None] * 39 + ["length"]
    assert len({tuple(ids(s)) for s in alone}) == len(prompts)  # the prompts matter


async def test_seeded_sampling_differs_from_greedy_and_between_seeds(engine: LlamaEngine):
    prompt = engine.encode(TEXTS[1])
    greedy = ids(await run(engine, prompt, GREEDY))
    a = ids(await run(engine, prompt, SEEDED))
    b = ids(await run(engine, prompt, SamplingParams(40, 0.9, 0.95, seed=99)))
    assert len({tuple(greedy), tuple(a), tuple(b)}) == 3


async def test_a_failovers_worth_of_resumed_streams_continues_the_same(tiny_llama_dir: Path):
    """Eight streams continued at once, 60 resumed ids each: 480 rows to feed,
    spread over iterations by the decode budget (DECODE_BUDGET) and the
    prefill budget, while a fresh request keeps generating beside them; every
    stream goes on with exactly the uninterrupted run's tokens."""
    params = SamplingParams(max_tokens=80, temperature=0)
    first = make_engine(tiny_llama_dir)
    try:
        prompts = [first.encode(t) for t in (*TEXTS, *TEXTS[:2])]
        whole = [ids(await run(first, p, params)) for p in prompts]
    finally:
        first.close()
    other = make_engine(tiny_llama_dir, "--max-num-seqs", "9")
    try:
        fresh = other.encode("A fresh request beside them")
        alone = ids(await run(other, fresh, params))
        got = await asyncio.gather(
            *(run(other, p, params, w[:60]) for p, w in zip(prompts, whole, strict=True)),
            run(other, fresh, params),
        )
        assert [ids(g) for g in got[:-1]] == [w[60:] for w in whole]
        assert ids(got[-1]) == alone
    finally:
        other.close()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_continuing_after_resumed_ids_gives_the_same_tokens(
    engine: LlamaEngine, tiny_llama_dir: Path, params: SamplingParams
):
    """What a migrated stream does: another engine continues after the first 17."""
    other = make_engine(tiny_llama_dir)
    try:
        for text in TEXTS[:4]:
            prompt = engine.encode(text)
            first = ids(await run(engine, prompt, params))
            rest = await run(other, prompt, params, first[:17])
            assert ids(rest) == first[17:]
            assert rest[-1].finish_reason == "length"  # max_tokens counts the resumed ids
        # and resuming alongside fresh requests changes nothing either
        prompt = engine.encode(TEXTS[0])
        first = ids(await run(engine, prompt, params))
        mixed = await asyncio.gather(
            run(other, prompt, params, first[:5]),
            run(other, engine.encode(TEXTS[2]), params),
            run(other, prompt, params, first[:30]),
        )
        assert ids(mixed[0]) == first[5:] and ids(mixed[2]) == first[30:]
    finally:
        other.close()


async def test_stop_ids_end_with_stop_and_the_context_with_length(tiny_llama_dir: Path):
    engine = make_engine(tiny_llama_dir, "--max-model-len", "32")
    try:
        prompt = engine.encode(TEXTS[1])
        free_steps = await run(engine, prompt, GREEDY)
        free = ids(free_steps)
        stop_at = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])
        stopped = await run(engine, prompt, SamplingParams(40, 0, stop_token_ids=(free[stop_at],)))
        assert ids(stopped) == free[: stop_at + 1] and stopped[-1].finish_reason == "stop"
        # prompt + generated ids never exceed the context
        assert len(prompt) + len(free) == 32 and free_steps[-1].finish_reason == "length"
    finally:
        engine.close()


async def test_more_requests_than_slots_queue_and_finish(tiny_llama_dir: Path):
    engine = make_engine(tiny_llama_dir, "--max-num-seqs", "2")
    try:
        prompts = [engine.encode(t) for t in TEXTS]
        alone = [await run(engine, p, GREEDY) for p in prompts]
        assert await asyncio.gather(*(run(engine, p, GREEDY) for p in prompts)) == alone
    finally:
        engine.close()


async def test_a_consumer_that_leaves_frees_its_slot(tiny_llama_dir: Path):
    engine = make_engine(tiny_llama_dir, "--max-num-seqs", "1")
    try:
        prompt = engine.encode(TEXTS[0])
        stream = engine.generate(prompt, SamplingParams(max_tokens=1000, temperature=0))
        async with asyncio.timeout(30):
            async for step in stream:
                assert step.finish_reason is None
                break
            await stream.aclose()  # type: ignore[attr-defined]
            # the only slot is free again: the next request runs to its end
            assert len(await run(engine, prompt, GREEDY)) == 40
        assert engine.batcher is not None and engine.batcher.load == (0, 0)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("prompt", "params", "resume", "message"),
    [
        ([], GREEDY, [], "empty"),
        ([0, 2048], GREEDY, [], "vocabulary"),
        ([0, 5], SamplingParams(max_tokens=0), [], "max_tokens"),
        ([0, 5], SamplingParams(max_tokens=5, top_p=0), [], "top_p"),
        ([0, 5], SamplingParams(max_tokens=3), [7, 8, 9], "already finish"),
        ([0, 5], SamplingParams(max_tokens=9), [7, 4], "already finish"),  # 4: <|eot_id|>
        ([5] * 2048, GREEDY, [], "context"),
    ],
)
def test_bad_requests_fail_before_streaming(
    engine: LlamaEngine, prompt: list[int], params: SamplingParams, resume: list[int], message: str
):
    with pytest.raises(ValueError, match=message):
        engine.generate(prompt, params, resume)


async def test_sleep_fails_streams_and_wake_serves_again(engine: LlamaEngine):
    prompt = engine.encode(TEXTS[0])
    before = ids(await run(engine, prompt, GREEDY))
    stream = engine.generate(prompt, SamplingParams(max_tokens=2000, temperature=0))
    with pytest.raises(NotServing):
        async with asyncio.timeout(30):
            async for _ in stream:
                engine.sleep()
    assert engine.health() == (False, "not awake")
    with pytest.raises(NotServing):
        engine.generate(prompt, GREEDY)
    engine.wake()
    assert engine.health() == (True, "ok")
    assert ids(await run(engine, prompt, GREEDY)) == before


def test_engine_arguments_and_model_are_checked(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    with pytest.raises(AdapterError, match="unknown"):
        LlamaEngine(str(tiny_llama_dir), ("--tensor-parallel", "2"))
    with pytest.raises(AdapterError, match="max-model-len"):
        LlamaEngine(str(tiny_llama_dir), ("--max-model-len", "4096"))
    with pytest.raises(AdapterError, match=r"model\.safetensors"):
        LlamaEngine(str(tmp_path))
    engine = LlamaEngine(str(tiny_llama_dir))
    assert engine.max_model_len == 2048 and engine.model_id == str(tiny_llama_dir)
    with pytest.raises(AdapterError, match="before attach"):
        engine.wake()
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("UNDERSTUDY_MODEL_CACHE", str(tmp_path / "a-file" / "models"))
    with pytest.raises(AdapterError, match="UNDERSTUDY_MODEL_CACHE"):
        LlamaEngine("builtin:tiny-llama")
