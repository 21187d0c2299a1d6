"""The ``torch`` engine: the ``llama`` engine with torch computing, on the CPU or a GPU.

Everything but the arithmetic is the llama engine's (`llama.LlamaEngine`):
the weights packed into GMS by the writer, the batcher, the KV pool with its
seal log and adoption, sampling, the OpenAI surface and the continuation
contract. What differs is the back-end (`llama_backend`): `llama_torch`'s
port of the numpy forward, over torch tensors that share the GMS mapping.

- **Device.** With GMS on CUDA (``UNDERSTUDY_GMS_BACKEND=cuda``) the model
  runs on the claim's first device, ``cuda:N``, over the VMM mapping
  (`torch_memory`: UNVERIFIED until a GPU runs it); with GMS on the host, on
  the CPU over the memfd mapping.
- **KV cache.** On the CPU it is the GMS KV pool's arena, as the llama
  engine's (torch tensors over the pool's numpy arrays: the model writes
  into the pool). On CUDA the pool's seal log and checksums are host code
  over a host view the VMM pool does not have, so a GPU engine keeps its
  cache to itself (engine-owned device memory, recomputed after a failover)
  until they are ported.
- **Python.** torch is not in our venv: like ``vllm`` engines, this one runs
  under the vLLM venv's python (``wire.engines.ENGINE_PYTHON``). Where torch
  is missing the module still imports, and making an engine says why not.

Engine arguments are the llama engine's.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.base import AdapterError
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.adapters.llama_backend import Cache, Forward
from understudy.engine_shim.adapters.packing import TensorRecord, pack_into, views_from
from understudy.engine_shim.adapters.torch_memory import copy_into, tensor_over
from understudy.engine_shim.kvpool import KvPool
from understudy.gms.client import Allocation, GmsClient

try:  # here, not in __init__: a spare imports its adapter, torch too, before its turn
    from understudy.engine_shim.adapters import llama_torch
except ImportError as exc:
    _NO_TORCH: str | None = str(exc)
else:
    _NO_TORCH = None

__all__ = ["TorchEngine"]


class TorchEngine(LlamaEngine):
    """The ``torch`` adapter (see the module)."""

    name = "torch"

    def __init__(
        self,
        model: str = tiny_llama.BUILTIN,
        engine_args: Sequence[str] = (),
        backend: str = "host",
    ) -> None:
        if _NO_TORCH is not None:
            raise AdapterError(
                f"no torch in {sys.executable} ({_NO_TORCH}): the torch engine runs under the "
                "vLLM venv's python (--engine-python / UNDERSTUDY_VLLM_PYTHON)"
            )
        super().__init__(model, engine_args)
        self.gpu = backend == "cuda"
        self.device = "cpu"
        if self.gpu:
            self.kv_spec = None  # the module docstring: no pool on CUDA yet

    def attach(self, sessions: Mapping[int, GmsClient]) -> None:
        self.device = f"cuda:{min(sessions)}" if self.gpu else "cpu"
        super().attach(sessions)

    def _pack(self, alloc: Allocation) -> list[TensorRecord]:
        if not self.gpu:
            return super()._pack(alloc)
        # A VMM allocation has no host view: pack on the host, one copy in.
        host = bytearray(alloc.requested)
        records = pack_into(memoryview(host), self.model_dir)
        copy_into(alloc, host, "cuda:0")  # load() writes device 0 only
        return records

    def _new_model(
        self, memory: Allocation | bytearray, records: Sequence[TensorRecord]
    ) -> Forward[Any]:
        lt = llama_torch
        if self.device == "cpu" or not isinstance(memory, Allocation):
            host = memory.view() if isinstance(memory, Allocation) else memory
            tensors = lt.host_tensors(views_from(host, records))
            # A private buffer on a GPU engine (tests) is copied there.
            tensors = {name: t.to(self.device) for name, t in tensors.items()}
        else:
            tensors = {
                r["name"]: lt.typed(tensor_over(memory, r["offset"], r["nbytes"], self.device), r)
                for r in records
            }
        model: Forward[Any] = lt.TorchModel(tensors, self.config, self.device)
        return model

    def _new_cache(self, slots: int, max_len: int, pool: KvPool | None = None) -> Cache:
        lt = llama_torch
        k = v = None
        if pool is not None:  # tensors over the pool's arrays: the model writes the pool
            k, v = lt.host_tensors({"k": pool.k, "v": pool.v}).values()
        cache: Cache = lt.TorchCache(self.config, slots, max_len, self.device, k, v)
        return cache
