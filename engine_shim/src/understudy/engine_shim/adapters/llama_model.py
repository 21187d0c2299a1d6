"""A Llama decoder in pure numpy: the generative reference engine's model.

The forward pass is Hugging Face's ``LlamaForCausalLM`` in float32: token
embedding, then per layer RMSNorm → grouped-query attention with rotary
position embeddings (HF's "default" RoPE, rotate-half form) → residual →
RMSNorm → SwiGLU MLP → residual, then a final RMSNorm and the output head.

Like `minilm`, the model holds references to weights it does not own (the
read-only views `packing.views_from` gives over a GMS allocation) and never
copies one. Its working memory is a `KVCache` the caller allocates: one slot
per running sequence, every slot able to hold ``max_len`` positions.

Two paths fill the cache and give logits:

* `prefill` runs a whole prompt as one batch of rows (matrix products), for
  speed; `prefill_chunks` runs it in chunks at fixed positions, and
  `prefill_batch` several prompts' chunks in one pass over the layers, each
  chunk in its own products, each prompt attending over its own slot. Attention is
  blocked: a block of ``QUERY_BLOCK`` query positions meets only the keys up
  to its own end (the causal half is never computed), as one product per KV
  head for all the query heads that share it. Its result depends only on the
  prompt's ids (and the chunk grid).
* `decode` appends rows of any number of sequences at once, so that a
  row's numbers depend only on its sequence — never on which other rows
  share the step. OpenBLAS picks its kernels by a product's shape: the row
  of a 1-row product and the same row inside an 8-row product differ in the
  last bits, and so do rows by their place in a product (measured with
  numpy 2.4's OpenBLAS 0.3.31: its small-matrix kernel takes rows four at a
  time and the rows left over another way). So a step's rows are padded with
  zeros to a multiple of DECODE_ROWS, and each group of WEIGHT_ROWS rows of
  a weight meets them in products of one fixed shape, (WEIGHT_ROWS, in) @
  (in, DECODE_ROWS): a stack of them, which numpy hands to BLAS one by one
  (`_by_weight_rows`). A weight row is read from memory once for all the
  step's rows, and a product's operands fit in the L1 cache. A probe at
  start-up (`products_keep_rows`) checks, on the model's own weight shapes,
  that such a product gives a row the same bits at each of its places, in
  each group of rows; where it does not (another BLAS), every product is
  row by row (vector times matrix). Attention is per row over its own
  sequence. (SmolLM2 in the engine, one core, numpy 2.4.6 with OpenBLAS
  0.3.31, a step of 8 rows: on a Zen 3 EPYC, 129 ms in the products of 4
  rows over 512 KiB blocks of each weight until 2026-12-04, which OpenBLAS
  packed on every call, and 92 ms in products of one weight row each, (1,
  in) @ (in, 8), 204,672 calls a step; on an AVX-512 Xeon, 2026-12-05,
  one process alternating the two forms, 100 ms in those and 80 ms in
  groups of 8 weight rows.) Where the package was built with its C kernels
  (`decode_kernels`), the products and the attention run in them instead,
  which keep the same promise by construction (60 ms a step of 8 rows on
  an EPYC where numpy's forms took 124).

A row's bits inside a bigger product are not those it has alone, nor at
another place, for any number of rows: with OpenBLAS 0.3.31's Haswell
kernels (an AMD EPYC here) a row of 8 differed whenever other rows came
before or after it, in 26 of 27 arrangements (2026-12-02); other cores moved
the bound between 3 and 24 rows. So `prefill_batch` never stacks chunks of
different prompts in one product: `_extend` gives each chunk its own
product with each weight, of the shape the chunk has when it runs alone (the
chunk grid fixes it), and only shares the pass over the layers (a layer's
weights are read from memory for the first chunk and from the cache for the
others; 8 chunks of 64 rows through SmolLM2's MLP matrices, one core, took
13.8-28 ms as 8 products against 13.1-17.9 ms as one, inside this VM's
noise but likely up to a fifth more). What that leaves to the BLAS, that
a product's bits do not go by where its rows lie in memory, a probe checks
at start-up (`parts_keep_bits`); where it fails the prompts run one after
another.

Together: the logits at every generated position are a function of the
prompt and the ids before that position, bit for bit on one machine with one
BLAS thread (see `minilm` on ``OPENBLAS_NUM_THREADS=1``), however requests
were batched and whichever engine generated the earlier ids. That is the
determinism `generation` promises; an engine that continues a migrated
stream prefills the prompt and feeds the ids already generated through
`decode`, exactly as the first engine did.

`sample` picks a token: greedy is the argmax; seeded sampling draws position
``p``'s uniform number from a generator keyed by ``(seed, p)`` alone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import mmap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from understudy.engine_shim import chunks
from understudy.engine_shim.adapters import decode_kernels
from understudy.engine_shim.adapters.packing import ALIGNMENT, WeightsError
from understudy.engine_shim.kvpool import BlockSums

__all__ = [
    "LONG_SCORES",
    "QUERY_BLOCK",
    "ROWWISE_BLOCK_BYTES",
    "KVCache",
    "LlamaConfig",
    "LlamaModel",
    "Prompt",
    "Row",
    "apply_rope",
    "lazy_zeros",
    "parts_keep_bits",
    "products_keep_rows",
    "rms_norm",
    "rope_tables",
    "sample",
    "silu",
    "uniform",
]

F32 = npt.NDArray[np.float32]

ROWWISE_BLOCK_BYTES: Final = 8 << 20
"""Weight bytes per block of a decode's row-by-row products (where
`products_keep_rows` fails): well inside the L3 cache (32 MB here). A
layer's matrices (at most 3.5 MB for SmolLM2) are one block; the output head
(113 MB) is 14, so a step of 8 rows reads it from memory once, not 8 times."""
DECODE_ROWS: Final = 8
"""Rows of x in each of a decode's products (module docstring): a step's
rows are padded to a multiple of it. BLAS takes a product's columns (these
rows) 4 at a time, and the columns left over another way. SmolLM2, one core,
a step's products with one weight row each: 8 rows took 74-80 ms in groups
of 8 and 99 ms in groups of 4; 1 row (padded) 70-78 ms either way."""
WEIGHT_ROWS: Final = 8
"""Rows of a weight in each of a decode's products (module docstring).
SmolLM2 in the engine, one core, an AVX-512 Xeon, 2026-12-05, a step of 8
rows beside a CI run (load about 2): 75-81 ms in groups of 4, 75-77 of 8,
77-80 of 16, 79-83 of 32 weight rows; 87 ms with one weight row a product
in a run before."""
LONG_SCORES: Final = 512
"""Positions from which a decode row's attention scores are one vector
product per query head (`_decode_scores`) rather than one matrix product per
KV head. OpenBLAS's small-matrix path for a 3-row product against thousands
of keys is slow: SmolLM2's 30 layers at 4,000 positions, one core, took 20.4
ms as matrix products against 8.6 ms as vector products (SkylakeX kernels),
11.8 against 7.1 ms (Haswell's); at 512 positions 2.7 against 1.0 (0.9
against 1.0); below it the matrix product is as fast or faster (0.3 against
0.7 ms at 256). The choice goes by the row's length alone, so a row's bits
still depend only on its own sequence (module docstring)."""
QUERY_BLOCK: Final = 32
"""Query positions per attention block in a prefill. A block's scores (3 KV
heads x 32 x 3 query heads x the keys so far: 1.2 MB at 1,024 positions for
SmolLM2) stay near the L2 cache, where a 1,024-token prompt's whole scores
were 38 MB, written and read 5 times. Measured over 1,024 positions (one
run, load 11): blocks of 16, 32, 64, 128 took 3.8, 3.0, 4.0, 3.8 s of
attention; over 512: 32 took 0.83 s, 128 1.36 s."""


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """What the forward pass needs from a Llama ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """Read a Hugging Face Llama config; refuse what this code does not compute
        (another activation, RoPE scaling, biases) rather than compute something else."""
        arch = cfg.get("architectures") or ["LlamaForCausalLM"]
        if cfg.get("model_type") != "llama" or arch != ["LlamaForCausalLM"]:
            raise WeightsError(f"not a Llama causal LM: {cfg.get('model_type')}/{arch}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise WeightsError(f"unsupported activation {cfg.get('hidden_act')!r}")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise WeightsError("attention or MLP biases are not supported")
        # transformers < 5 writes rope_theta (+ rope_scaling); 5 writes rope_parameters.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise WeightsError(f"unsupported RoPE type {rope_type!r}")
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise WeightsError("partial rotary embeddings are not supported")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise WeightsError(f"{heads} heads do not split into {kv_heads} KV groups")
        if head_dim % 2:
            raise WeightsError(f"head_dim {head_dim} is odd: RoPE rotates pairs")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> LlamaConfig:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model reads, by its name in model.safetensors."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


# --- numerics -------------------------------------------------------------------


def rms_norm(x: F32, weight: F32, eps: np.float32) -> F32:
    """HF's LlamaRMSNorm in float32: x / sqrt(mean(x²) + eps) * weight."""
    variance = (x * x).mean(axis=-1, keepdims=True)
    out: F32 = weight * (x * (np.float32(1.0) / np.sqrt(variance + eps)))
    return out


def silu(x: F32) -> F32:
    out: F32 = (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32, copy=False)
    return out


def rope_tables(head_dim: int, theta: float, max_len: int) -> tuple[F32, F32]:
    """(cos, sin), each (max_len, head_dim // 2), computed in float32 as HF and
    vLLM do: inv_freq = 1 / theta ** (2i / d); angle = position * inv_freq."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
    angles = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def apply_rope(x: F32, cos: F32, sin: F32) -> F32:
    """Rotate ``x`` (..., positions, head_dim) by angles (positions, head_dim // 2)
    in HF's rotate-half layout: the first and second halves of a head form the pairs."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out: F32 = np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
    return out


def _rowwise(x: F32, weight: F32) -> F32:
    """x (rows, in) @ weight.T, one vector-matrix product per row (module docstring),
    over ROWWISE_BLOCK_BYTES of the weight's rows at a time: each block is read
    from memory for the first row and from the L3 cache for the others. The
    blocks do not depend on the rows, so neither do a row's bits."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    starts = _blocks(weight, ROWWISE_BLOCK_BYTES)
    for begin in starts:
        wt = weight[begin : begin + starts.step].T
        for r in range(x.shape[0]):
            np.matmul(x[r], wt, out=out[r, begin : begin + starts.step])
    return out


def _blocks(weight: F32, block_bytes: int) -> range:
    """The first row of each block of ``block_bytes`` of ``weight``'s rows."""
    return range(0, weight.shape[0], max(1, block_bytes // (weight.shape[1] * weight.itemsize)))


def _by_weight_rows(x: F32, weight: F32) -> F32:
    """x (rows, in) @ weight.T as one product per group of WEIGHT_ROWS rows of
    ``weight`` and group of DECODE_ROWS of x's rows, zero-padded,
    ``(WEIGHT_ROWS, in) @ (in, DECODE_ROWS)``, and the weight's last rows that
    make no whole group one by one, ``(1, in) @ (in, DECODE_ROWS)`` (module
    docstring). Their shapes do not depend on x's rows, so, where
    `products_keep_rows`, neither do a row's bits. A group of weight rows
    meets every group of x's rows while it is in the L1 cache: the weights
    are read from memory once a step. ``weight`` is C-contiguous (a packed
    view), so that its groups are a view, not a copy."""
    rows, width = x.shape
    padded = -(-rows // DECODE_ROWS) * DECODE_ROWS
    # At the weights' alignment always, so that a kernel that goes by
    # addresses cannot give a row other bits from one step to the next.
    size = padded * width
    buffer = np.zeros(size + ALIGNMENT // 4, dtype=np.float32)
    skip = (-buffer.ctypes.data % ALIGNMENT) // 4
    groups = buffer[skip : skip + size].reshape(padded, width)
    groups[:rows] = x
    columns = groups.reshape(-1, DECODE_ROWS, width).transpose(0, 2, 1)  # (groups, in, 8)
    whole = weight.shape[0] - weight.shape[0] % WEIGHT_ROWS
    # (whole / WEIGHT_ROWS, groups, WEIGHT_ROWS, DECODE_ROWS) -> (padded, whole)
    out = np.matmul(weight[:whole].reshape(-1, 1, WEIGHT_ROWS, width), columns)
    parts = [out.transpose(1, 3, 0, 2).reshape(padded, whole)]
    if whole < weight.shape[0]:
        rest = np.matmul(weight[whole:, None, None, :], columns)  # (left, groups, 1, 8)
        parts.append(rest.reshape(-1, padded).T)
    result: F32 = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return result[:rows]


def products_keep_rows(weights: Sequence[F32]) -> bool:
    """Whether `_by_weight_rows` gives a row the same bits at each place of its
    group, in the first group or the second, for each of ``weights`` (then a
    decode's rows do not depend on each other; otherwise a decode goes row
    by row). Checked on the last 64 rows of each weight and those that make
    no whole group, of its own width and strides (the kernels go by shape):
    a few milliseconds."""
    rng = np.random.default_rng(0)
    for weight in weights:
        w = weight[-(64 + weight.shape[0] % WEIGHT_ROWS) :]
        x = rng.standard_normal((1, w.shape[1]), dtype=np.float32)
        first = _by_weight_rows(x, w)[0]
        for place in range(2 * DECODE_ROWS):
            rows = rng.standard_normal((place + 1, w.shape[1]), dtype=np.float32)
            rows[place] = x[0]
            if not np.array_equal(_by_weight_rows(rows, w)[place], first):
                return False
    return True


def _in_parts(x: F32, weight: F32, parts: Sequence[tuple[int, int]]) -> F32:
    """x (rows, in) @ weight.T as one product per part ``x[a:b]`` of ``parts``:
    a part's product has the shape it has when the part runs alone, whichever
    parts share the call (module docstring). One after another, so the weight
    is read from memory for the first part and from the cache for the rest."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    wt = weight.T
    for a, b in parts:
        np.matmul(x[a:b], wt, out=out[a:b])
    return out


def parts_keep_bits(weights: Sequence[F32], chunk: int) -> bool:
    """Whether `_in_parts` gives a part of up to ``chunk`` rows the same bits at
    any row of a bigger array as alone, for each of ``weights`` (then
    `LlamaModel.prefill_batch` runs several prompts' chunks in one pass over
    the layers; otherwise one prompt after another). The shapes are the same
    by construction; what this checks is that the kernels do not go by where
    the rows lie in memory: parts of 1 to 8 rows (the small-matrix kernels'
    sizes) and of ``chunk`` - 1 and ``chunk``, at odd offsets; tens of
    milliseconds, once per ``chunk``."""
    rng = np.random.default_rng(0)
    sizes = sorted({*range(1, min(chunk, 8) + 1), max(1, chunk - 1), chunk})
    for w in weights:
        x = rng.standard_normal((2 * chunk + 1, w.shape[1]), dtype=np.float32)
        for m in sizes:
            offset = 1 + m % chunk  # never 0: never where the array alone starts
            parts = [(0, offset), (offset, offset + m)]
            alone = x[offset : offset + m].copy() @ w.T
            if not np.array_equal(_in_parts(x[: offset + m], w, parts)[offset:], alone):
                return False
    return True


def _decode_scores(q: F32, keys: F32) -> F32:
    """One decode row's scores: ``q`` (kv_heads, rep, d) against its sequence's
    ``keys`` (kv_heads, length, d); (kv_heads, rep, length). Which product
    computes them goes by the length alone (LONG_SCORES)."""
    kvh, rep, _ = q.shape
    length = keys.shape[1]
    if length < LONG_SCORES:
        out: F32 = q @ keys.transpose(0, 2, 1)
        return out
    out = np.empty((kvh, rep, length), dtype=np.float32)
    for h in range(kvh):
        for r in range(rep):
            np.matmul(keys[h], q[h, r], out=out[h, r])
    return out


def _softmax(scores: F32) -> F32:
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    out: F32 = probs / probs.sum(axis=-1, keepdims=True)
    return out


# --- sampling -------------------------------------------------------------------


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends on ``(seed, position)`` only.

    From numpy's PCG64 bit generator seeded through a SeedSequence: numpy
    keeps both stable across releases (its distributions carry no such promise,
    so the float is made here from the raw 64 bits: their top 53).
    """
    seq = np.random.SeedSequence([seed % 2**64, position])
    raw = int(np.random.PCG64(seq).random_raw())
    return (raw >> 11) * 2.0**-53


def sample(
    logits: F32, temperature: float, top_p: float = 1.0, seed: int = 0, position: int = 0
) -> int:
    """The token for one position: the argmax when ``temperature`` is 0, else a draw
    from softmax(logits / temperature) cut to its top-``top_p`` nucleus, by the
    inverse CDF at ``uniform(seed, position)``.

    The CDF runs over the kept tokens in id order, not probability order, so
    that a change in the last bits of the logits moves the boundaries by as
    little and reorders nothing.
    """
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        mass = np.cumsum(probs[order])
        keep = np.sort(order[: int(np.searchsorted(mass, top_p)) + 1])
    else:
        keep = np.arange(probs.size)
    cdf = np.cumsum(probs[keep])
    at = int(np.searchsorted(cdf, uniform(seed, position) * cdf[-1], side="right"))
    return int(keep[min(at, keep.size - 1)])


# --- the model ------------------------------------------------------------------


def lazy_zeros(shape: tuple[int, ...]) -> F32:
    """float32 zeros whose memory the kernel backs page by page (4 KiB) as
    they are first written.

    Not ``np.zeros``: numpy advises transparent huge pages for arrays of 4
    MiB and more, and a cache is written sparsely, a few positions of each
    layer's head at a time. One position then backed 2 MiB: for SmolLM2 at
    8,192 positions, all of a head's keys, so a slot's first token cost its
    whole length. Keys and values of eight chat prompts (36-53 tokens) in a
    fresh cache of 8 slots: resident 2,917 MiB against 58 MiB, and 7.2 s to
    write them on this machine's VM (it backs each 2 MiB block it hands out
    anew, ~3 ms a block; 0.17 s when the blocks were freed just before)
    against 67 ms. The price is a fault per 4 KiB: one slot's 4,000
    positions took 82-131 ms against 27 ms on reused huge pages, 2% of
    their prefill. A decode step over 4,000 positions read them no slower
    (59.0 against 59.2 ms, SmolLM2, one thread). Anonymous private
    memory is zeroed by the kernel and freed with the array."""
    count = math.prod(shape)
    area = mmap.mmap(-1, max(1, count) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Where transparent huge pages are "always" (not just on advice), ask for
    # none; a kernel built without them refuses the advice, and has none.
    with contextlib.suppress(OSError):
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(area, dtype=np.float32, count=count).reshape(shape)


class KVCache:
    """Keys and values of every layer for ``slots`` sequences of up to ``max_len``
    positions. Engine-owned working memory (`lazy_zeros`: untouched slots and
    positions cost no RAM), or, given ``k`` and ``v``, arrays over memory
    someone else owns: the KV pool in GMS (``kvpool``).

    The model writes through ``k`` and ``v`` and reads through ``rk`` and
    ``rv``: the same arrays, or, given them, the same bytes mapped a second
    time (the pool as a standby mapped it read-only, its pages present)."""

    def __init__(
        self,
        config: LlamaConfig,
        slots: int,
        max_len: int,
        k: F32 | None = None,
        v: F32 | None = None,
        reads: tuple[F32, F32] | None = None,
    ) -> None:
        shape = (config.num_layers, slots, config.num_kv_heads, max_len, config.head_dim)
        for given in (k, v, *(reads or ())):
            if given is not None and (given.shape != shape or given.dtype != np.float32):
                raise ValueError(f"a cache array must be float32{shape}")
        self.k: Final = lazy_zeros(shape) if k is None else k
        self.v: Final = lazy_zeros(shape) if v is None else v
        self.rk: Final = self.k if reads is None else reads[0]
        self.rv: Final = self.v if reads is None else reads[1]
        self.slots: Final = slots
        self.max_len: Final = max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass(frozen=True, slots=True)
class Row:
    """One token to append to a sequence's cache: ``slot``'s position ``position``."""

    slot: int
    position: int
    token: int


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a `LlamaModel.prefill_batch`: ``tokens[start:]`` into
    ``slot``, whose positions before ``start`` hold the KV of the rest."""

    tokens: Sequence[int]
    slot: int
    start: int


# A decoder layer's weights in a checkpoint, in ``_Layer``'s field order: every
# back-end (numpy here, torch in llama_torch) reads them by these names.
LAYER_PARTS: Final = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: F32
    wq: F32
    wk: F32
    wv: F32
    wo: F32
    mlp_norm: F32
    w_gate: F32
    w_up: F32
    w_down: F32


class LlamaModel:
    """``LlamaForCausalLM`` over weights someone else owns (see the module docstring).

    ``weights`` maps tensor names (as in model.safetensors) to float32 arrays,
    normally read-only views into shared memory; they are referenced, never
    copied. The caller keeps the underlying buffer alive and mapped.
    """

    def __init__(self, weights: Mapping[str, npt.NDArray[np.generic]], config: LlamaConfig):
        used: dict[str, F32] = {}
        for name, shape in config.tensor_shapes().items():
            try:
                array = weights[name]
            except KeyError:
                raise WeightsError(f"missing tensor {name!r}") from None
            if array.dtype != np.float32 or array.shape != shape:
                raise WeightsError(f"{name!r}: {array.dtype}{array.shape}, expected float32{shape}")
            used[name] = array  # type: ignore[assignment]  # dtype checked just above
        c = config
        self.config: Final = c
        self.tensors: Final[Mapping[str, F32]] = MappingProxyType(used)
        """The arrays the forward pass reads, by name: the caller's, not copies."""
        self._embed = used["model.embed_tokens.weight"]
        self._layers: Final = tuple(
            _Layer(*(used[f"model.layers.{n}.{part}.weight"] for part in LAYER_PARTS))
            for n in range(c.num_layers)
        )
        self._norm = used["model.norm.weight"]
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        self._head = used[head]
        self._eps: Final = np.float32(c.rms_norm_eps)
        self._scale: Final = np.float32(1.0 / math.sqrt(c.head_dim))
        self._rep: Final = c.num_heads // c.num_kv_heads
        # Working memory of the model itself (not weights): 2 x max_pos x d/2 floats.
        self._cos, self._sin = rope_tables(c.head_dim, c.rope_theta, c.max_position_embeddings)
        # A query block's diagonal square: position i attends to keys 0..i.
        self._causal = np.triu(np.full((QUERY_BLOCK,) * 2, -np.inf, dtype=np.float32), k=1)
        self._batch_parts: dict[int, bool] = {}  # batch_parts' probes, by chunk
        native = decode_kernels.kernels
        matrices = [*self._distinct_matrices(), self._head]
        self.native_products: Final = native is not None and native.takes_products(matrices)
        """Whether a decode's products run in C (`decode_kernels`)."""
        self.decode_products: Final = self.native_products or products_keep_rows(matrices)
        """Whether a decode runs in products of rows (else row by row)."""
        numpy_form = _by_weight_rows if self.decode_products else _rowwise
        self._decode_product: Final[Callable[[F32, F32], F32]] = (
            native.products if native is not None and self.native_products else numpy_form
        )
        takes = native is not None and native.takes(c.num_kv_heads, self._rep, c.head_dim)
        self.decode_attention: Final = native if takes else None
        """The C kernels a decode row attends through, or None: numpy's form
        (`decode_kernels`)."""
        if self.decode_attention is not None:
            # Started with the model, not by a failover's first long row.
            self.decode_attention.start()

    def _check_tokens(self, tokens: Sequence[int]) -> npt.NDArray[np.int64]:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("expected a non-empty list of token ids")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}")
        return ids

    def _mlp(self, x: F32, layer: _Layer, matmul: Callable[[F32, F32], F32]) -> F32:
        h = rms_norm(x, layer.mlp_norm, self._eps)
        gate = silu(matmul(h, layer.w_gate))
        gate *= matmul(h, layer.w_up)
        return matmul(gate, layer.w_down)

    def prefill(self, tokens: Sequence[int], cache: KVCache, slot: int) -> F32:
        """Run ``tokens`` at positions 0.. into ``slot``; the logits after the last one.

        Only the last position goes through the output head: for SmolLM2 the
        head of every position would cost as much as a fifth of the prefill's
        arithmetic and (positions x 49,152) floats, 1.6 GB at 8,192 tokens."""
        last: F32 = self.forward(tokens, cache, slot, last_only=True)[-1]
        return last

    def forward(
        self, tokens: Sequence[int], cache: KVCache, slot: int, last_only: bool = False
    ) -> F32:
        """Like `prefill`, returning the logits after every token: (len(tokens), vocab)
        (``last_only``: after the last one, (1, vocab))."""
        x = self._extend([(tokens, slot, 0)], cache)
        if last_only:
            x = x[-1:]
        out: F32 = rms_norm(x, self._norm, self._eps) @ self._head.T
        return out

    def prefill_chunks(
        self,
        tokens: Sequence[int],
        cache: KVCache,
        slot: int,
        start: int,
        chunk: int,
        progress: Callable[[], None] | None = None,
    ) -> F32:
        """Run ``tokens[start:]`` into ``slot``, whose positions 0..start-1 already
        hold the KV of ``tokens[:start]``, in chunks on the grid whose first
        chunk is ``chunk`` (`chunks`); the logits after the last token.

        Chunk boundaries never depend on ``start`` or on the prompt's length, so
        a position's KV is the same bits whether a prompt was run from 0 or
        continued from a chunk boundary of an inherited cache (the KV pool).
        Only the last row goes through the head.
        ``progress`` is called after every chunk (a long prompt is work under
        way, not a stuck engine).
        """
        return self.prefill_batch([Prompt(tokens, slot, start)], cache, chunk, progress)[0]

    def prefill_batch(
        self,
        prompts: Sequence[Prompt],
        cache: KVCache,
        chunk: int,
        progress: Callable[[], None] | None = None,
    ) -> list[F32]:
        """`prefill_chunks` of every prompt, each one's logits after its last
        token, the same bits as each run alone: round by round, every prompt's
        next chunk in one pass over the layers, each chunk its own product
        with each weight (`_in_parts`; one prompt after another where
        `batch_parts` is false). ``progress``: after each round."""
        for p in prompts:
            if not 0 <= p.start < len(p.tokens) or chunks.start_before(p.start, chunk) != p.start:
                raise ValueError(f"start {p.start} is not a chunk boundary before {len(p.tokens)}")
        if len(prompts) > 1 and not self.batch_parts(chunks.WIDEST * chunk):
            return [self.prefill_batch([p], cache, chunk, progress)[0] for p in prompts]
        begins = [p.start for p in prompts]
        last: list[F32 | None] = [None] * len(prompts)
        while todo := [i for i, p in enumerate(prompts) if begins[i] < len(p.tokens)]:
            parts = [
                (i, prompts[i].tokens[begins[i] : chunks.end_after(begins[i], chunk)]) for i in todo
            ]
            x = self._extend([(ids, prompts[i].slot, begins[i]) for i, ids in parts], cache)
            offset = 0
            for i, ids in parts:
                offset += len(ids)
                last[i] = x[offset - 1 : offset]
                begins[i] += len(ids)
            if progress is not None:
                progress()
        head = self._head.T
        return [(rms_norm(x, self._norm, self._eps) @ head)[0] for x in last if x is not None]

    def batch_parts(self, chunk: int) -> bool:
        """Whether `prefill_batch` runs prompts' chunks of up to ``chunk`` rows in
        one pass over the layers (else one prompt after another):
        `parts_keep_bits` of this model's matrices (one of each shape),
        probed once per process and ``chunk``."""
        if chunk not in self._batch_parts:
            self._batch_parts[chunk] = parts_keep_bits(self._distinct_matrices(), chunk)
        return self._batch_parts[chunk]

    def _distinct_matrices(self) -> list[F32]:
        """One of each shape and strides of a layer's matrices (a probe's arrays)."""
        layer = self._layers[0]
        matrices = (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down)
        return list({(w.shape, w.strides): w for w in matrices}.values())

    def _extend(self, parts: Sequence[tuple[Sequence[int], int, int]], cache: KVCache) -> F32:
        """For each part ``(tokens, slot, start)``, positions ``start``.. of ``slot``
        from ``tokens``, attending to the cache before them; the hidden states
        after the last layer (before the norm), the parts' rows in order. Each
        part has its own product with each weight (`_in_parts`), in one pass
        over the layers; attention is each part's own."""
        c = self.config
        ids = self._check_tokens([t for tokens, _, _ in parts for t in tokens])
        spans: list[tuple[int, int, int, int]] = []  # rows from, rows to, slot, start
        row = 0
        for tokens, slot, start in parts:
            if start + len(tokens) > min(cache.max_len, c.max_position_embeddings):
                raise ValueError(
                    f"{start + len(tokens)} positions exceed the context of {cache.max_len}"
                )
            spans.append((row, row + len(tokens), slot, start))
            row += len(tokens)
        n, kvh, d = ids.size, c.num_kv_heads, c.head_dim
        positions = np.concatenate([np.arange(s, s + b - a) for a, b, _, s in spans])
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]
        product = functools.partial(_in_parts, parts=[(a, b) for a, b, _, _ in spans])
        x = self._embed[ids]
        for li, layer in enumerate(self._layers):
            h = rms_norm(x, layer.attn_norm, self._eps)
            q = apply_rope(product(h, layer.wq).reshape(n, c.num_heads, d), cos, sin)
            q *= self._scale  # once per query, not once per score
            k = apply_rope(product(h, layer.wk).reshape(n, kvh, d), cos, sin)
            v = product(h, layer.wv).reshape(n, kvh, d)
            context = np.empty_like(q)
            for a, b, slot, start in spans:
                end = start + b - a
                cache.k[li, slot, :, start:end] = k[a:b].transpose(1, 0, 2)
                cache.v[li, slot, :, start:end] = v[a:b].transpose(1, 0, 2)
                keys, values = cache.rk[li, slot, :, :end], cache.rv[li, slot, :, :end]
                context[a:b] = self._attend(q[a:b], keys, values, start)
            x += product(context.reshape(n, c.num_heads * d), layer.wo)
            x += self._mlp(x, layer, product)
        return x

    def _attend(self, q: F32, keys: F32, values: F32, start: int) -> F32:
        """Causal attention of queries ``q`` (n, heads, d) at positions start..
        over ``keys`` and ``values`` (kv_heads, start + n, d); (n, heads, d).

        Blocked (QUERY_BLOCK): a block of queries meets only the keys up to its
        own last position, and only its diagonal square needs the mask. The
        ``rep`` query heads of one KV group are rows of one product with their
        KV head (grouped-query attention by a reshape, no copy of K or V)."""
        n, heads, d = q.shape
        kvh, rep = keys.shape[0], self._rep
        # (kv, n, rep, d): a block of positions is then (kv, block * rep, d) rows.
        grouped = q.reshape(n, kvh, rep, d).transpose(1, 0, 2, 3)
        out = np.empty((n, kvh, rep, d), dtype=np.float32)
        for b0 in range(0, n, QUERY_BLOCK):
            b1 = min(b0 + QUERY_BLOCK, n)
            rows, end = b1 - b0, start + b1
            block = np.ascontiguousarray(grouped[:, b0:b1]).reshape(kvh, rows * rep, d)
            scores = block @ keys[:, :end].transpose(0, 2, 1)  # (kv, rows * rep, end)
            diagonal = scores.reshape(kvh, rows, rep, end)[..., start + b0 :]
            diagonal += self._causal[:rows, None, :rows]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            context = scores @ values[:, :end]  # (kv, rows * rep, d)
            out[b0:b1] = context.reshape(kvh, rows, rep, d).transpose(1, 0, 2, 3)
        return out.reshape(n, heads, d)

    def sums_blocks(self, block_tokens: int) -> bool:
        """Whether `decode` can sum a KV pool's block checksums (blocks of
        ``block_tokens`` positions) as its attention reads them: where the
        attention kernel runs."""
        return self.decode_attention is not None and block_tokens == decode_kernels.BLOCK

    def decode(
        self, rows: Sequence[Row], cache: KVCache, sums: Mapping[int, BlockSums] | None = None
    ) -> F32:
        """Append ``rows`` to their sequences' caches; the logits after each row.

        Rows of one slot must come in position order, each one position after
        the last the cache holds; a row attends to its own sequence up to and
        including itself. Each row's result is independent of the others
        (module docstring). ``sums``: by row, the blocks of its sequence whose
        checksums its attention adds up as it reads them (`sums_blocks`).
        """
        c = self.config
        r = len(rows)
        ids = self._check_tokens([row.token for row in rows])
        slots = [row.slot for row in rows]
        positions = np.asarray([row.position for row in rows], dtype=np.int64)
        if positions.min() < 0 or positions.max() >= min(cache.max_len, c.max_position_embeddings):
            raise ValueError(f"position out of the context of {cache.max_len}")
        kvh, rep, d = c.num_kv_heads, self._rep, c.head_dim
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]
        lengths = positions + 1
        native = self.decode_attention
        sums = sums or {}
        if sums and native is None:
            raise ValueError("block sums asked of a decode without the attention kernel")
        x = self._embed[ids]
        for li, layer in enumerate(self._layers):
            h = rms_norm(x, layer.attn_norm, self._eps)
            q = apply_rope(
                self._decode_product(h, layer.wq).reshape(r, kvh, rep, d),
                cos[:, None],
                sin[:, None],
            )
            q *= self._scale
            cache.k[li][slots, :, positions] = apply_rope(
                self._decode_product(h, layer.wk).reshape(r, kvh, d), cos, sin
            )
            cache.v[li][slots, :, positions] = self._decode_product(h, layer.wv).reshape(r, kvh, d)
            keys, values = cache.rk[li], cache.rv[li]
            context = np.empty((r, kvh, rep, d), dtype=np.float32)
            if native is not None:  # concatenate's order follows its inputs'
                q = np.ascontiguousarray(q)
            # Per row over its own sequence (the module docstring): a loop over
            # the step's rows, each in the kernel or one product per KV head
            # for its rep heads.
            for i, (slot, length) in enumerate(zip(slots, lengths, strict=True)):
                if native is not None:
                    native.attend(
                        q[i], keys[slot], values[slot], int(length), context[i], sums.get(i), li
                    )
                    continue
                probs = _softmax(_decode_scores(q[i], keys[slot, :, :length]))
                context[i] = probs @ values[slot, :, :length]
            x += self._decode_product(context.reshape(r, c.num_heads * d), layer.wo)
            x += self._mlp(x, layer, self._decode_product)
        return self._decode_product(rms_norm(x, self._norm, self._eps), self._head)


def config_digest(model_dir: Path | str) -> str:
    """sha256 of config.json: says which checkpoint a GMS layout was packed from."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
