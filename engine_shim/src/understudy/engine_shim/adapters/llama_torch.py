"""The llama engine's forward pass in torch: `llama_model`'s, ported.

The ``torch`` adapter's back-end (`llama_backend`), on the CPU or a CUDA
device. It is a port of our numpy forward, not transformers'
``LlamaForCausalLM``: the generation layer needs a cache of fixed slots whose
bytes are the GMS KV pool's arena (sealed, checksummed and adopted by the
next engine, ``kvpool``), and one token appended to many sequences per step
with each row's numbers independent of the others'. transformers' caches are
lists of tensors it grows and concatenates itself, per batch, so its cache
cannot be the pool (docs/torch.md).

Numerics follow `llama_model` step by step (float32; RMSNorm as 1/sqrt;
SiLU as x / (1 + e^-x); the same RoPE tables; softmax as max-subtract, exp,
divide), and so does the determinism argument: prompts run in chunks on a
fixed grid (`chunks`; `prefill` too, from ``PREFILL_CHUNK``), and `decode` does
every matrix product row by row and attention per row over the row's own
sequence, so a row's bits never depend on which rows share its step. On the
CPU torch runs on one thread (`TorchModel` sets it), as numpy runs on one
OpenBLAS thread: a reduction's order then does not depend on the machine's
load or cores.

Weights are tensors over memory someone else owns: on the host, torch views
of `packing.views_from`'s numpy views of the GMS mapping; on CUDA, tensors
over the VMM mapping's device pointer (`torch_memory`). Neither is a copy.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from understudy.engine_shim import chunks
from understudy.engine_shim.adapters.llama_model import (
    LAYER_PARTS,
    LlamaConfig,
    Prompt,
    Row,
    rope_tables,
)
from understudy.engine_shim.adapters.packing import TensorRecord, WeightsError
from understudy.engine_shim.kvpool import BlockSums

__all__ = ["PREFILL_CHUNK", "TorchCache", "TorchModel", "host_tensors", "typed"]

F32 = npt.NDArray[np.float32]
Tensor = Any  # torch.Tensor: torch is not in the main venv, where mypy runs

PREFILL_CHUNK: Final = 64
"""The first chunk of a whole-prompt `prefill`'s grid (`chunks`; the llama
engine's): a prompt's scores are then (kv heads, at most 256 x group, keys),
never the whole prompt squared."""


def host_tensors(views: Mapping[str, npt.NDArray[np.generic]]) -> dict[str, Tensor]:
    """Torch tensors sharing the memory of numpy ``views`` (no copy)."""
    with warnings.catch_warnings():
        # The views are read-only (a read-only GMS mapping); torch warns that
        # it cannot enforce that. The model never writes a weight.
        warnings.simplefilter("ignore", UserWarning)
        return {name: torch.from_numpy(view) for name, view in views.items()}


def typed(raw: Tensor, record: TensorRecord) -> Tensor:
    """The tensor ``record`` describes, over ``raw`` (its bytes, uint8): a view."""
    dtype = getattr(torch, record["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsError(f"{record['name']!r}: unknown dtype {record['dtype']!r}")
    return raw.view(dtype).view(record["shape"])


class TorchCache:
    """`llama_model.KVCache` in torch: (layers, slots, kv heads, max_len, head dim)
    keys and values, the engine's own zeros or, given ``k`` and ``v``, tensors
    over the KV pool's arena."""

    def __init__(
        self,
        config: LlamaConfig,
        slots: int,
        max_len: int,
        device: str = "cpu",
        k: Tensor | None = None,
        v: Tensor | None = None,
    ) -> None:
        shape = (config.num_layers, slots, config.num_kv_heads, max_len, config.head_dim)
        for given in (k, v):
            if given is not None and (tuple(given.shape) != shape or given.dtype != torch.float32):
                raise ValueError(f"a cache tensor must be float32{shape}")
        self.k: Final = torch.zeros(shape, dtype=torch.float32, device=device) if k is None else k
        self.v: Final = torch.zeros(shape, dtype=torch.float32, device=device) if v is None else v
        self.slots: Final = slots
        self.max_len: Final = max_len


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: Tensor
    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    mlp_norm: Tensor
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor


