"""What the llama engine's generation layer asks of a compute back-end.

One generation layer (`llama.Batcher`: continuous batching, the KV pool's
claims and seals, sampling; `openai_api` above it) runs over either back-end:

* numpy (`llama_model.LlamaModel` over a `llama_model.KVCache`): the
  ``llama`` adapter;
* torch (`llama_torch.TorchModel` over a `llama_torch.TorchCache`), on the
  CPU or a CUDA device: the ``torch`` adapter.

A back-end fills a cache of ``slots`` sequences of up to ``max_len``
positions and hands back float32 logits as numpy arrays, which
`llama_model.sample` turns into tokens the same way for both. Its promise is
`llama_model`'s: a position's logits depend only on the prompt and the ids
before it (prompts in chunks on a fixed grid, decode rows one by one), so a
stream continued by another engine of the same back-end is the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from understudy.engine_shim.adapters.llama_model import Prompt, Row
from understudy.engine_shim.kvpool import BlockSums

__all__ = ["Cache", "Forward"]

F32 = npt.NDArray[np.float32]


class Cache(Protocol):
    """A KV cache, as the batcher sees it: its shape only."""

    @property
    def slots(self) -> int: ...

    @property
    def max_len(self) -> int: ...


C_contra = TypeVar("C_contra", bound=Cache, contravariant=True)


class Forward(Protocol[C_contra]):
    """The model's ways through the cache (see `llama_model.LlamaModel`)."""

    def prefill(self, tokens: Sequence[int], cache: C_contra, slot: int) -> F32: ...

    def prefill_chunks(
        self,
        tokens: Sequence[int],
        cache: C_contra,
        slot: int,
        start: int,
        chunk: int,
        progress: Callable[[], None] | None = None,
    ) -> F32: ...

    def prefill_batch(
        self,
        prompts: Sequence[Prompt],
        cache: C_contra,
        chunk: int,
        progress: Callable[[], None] | None = None,
    ) -> list[F32]: ...

    def sums_blocks(self, block_tokens: int) -> bool: ...

    def decode(
        self, rows: Sequence[Row], cache: C_contra, sums: Mapping[int, BlockSums] | None = None
    ) -> F32: ...
