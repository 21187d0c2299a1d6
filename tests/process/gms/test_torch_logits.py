"""The torch engine's forward (``adapters.llama_torch``) against transformers'
``LlamaForCausalLM`` on the same tiny-llama checkpoint, float32, on the CPU
and, marked ``gpu``, on CUDA: issue 29's bound, every logit within 1e-3, and
the same greedy token at every position.

The prompt runs through ``prefill`` and then one ``decode`` row a position,
the two ways the engine computes, and each position's logits are compared
with transformers' whole-sequence forward.

Needs torch and transformers: here the vLLM venv's python
(``$(hack/vllm/venv)/bin/python -m pytest tests/process/gms/test_torch_logits.py``,
this checkout's ``*/src`` on ``PYTHONPATH``), on a GPU machine its own
(``hack/gpu/check`` runs ``-m gpu``); skipped where either is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.llama_model import LlamaConfig, Row
from understudy.engine_shim.adapters.packing import pack_into, packed_size, views_from

torch = pytest.importorskip("torch", reason="needs torch (the vLLM venv, or a GPU machine's)")
transformers = pytest.importorskip("transformers", reason="needs transformers")

from understudy.engine_shim.adapters import llama_torch  # noqa: E402

TOLERANCE = 1e-3  # max abs difference of any logit (issue 29)
PREFILL = 8  # positions through prefill; the rest one decode row each

DEVICES = [
    "cpu",
    pytest.param(
        "cuda:0",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch"),
        ],
    ),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"), seed=tiny_llama.DEFAULT_SEED)


def _ours(model_dir: Path, device: str) -> tuple[Any, LlamaConfig]:
    """The engine's model as the engine makes it: packed weights, tensors over
    them, moved to ``device`` (the engine maps GMS memory there instead)."""
    config = LlamaConfig.from_dir(model_dir)
    buf = bytearray(packed_size(model_dir))
    records = pack_into(buf, model_dir)
    host = llama_torch.host_tensors(views_from(buf, records))
    weights = {name: t.to(device) for name, t in host.items()}
    return llama_torch.TorchModel(weights, config, device), config


@pytest.mark.parametrize("length", [40, 300])
@pytest.mark.parametrize("device", DEVICES)
def test_logits_match_transformers(
    model_dir: Path, device: str, length: int, record_property: Any
) -> None:
    model, config = _ours(model_dir, device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to(device).eval()
    ids = np.random.default_rng(length).integers(0, config.vocab_size, length).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
        cache = llama_torch.TorchCache(config, 1, length, device)
        first = model.prefill(ids[:PREFILL], cache, 0)
        rows = [model.decode([Row(0, p, ids[p])], cache)[0] for p in range(PREFILL, length)]
    got = np.stack([np.asarray(first), *map(np.asarray, rows)])
    diff = float(np.abs(got - want[PREFILL - 1 :]).max())
    record_property("max_abs_diff", diff)
    print(f"{device}, {length} tokens: max |logit diff| = {diff:.2e}")
    assert diff < TOLERANCE
    assert (got.argmax(-1) == want[PREFILL - 1 :].argmax(-1)).all()