class TorchModel:
    """``LlamaForCausalLM`` over tensors someone else owns, on ``device``."""

    def __init__(self, weights: Mapping[str, Tensor], config: LlamaConfig, device: str = "cpu"):
        used: dict[str, Tensor] = {}
        for name, shape in config.tensor_shapes().items():
            try:
                t = weights[name]
            except KeyError:
                raise WeightsError(f"missing tensor {name!r}") from None
            if t.dtype != torch.float32 or tuple(t.shape) != shape:
                raise WeightsError(f"{name!r}: {t.dtype}{tuple(t.shape)}, expected float32{shape}")
            if str(t.device) != str(torch.device(device)):
                raise WeightsError(f"{name!r} is on {t.device}, the model on {device}")
            used[name] = t
        c = config
        self.config: Final = c
        self.device: Final = torch.device(device)
        self.tensors: Final[Mapping[str, Tensor]] = used
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # the module docstring: one reduction order
        self._embed = used["model.embed_tokens.weight"]
        self._layers: Final = tuple(
            _Layer(*[used[f"model.layers.{n}.{part}.weight"] for part in LAYER_PARTS])
            for n in range(c.num_layers)
        )
        self._norm = used["model.norm.weight"]
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        self._head = used[head]
        self._eps: Final = c.rms_norm_eps
        self._scale: Final = 1.0 / math.sqrt(c.head_dim)
        self._rep: Final = c.num_heads // c.num_kv_heads
        # numpy's tables, so both back-ends rotate by the same float32 angles.
        cos, sin = rope_tables(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self._cos = torch.from_numpy(cos).to(self.device)
        self._sin = torch.from_numpy(sin).to(self.device)

    # --- numerics (llama_model's, in torch) ----------------------------------------

    def _rms(self, x: Tensor, weight: Tensor) -> Tensor:
        variance = (x * x).mean(dim=-1, keepdim=True)
        return weight * (x * (1.0 / torch.sqrt(variance + self._eps)))

    @staticmethod
    def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @staticmethod
    def _softmax(scores: Tensor) -> Tensor:
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.exp(scores)
        return probs / probs.sum(dim=-1, keepdim=True)

    @staticmethod
    def _rowwise(x: Tensor, weight: Tensor) -> Tensor:
        """x (rows, in) @ weight.T as one vector-matrix product per row: a row's
        bits do not depend on how many rows share the call."""
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        for r in range(x.shape[0]):
            torch.mv(weight, x[r], out=out[r])
        return out

    @staticmethod
    def _matmul(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.T

    def _mlp(self, x: Tensor, layer: _Layer, matmul: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        h = self._rms(x, layer.mlp_norm)
        gate = matmul(h, layer.w_gate)
        gate = gate / (1.0 + torch.exp(-gate))  # SiLU, as llama_model writes it
        gate = gate * matmul(h, layer.w_up)
        return matmul(gate, layer.w_down)

    def _logits(self, x: Tensor, rowwise: bool) -> F32:
        h = self._rms(x, self._norm)
        out = self._rowwise(h, self._head) if rowwise else h @ self._head.T
        logits: F32 = out.to("cpu").numpy()
        return logits

    def _ids(self, tokens: Sequence[int]) -> Tensor:
        ids = [int(t) for t in tokens]
        if not ids:
            raise ValueError("expected a non-empty list of token ids")
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    # --- the ways through the cache (llama_backend.Forward) ---------------------

    def prefill(self, tokens: Sequence[int], cache: TorchCache, slot: int) -> F32:
        """Run ``tokens`` at positions 0.. into ``slot``; the logits after the last."""
        return self.prefill_chunks(tokens, cache, slot, 0, PREFILL_CHUNK)

    def prefill_chunks(
        self,
        tokens: Sequence[int],
        cache: TorchCache,
        slot: int,
        start: int,
        chunk: int,
        progress: Callable[[], None] | None = None,
    ) -> F32:
        """`llama_model.LlamaModel.prefill_chunks`: ``tokens[start:]`` in chunks on
        the grid whose first chunk is ``chunk`` (`chunks`); the logits after
        the last token."""
        if not 0 <= start < len(tokens) or chunks.start_before(start, chunk) != start:
            raise ValueError(f"start {start} is not a chunk boundary before {len(tokens)}")
        x: Tensor | None = None
        with torch.no_grad():
            begin = start
            while begin < len(tokens):
                end = chunks.end_after(begin, chunk)
                x = self._extend(tokens[begin:end], cache, slot, begin)
                begin = end
                if progress is not None:
                    progress()
            assert x is not None
            logits: F32 = self._logits(x[-1:], rowwise=False)[0]
        return logits

    def prefill_batch(
        self,
        prompts: Sequence[Prompt],
        cache: TorchCache,
        chunk: int,
        progress: Callable[[], None] | None = None,
    ) -> list[F32]:
        """`llama_model.LlamaModel.prefill_batch`, one prompt after another: which
        row counts keep a row's bits in cuBLAS's and torch's CPU products is not
        probed, so no product is shared."""
        return [
            self.prefill_chunks(p.tokens, cache, p.slot, p.start, chunk, progress) for p in prompts
        ]

    def _extend(self, tokens: Sequence[int], cache: TorchCache, slot: int, start: int) -> Tensor:
        """Positions ``start``.. of ``slot`` from ``tokens``, attending to the cache
        before them; the hidden states after the last layer (before the norm)."""
        c = self.config
        ids = self._ids(tokens)
        n = ids.shape[0]
        end = start + n
        if end > min(cache.max_len, c.max_position_embeddings):
            raise ValueError(f"{end} positions exceed the context of {cache.max_len}")
        kvh, d = c.num_kv_heads, c.head_dim
        cos, sin = self._cos[start:end, None], self._sin[start:end, None]
        x = self._embed[ids]
        for li, layer in enumerate(self._layers):
            h = self._rms(x, layer.attn_norm)
            q = self._rope((h @ layer.wq.T).view(n, c.num_heads, d), cos, sin) * self._scale
            k = self._rope((h @ layer.wk.T).view(n, kvh, d), cos, sin)
            cache.k[li, slot, :, start:end] = k.transpose(0, 1)
            cache.v[li, slot, :, start:end] = (h @ layer.wv.T).view(n, kvh, d).transpose(0, 1)
            context = self._attend(q, cache.k[li, slot, :, :end], cache.v[li, slot, :, :end], start)
            x = x + context.reshape(n, c.num_heads * d) @ layer.wo.T
            x = x + self._mlp(x, layer, self._matmul)
        return x

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
        """Causal attention of ``q`` (n, heads, d) at positions start.. over ``keys``
        and ``values`` (kv heads, start + n, d); (n, heads, d). The ``rep`` query
        heads of a KV group are rows of one product with their KV head."""
        n, heads, d = q.shape
        kvh, end, rep = keys.shape[0], keys.shape[1], self._rep
        grouped = q.view(n, kvh, rep, d).permute(1, 0, 2, 3).reshape(kvh, n * rep, d)
        scores = (grouped @ keys.transpose(1, 2)).view(kvh, n, rep, end)
        query_pos = torch.arange(start, start + n, device=q.device)[:, None]
        future = torch.arange(end, device=q.device)[None, :] > query_pos  # (n, end)
        scores = scores.masked_fill(future[None, :, None, :], float("-inf"))
        probs = self._softmax(scores).view(kvh, n * rep, end)
        context = (probs @ values).view(kvh, n, rep, d)
        return context.permute(1, 0, 2, 3).reshape(n, heads, d)

    def sums_blocks(self, block_tokens: int) -> bool:
        """No: a claim's checksums are read on a thread beside the step."""
        return False

    def decode(
        self, rows: Sequence[Row], cache: TorchCache, sums: Mapping[int, BlockSums] | None = None
    ) -> F32:
        """`llama_model.LlamaModel.decode`: append ``rows`` to their sequences'
        caches; the logits after each row, each independent of the others.
        Sums no blocks (`sums_blocks`)."""
        if sums:
            raise ValueError("the torch back-end sums no blocks in its steps")
        c = self.config
        r = len(rows)
        ids = self._ids([row.token for row in rows])
        positions = [row.position for row in rows]
        if min(positions) < 0 or max(positions) >= min(cache.max_len, c.max_position_embeddings):
            raise ValueError(f"position out of the context of {cache.max_len}")
        kvh, rep, d = c.num_kv_heads, self._rep, c.head_dim
        at = torch.tensor(positions, dtype=torch.long, device=self.device)
        cos, sin = self._cos[at][:, None], self._sin[at][:, None]
        with torch.no_grad():
            x = self._embed[ids]
            for li, layer in enumerate(self._layers):
                h = self._rms(x, layer.attn_norm)
                q = self._rope(
                    self._rowwise(h, layer.wq).view(r, kvh, rep, d), cos[:, None], sin[:, None]
                )
                q = q * self._scale
                k = self._rope(self._rowwise(h, layer.wk).view(r, kvh, d), cos, sin)
                v = self._rowwise(h, layer.wv).view(r, kvh, d)
                keys, values = cache.k[li], cache.v[li]
                context = torch.empty((r, kvh, rep, d), dtype=torch.float32, device=self.device)
                # Row by row, in order: a later row of the same sequence sees
                # this one's keys, as in llama_model.
                for i, row in enumerate(rows):
                    keys[row.slot, :, row.position] = k[i]
                    values[row.slot, :, row.position] = v[i]
                for i, row in enumerate(rows):
                    length = row.position + 1
                    scores = q[i] @ keys[row.slot, :, :length].transpose(1, 2)
                    context[i] = self._softmax(scores) @ values[row.slot, :, :length]
                x = x + self._rowwise(context.view(r, c.num_heads * d), layer.wo)
                x = x + self._mlp(x, layer, self._rowwise)
            return self._logits(x, rowwise=True)
