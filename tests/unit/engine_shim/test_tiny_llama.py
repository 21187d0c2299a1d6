"""builtin:tiny-llama: made offline, the same bytes for the same seed, cached once
under a lock, and a tokenizer whose ids and chat template behave as
transformers' do (checked against transformers itself in tests/vllm/)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from understudy.engine_shim.adapters import model_cache, models, tiny_llama
from understudy.engine_shim.adapters.llama_model import LlamaConfig
from understudy.engine_shim.adapters.llama_text import ChatTokenizer

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
IMPORT = "from understudy.engine_shim.adapters import tiny_llama as t"


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_the_checkpoint_has_the_promised_shape(tiny_llama_dir: Path) -> None:
    assert {p.name for p in tiny_llama_dir.iterdir()} == FILES
    c = LlamaConfig.from_dir(tiny_llama_dir)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (
        256,
        4,
        2,
        64,
        4,
    )
    assert (c.vocab_size, c.max_position_embeddings) == (2048, 2048)
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == c.tensor_shapes()
    assert all(v.dtype == np.float32 for v in tensors.values())
    # the special tokens can never win a greedy step: their output rows are zero
    assert not tensors["lm_head.weight"][: len(tiny_llama.SPECIAL_TOKENS)].any()


def test_same_seed_same_bytes_in_another_process(tiny_llama_dir: Path, tmp_path: Path) -> None:
    code = f"{IMPORT}; t.build({str(tmp_path / 'again')!r}, seed=0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert digests(tmp_path / "again") == digests(tiny_llama_dir)


def test_another_seed_other_weights_same_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = digests(tiny_llama.build(tmp_path / "s1", seed=1))
    ours = digests(tiny_llama_dir)
    assert other["model.safetensors"] != ours["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in ours.items() if k != "model.safetensors"
    }


def test_the_cli_writes_the_same_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "understudy.cli", "model", "build-llama", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == str(out)
    assert digests(out) == digests(tiny_llama_dir)


def test_cached_builds_once_even_when_two_processes_ask_together(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    code = f"{IMPORT}; print(t.resolve(t.BUILTIN))"
    env = {"UNDERSTUDY_MODEL_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    (built,) = paths
    assert Path(built).parent == cache
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [
        Path(built).name
    ]
    assert not [p for p in cache.iterdir() if p.is_dir() and p.name.startswith(".")]  # no leftovers
    assert digests(Path(built)) == digests(tiny_llama_dir)
    assert tiny_llama.cached(0, cache) == Path(built)  # found, not rebuilt


def test_the_model_cache_is_under_xdg_cache_home_unless_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("UNDERSTUDY_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.cache_dir() == tmp_path / "xdg" / "understudy" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored (the spec)
    assert model_cache.cache_dir() == Path.home() / ".cache" / "understudy" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_cache.cache_dir() == Path.home() / ".cache" / "understudy" / "models"
    monkeypatch.setenv("UNDERSTUDY_MODEL_CACHE", str(tmp_path / "own"))
    assert model_cache.cache_dir() == tmp_path / "own"


def test_model_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERSTUDY_MODEL_CACHE", str(tmp_path))
    assert model_cache.cache_dir() == tmp_path
    assert models.resolve("/some/dir") == Path("/some/dir")
    with pytest.raises(ValueError, match="seed"):
        models.resolve("builtin:tiny-llama:minus-one")
    with pytest.raises(ValueError, match=r"unknown model 'builtin:gpt-5'.*smollm2-135m"):
        models.resolve("builtin:gpt-5")
    assert models.served_name("builtin:tiny-llama:3") == "tiny-llama:3"
    assert models.served_name("/some/dir") == "/some/dir"


# --- the tokenizer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(tiny_llama_dir)


def test_special_tokens_bos_and_eos(tok: ChatTokenizer) -> None:
    ids = [tok.tokenizer.token_to_id(t) for t in tiny_llama.SPECIAL_TOKENS]
    assert ids == [0, 1, 2, 3, 4]
    assert tok.encode("Hello")[0] == 0 and tok.encode("")[:1] == [0]
    assert tok.eos_ids == {1, 4}
    assert tok.vocab_size == 2048


@pytest.mark.parametrize(
    "text", ["Hello, world!", " leading and  double  spaces ", "café 東京 😀", "a\nb\tc", ""]
)
def test_byte_level_round_trip(tok: ChatTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_chat_template(tok: ChatTokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hi there!\n"},
    ]
    assert tok.render_chat(messages) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode_chat(messages)
    assert ids[0] == 0 and ids.count(0) == 1  # BOS once: the template writes it
    assert ids.count(4) == 2 and ids[-1] != 4


def test_tokenizer_config_is_what_transformers_reads(tiny_llama_dir: Path) -> None:
    cfg = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|begin_of_text|>" and cfg["eos_token"] == "<|eot_id|>"
    assert cfg["chat_template"] == tiny_llama.CHAT_TEMPLATE
    generation = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 4]
