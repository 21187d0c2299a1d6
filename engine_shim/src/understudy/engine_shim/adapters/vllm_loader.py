"""The vLLM model-loader plugin: vLLM's parameters live in GMS.

Registered through the ``vllm.general_plugins`` entry point (engine_shim's
pyproject), which vLLM runs in every one of its processes; the adapter
selects it with ``load_format="understudy"``. vLLM builds the model as usual
(``initialize_model``) and hands it to ``load_weights``; then, according to
the `LoaderContext` the adapter set for this process:

- **publish** (the GMS writer): load the checkpoint with vLLM's own default
  loader (so its name mapping and the fusing of q/k/v and gate/up apply),
  copy every parameter, as vLLM holds it, into one GMS allocation, rebind
  the parameter to that memory and describe the layout in GMS metadata; the
  shim commits;
- **map** (any engine after the commit, every shadow): rebind every
  parameter to its place in the mapped, read-only GMS memory. The checkpoint
  is never read.

What vLLM then does in ``process_weights_after_loading`` is its own: on CPU
its oneDNN GEMM repacks the linear layers' weights into buffers of the
engine (working memory, gone with the process); on a GPU unquantized weights
are used in place (UNVERIFIED: see ``vllm``).

Everything here needs torch and vLLM, which live only in the vLLM venv
(``hack/vllm/venv``): they are imported inside the functions, so the module
itself imports anywhere.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from understudy.engine_shim.adapters import torch_memory
from understudy.gms.client import Allocation, GmsClient

LOAD_FORMAT: Final = "understudy"
META_KEY: Final = "vllm"
ALIGN: Final = 256  # bytes: any dtype's alignment, and a GPU's access granularity


class LoaderError(RuntimeError):
    """GMS holds no layout this model can map, or the loader has no context."""


@dataclass
class LoaderContext:
    """What the adapter tells the loader before it builds an engine."""

    session: GmsClient
    publish: bool
    layout_key: str  # what a mapped layout must have been published for
    device: str = "cpu"  # torch device of the GMS memory ("cpu" or "cuda:N")
    published: dict[str, Any] = field(default_factory=dict)  # filled by publish


class _State:
    """The process's loader state: vLLM instantiates the loader class itself,
    so what it must know comes through here."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.context: LoaderContext | None = None
        self.registered = False


_state = _State()


@contextmanager
def context(ctx: LoaderContext) -> Iterator[LoaderContext]:
    """Make ``ctx`` the loader's for the engine built inside the block."""
    with _state.lock:
        if _state.context is not None:
            raise LoaderError("another engine is being built in this process")
        _state.context = ctx
    try:
        yield ctx
    finally:
        with _state.lock:
            _state.context = None


def layout_key(model_dir: Path, dtype: str, vllm_version: str) -> str:
    """The parameters' layout depends on the model's config, the dtype and
    vLLM's own modelling code (its version)."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    h.update(json.dumps([dtype, vllm_version]).encode())
    return h.hexdigest()


def _tensor(alloc: Allocation, offset: int, nbytes: int, device: str) -> Any:
    """A uint8 tensor over ``nbytes`` of GMS memory at ``offset`` (no copy; on
    a GPU through the CUDA array interface, UNVERIFIED: see ``vllm``)."""
    return torch_memory.tensor_over(alloc, offset, nbytes, device)


def _view(raw: Any, dtype: Any, shape: list[int]) -> Any:
    return raw.view(dtype).view(shape)


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise LoaderError(f"unknown dtype {name!r} in GMS metadata")
    return dtype


def publish(model: Any, ctx: LoaderContext) -> dict[str, Any]:
    """Copy every parameter of ``model`` into one GMS allocation and rebind it there."""
    params = list(model.named_parameters())
    records = []
    offset = 0
    for name, p in params:
        nbytes = p.numel() * p.element_size()
        records.append([name, offset, list(p.shape), str(p.dtype), nbytes])
        offset += -(-nbytes // ALIGN) * ALIGN
    alloc = ctx.session.allocate(max(offset, ALIGN))
    for (_, p), (_, off, shape, _, nbytes) in zip(params, records, strict=True):
        dst = _view(_tensor(alloc, off, nbytes, ctx.device), p.dtype, shape)
        dst.copy_(p.data)
        p.data = dst
    meta = {"layout_key": ctx.layout_key, "allocation": alloc.id, "params": records}
    ctx.session.put_metadata(META_KEY, meta)
    return meta


def check_layout(meta: Mapping[str, Any] | None, key: str) -> None:
    if meta is None:
        raise LoaderError(f"GMS has no {META_KEY!r} metadata: no vLLM layout was published")
    if meta.get("layout_key") != key:
        raise LoaderError("GMS holds parameters published for another model, dtype or vLLM version")


def map_into(model: Any, ctx: LoaderContext) -> int:
    """Rebind every parameter of ``model`` to its published GMS memory; bytes mapped."""
    meta = ctx.session.metadata().get(META_KEY)
    check_layout(meta, ctx.layout_key)
    assert meta is not None
    alloc = next((a for a in ctx.session.allocations if a.id == meta["allocation"]), None)
    if alloc is None:
        raise LoaderError(f"metadata points at allocation {meta['allocation']}, not in GMS")
    records = {r[0]: r for r in meta["params"]}
    params = dict(model.named_parameters())
    if set(records) != set(params):
        missing = sorted(set(params) - set(records))[:3]
        extra = sorted(set(records) - set(params))[:3]
        raise LoaderError(f"GMS layout does not fit the model: missing {missing}, extra {extra}")
    total = 0
    for name, p in params.items():
        _, off, shape, dtype, nbytes = records[name]
        if list(p.shape) != shape or str(p.dtype) != dtype:
            raise LoaderError(f"{name}: GMS has {dtype}{shape}, the model {p.dtype}{list(p.shape)}")
        p.data = _view(_tensor(alloc, off, nbytes, ctx.device), _dtype(dtype), shape)
        total += nbytes
    return total


def _loader_class() -> type:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class UnderstudyModelLoader(BaseModelLoader):  # type: ignore[misc]
        """``load_format="understudy"``: parameters in GMS (see the module)."""

        def download_model(self, model_config: Any) -> None:
            pass  # publish reads a local checkpoint; map reads none

        def load_weights(self, model: Any, model_config: Any) -> None:
            ctx = _state.context
            if ctx is None:
                raise LoaderError(
                    f"load_format={LOAD_FORMAT!r} loads only inside an understudy engine "
                    "(`understudy engine run` with the vllm adapter)"
                )
            if ctx.publish:
                config = copy.copy(self.load_config)
                config.load_format = "auto"
                DefaultModelLoader(config).load_weights(model, model_config)
                ctx.published = publish(model, ctx)
            else:
                map_into(model, ctx)

    return UnderstudyModelLoader


def register() -> None:
    """The ``vllm.general_plugins`` entry point (runs once per vLLM process)."""
    if _state.registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())
    _state.registered = True
