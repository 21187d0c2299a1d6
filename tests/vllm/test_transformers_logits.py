"""The numpy Llama's logits against transformers' LlamaForCausalLM on the same
checkpoint, in float32, and its tokenizer against AutoTokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.adapters.llama_model import KVCache

torch = pytest.importorskip("torch", reason="needs torch: run with the vLLM venv's python")
transformers = pytest.importorskip("transformers", reason="needs transformers (the vLLM venv)")

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-4  # max abs difference of any logit
PROMPTS = [
    "Hello, my name is",
    "The shadow engine wakes when the lock is granted to it",
    "東京と大阪 café 😀",
    "def add(a, b):\n    return a + b",
    "x y " * 400,  # 801 tokens: RoPE far out, a long causal mask
]


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", PROMPTS, ids=range(len(PROMPTS)))
def test_logits_match_transformers(
    hf_model: Any, ours: LlamaEngine, text: str, record_property: Any
) -> None:
    ids = ours.encode(text)
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert ours.model is not None
    got = ours.model.forward(ids, KVCache(ours.config, 1, len(ids)), 0)
    diff = float(np.abs(got - want).max())
    record_property("max_abs_diff", diff)
    print(f"{len(ids)} tokens: max |logit diff| = {diff:.2e}")
    assert diff < TOLERANCE
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_incremental_decode_matches_transformers_too(hf_model: Any, ours: LlamaEngine) -> None:
    """The decode path (one row at a time over the KV cache), not just the prefill."""
    ids = ours.encode(PROMPTS[1])
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert ours.model is not None
    from understudy.engine_shim.adapters.llama_model import Row

    cache = KVCache(ours.config, 1, len(ids))
    first = ours.model.prefill(ids[:2], cache, 0)
    rows = [ours.model.decode([Row(0, p, ids[p])], cache)[0] for p in range(2, len(ids))]
    assert np.abs(np.stack([first, *rows]) - want[1:]).max() < TOLERANCE


@pytest.mark.parametrize("text", [*PROMPTS[:4], "", " ", "a<|eot_id|>b"])
def test_token_ids_match_autotokenizer(hf_tokenizer: Any, ours: LlamaEngine, text: str) -> None:
    assert ours.encode(text) == hf_tokenizer(text)["input_ids"]
    ids = ours.encode(text)
    assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_apply_chat_template(hf_tokenizer: Any, ours: LlamaEngine) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hello there!  "},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(want, list):  # transformers 5 returns a BatchEncoding
        want = want["input_ids"]
    assert ours.encode_chat(messages) == want
