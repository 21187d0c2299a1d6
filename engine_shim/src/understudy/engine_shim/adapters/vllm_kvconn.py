"""vLLM's KV connector for the GMS KV pool: the ``vllm`` engine's KV survives its engine.

vLLM's KV-connector interface (``KVConnectorBase_V1``, the extension point
LMCache and NIXL use) lets a plug-in fill a request's blocks before vLLM
computes them and see them after. We set it (``kv_transfer_config``) when
the engine is built; vLLM loads the class from this module by name and makes
two instances, a scheduler side and a worker side, both in this process (the
engine core runs in-process). The two share what they know through the
engine's :class:`Link`: vLLM builds them from its config alone, so the
engine names its link in ``kv_connector_extra_config`` (``transfer_config``)
and each side looks it up by that name when vLLM builds it. Both find the
pool there once the shim has mapped it at wake (``Link.attach``): until
then, on a standby, they do nothing.

- **Scheduler side**: ``vllm_kvplan.Planner`` claims a slot for a new request
  and tells vLLM how many positions past its own prefix-cache hit the pool
  holds; vLLM then allocates blocks for them and counts them as computed.
  Each step's plan (loads, saves) goes to the worker as the step's metadata.
- **Worker side**: before the forward pass, the loads copy pool positions
  into the blocks vLLM allocated, summing the claim's checksums as they copy
  (`vllm_kvmove`), and settle the claim: a block that failed is reported to
  vLLM as a load error (``get_block_ids_with_load_errors``), which has vLLM
  drop the step's output for that request and compute its positions from
  that block on (``kv_load_failure_policy=recompute``). After the forward
  pass (``wait_for_save``: every layer has written), the saves copy the
  positions the step computed into the pool, and the pool seals them in its
  log (``KvPool.seal``: hash chain, checksum, epoch); a request cut short
  this step saves nothing until vLLM has computed it again. A failover's
  next engine adopts the log, and a continuation's
  ``get_num_new_matched_tokens`` finds the dead engine's blocks.

Copies are position-exact (never a whole vLLM block past what a move
covers), so a sealed position's bytes never change under its seal. That
needs the layout of vLLM's cache: on CPU each layer's cache is ``[blocks,
kv_heads, block_size, 2 * head_dim]`` whose memory is the block's keys
(``block_size`` rows of ``head_dim``) then its values, per head (vLLM's
``cpu_attn`` reads it as exactly that view); on a GPU, FlashAttention's
``[2, blocks, block_size, kv_heads, head_dim]`` (UNVERIFIED: never run on a
GPU here; the engine does not ask for a pool there yet). Any other layout:
the connector stays off and says so.

vLLM and torch are imported inside the functions (they live in the vLLM
venv), so this module imports anywhere.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from understudy.engine_shim.adapters.vllm_kvmove import Mover, mover
from understudy.engine_shim.adapters.vllm_kvplan import Move, Planner, StepPlan
from understudy.engine_shim.adapters.vllm_kvpreload import Preload, Target
from understudy.engine_shim.kvlog import PoolSpec
from understudy.engine_shim.kvpool import BlockSums, KvPool, arena
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.engine_shim.vllm_kv")

CONNECTOR: Final = "UnderstudyKvPool"


LINK: Final = "understudy_link"  # the key of the engine's link in kv_connector_extra_config


def transfer_config(link: Link) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` that plugs the connector in, for the
    engine that owns ``link``: both of the connector's sides will use it."""
    _links[link.key] = link
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a block that fails its checksum (`Link.run`)
        "kv_connector_module_path": __name__,
        "kv_connector_extra_config": {LINK: link.key},
    }


def link_of(extra_config: Mapping[str, Any]) -> Link:
    """The link that ``transfer_config`` named in vLLM's ``kv_connector_extra_config``."""
    key = extra_config.get(LINK)
    link = _links.get(key) if isinstance(key, str) else None
    if link is None:
        raise ValueError(
            f"the {CONNECTOR} connector needs its engine's link: build vLLM's "
            f"kv_transfer_config with {__name__}.transfer_config (got {LINK}={key!r})"
        )
    return link


def __getattr__(name: str) -> Any:
    """vLLM looks the connector class up by name; it is built on first use,
    where vLLM is importable."""
    if name == CONNECTOR:
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _layer_order(name: str) -> tuple[int, ...]:
    return tuple(int(d) for d in re.findall(r"\d+", name))


class _Copier:
    """Position-exact copies between vLLM's paged cache and the pool's slots:
    ``mover``'s C moves where they take vLLM's caches (vLLM-CPU's float32
    layout), else torch's copies."""

    def __init__(self, pool: KvPool, caches: list[Any], mover: Mover | None = mover) -> None:
        import torch

        spec = pool.spec
        self.pool = pool
        if len(caches) != spec.layers:
            raise ValueError(f"vLLM has {len(caches)} KV layers; the pool {spec.layers}")
        dtype = getattr(torch, spec.dtype)
        self.k = torch.from_numpy(pool.k).view(dtype)
        self.v = torch.from_numpy(pool.v).view(dtype)
        # Loads read through the pool's read-only view where there is one
        # (kvpool): torch warns of a tensor over read-only memory; only
        # copy_ from it is done here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.rk = torch.from_numpy(pool.rk).view(dtype)
            self.rv = torch.from_numpy(pool.rv).view(dtype)
        self.layers = [kv_views(c, spec.kv_heads, spec.head_dim) for c in caches]
        if any(k.dtype != dtype for k, _ in self.layers):
            raise ValueError(f"vLLM's KV cache is {caches[0].dtype}; the pool {spec.dtype}")
        self.block_size = int(self.layers[0][0].shape[2])
        self.moves = CMoves.of(caches, spec, mover)
        self.mover = None if self.moves is None else mover

    def _runs(self, m: Move) -> list[tuple[int, int, int, int]]:
        """``m``'s positions as runs: (first vLLM block id, offset in it, pool
        position, length). Whole blocks with consecutive ids (what a fresh
        engine's allocator hands out) make one run, so a 4,000-position load
        is a few large copies per layer, which torch runs on every core, not
        one per block; a block covered in part is a run of its own."""
        bs, out, p = self.block_size, [], m.start
        while p < m.end:
            j, off = divmod(p, bs)
            n = 1
            if off == 0:
                while (
                    p + (n + 1) * bs <= m.end
                    and j + n < len(m.block_ids)
                    and m.block_ids[j + n] == m.block_ids[j] + n
                ):
                    n += 1
            length = n * bs if off == 0 and p + n * bs <= m.end else min(bs - off, m.end - p)
            out.append((m.block_ids[j], off, p, length))
            p += length
        return out

    def _pair(
        self, layer: int, slot: int, run: tuple[int, int, int, int], into_pool: bool
    ) -> list[Any]:
        """(vLLM's side, the pool's side) of ``run`` for keys, then for values,
        each shaped ``[blocks, head, offset, dim]``; the pool's side is its
        read view for a load."""
        first, off, p, length = run
        out = []
        arrays = (self.k, self.v) if into_pool else (self.rk, self.rv)
        for ours, theirs in zip(arrays, self.layers[layer], strict=True):
            pool = ours[layer, slot, :, p : p + length]  # [head, position, dim]
            if off == 0 and length % self.block_size == 0:  # whole blocks
                n = length // self.block_size
                out.append((theirs[first : first + n], pool.unflatten(1, (n, -1)).transpose(0, 1)))
            else:
                out.append((theirs[first : first + 1, :, off : off + length], pool.unsqueeze(0)))
        return out

    def load(self, m: Move, sums: BlockSums | None = None) -> None:
        """``sums``: the C moves' only (`sums_as_it_loads`)."""
        self._copy(m, into_pool=False, sums=sums)

    def save(self, m: Move) -> None:
        self._copy(m, into_pool=True)

    def sums_as_it_loads(self, m: Move) -> BlockSums | None:
        """What ``load(m)`` sums its claim's checksums into as it copies, or
        None where it cannot: torch's copies, or a load that does not cover
        the claim's blocks from position 0 (vLLM's own cache held a prefix,
        or vLLM took fewer positions than the claim gave)."""
        checking = m.checking
        if self.mover is None or checking is None or m.start != 0:
            return None
        sums = self.pool.block_sums(checking)
        return sums if sums.total.size * self.pool.spec.block_tokens <= m.end else None

    def _copy(self, m: Move, *, into_pool: bool, sums: BlockSums | None = None) -> None:
        if self.moves is not None:
            pool = self.pool
            k, v = (pool.k, pool.v) if into_pool else (pool.rk, pool.rv)
            self.moves.move(k, v, m, into_pool=into_pool, sums=sums)
            return
        if sums is not None:
            raise ValueError("torch's copies sum no checksums")
        runs = self._runs(m)
        for layer in range(len(self.layers)):
            for run in runs:
                for theirs, pool in self._pair(layer, m.slot, run, into_pool):
                    if into_pool:
                        pool.copy_(theirs)
                    else:
                        theirs.copy_(pool)


@dataclass(frozen=True, slots=True)
class CMoves:
    """``mover``'s C moves over vLLM-CPU's caches (float32, contiguous,
    ``[blocks, kv_heads, block_size, 2 * head_dim]``)."""

    mover: Mover
    addresses: npt.NDArray[np.uintp]  # each layer's cache
    blocks: int
    block_size: int

    @classmethod
    def of(cls, caches: list[Any], spec: PoolSpec, mover: Mover | None = mover) -> CMoves | None:
        """The moves over ``caches``, or None where they do not take them
        (torch's copies then)."""
        import torch

        first = caches[0]
        layout = (first.shape[0], spec.kv_heads, first.shape[2], 2 * spec.head_dim)
        if mover is None or not all(
            c.dtype == torch.float32
            and c.device.type == "cpu"
            and c.is_contiguous()
            and tuple(c.shape) == layout
            for c in caches
        ):
            return None
        addresses = np.array([c.data_ptr() for c in caches], dtype=np.uintp)
        return cls(mover, addresses, int(first.shape[0]), int(first.shape[2]))

    def move(
        self,
        k: npt.NDArray[Any],
        v: npt.NDArray[Any],
        m: Move,
        *,
        into_pool: bool,
        sums: BlockSums | None = None,
    ) -> None:
        """``m`` between the pool's arena ``k``, ``v`` and vLLM's caches."""
        self.mover.move(
            k[:, m.slot], v[:, m.slot], self.addresses, self.blocks, self.block_size,
            m.block_ids, m.start, m.end, into_pool=into_pool, sums=sums,
        )  # fmt: skip

    def loads_from(self, view: memoryview, spec: PoolSpec) -> Callable[[Move, BlockSums], None]:
        """Loads from ``view`` (a standby's read-only mapping of the pool, laid
        out by ``spec``) into vLLM's caches, summing as they copy."""
        k, v = arena(view, spec)
        return lambda m, sums: self.move(k, v, m, into_pool=False, sums=sums)


def kv_views(cache: Any, heads: int, head_dim: int) -> tuple[Any, Any]:
    """Keys and values of one layer's cache as ``[block, head, offset, dim]`` views."""
    shape = tuple(cache.shape)
    if len(shape) == 4 and shape[1] == heads and shape[3] == 2 * head_dim:  # vLLM-CPU
        # Per block and head: the keys transposed (head_dim rows of
        # block_size positions), then the values (block_size rows of head_dim):
        # what vLLM-CPU's cache kernel writes for its "vec" ISA, which
        # `check_cpu_layout` proves on this machine before the pool is used.
        blocks, _, bs, _ = shape
        halves = cache.view(blocks, heads, 2, bs * head_dim)
        keys = halves[:, :, 0].unflatten(-1, (head_dim, bs)).transpose(-1, -2)
        return keys, halves[:, :, 1].unflatten(-1, (bs, head_dim))
    if len(shape) == 5 and shape[0] == 2 and shape[3:] == (heads, head_dim):  # FlashAttention
        return cache[0].transpose(1, 2), cache[1].transpose(1, 2)  # UNVERIFIED on a GPU
    raise ValueError(f"a KV cache of shape {list(shape)} is not a layout the pool knows")


def check_cpu_layout(cache: Any, heads: int, head_dim: int) -> None:
    """Write known keys and values with vLLM-CPU's own cache kernel, for this
    machine's ISA, into a scratch cache shaped like ``cache``, and check that
    `kv_views` reads every one back where it belongs (ValueError if not)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    bs = int(cache.shape[2])
    scratch = torch.zeros((3, heads, bs, 2 * head_dim), dtype=cache.dtype)
    halves = scratch.view(3, heads, 2 * bs, head_dim)
    key_cache, value_cache = halves.chunk(2, dim=2)
    n = bs + 3  # across a block boundary, out of order
    slots = torch.tensor([(2 * bs + i) if i < bs else i - bs for i in range(n)], dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn((n, heads, head_dim), generator=gen).to(cache.dtype)
    value = torch.randn((n, heads, head_dim), generator=gen).to(cache.dtype)
    isa = _get_attn_isa(cache.dtype, bs, head_dim)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    keys, values = kv_views(scratch, heads, head_dim)
    blocks, offsets = slots // bs, slots % bs
    read = keys[blocks, :, offsets], values[blocks, :, offsets]
    if not (torch.equal(read[0], key) and torch.equal(read[1], value)):
        raise ValueError(f"vLLM-CPU's KV cache layout for ISA {isa!r} is not one the pool knows")


class Scheduling:
    """The connector's scheduler side over a planner (None: no pool, on a
    standby): vLLM's requests in, a `StepPlan` per step out."""

    def __init__(self, planner: Planner | None = None) -> None:
        self.planner = planner
        self.requests: dict[str, Any] = {}  # vLLM's Request objects with a slot
        self.preload: Preload | None = None  # until the first step after the wake

    def matched(self, request: Any, computed: int) -> int:
        planner = self.planner
        if planner is None:
            return 0
        rid = request.request_id
        found, _ = planner.matched(rid, list(request.all_token_ids), computed)
        if planner.holds(rid) is not None:
            self.requests[rid] = request
        return found

    def allocated(self, request: Any, external: int) -> None:
        if self.planner is not None:
            self.planner.allocated(request.request_id, external)

    def plan(self, scheduler_output: Any, manager: Any) -> StepPlan:
        # Before this step's forward pass writes any block: the load ahead ends.
        preload, self.preload = self.preload, None
        ready = preload.finish() if preload is not None else None
        planner = self.planner
        if planner is None or manager is None:
            return StepPlan()
        scheduled = []
        for rid, count in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is not None:  # computed: before this step (vLLM advances it after)
                blocks = manager.get_block_ids(rid)[0]
                ids = request.all_token_ids
                scheduled.append((rid, request.num_computed_tokens, count, blocks, ids))
        return planner.step(scheduled, ready)

    def finished(self, request: Any) -> None:
        self.requests.pop(request.request_id, None)
        if self.planner is not None:
            self.planner.finished(request.request_id)


@dataclass(slots=True, weakref_slot=True)
class Link:
    """What one engine shares with its connector's two sides: vLLM's caches
    (the worker side registers them at start-up), and the pool with its
    planner and copier (the engine attaches them at wake)."""

    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # its name in vLLM's config
    caches: list[Any] | None = None  # vLLM's per-layer KV tensors, in layer order
    unreadable: str | None = None  # why vLLM's caches are not kept (their layout)
    copier: _Copier | None = None
    scheduling: Scheduling = field(default_factory=Scheduling)
    invalid: set[int] = field(default_factory=set)  # vLLM blocks loaded and then found bad
    cut: frozenset[str] = frozenset()  # requests whose saves this step are dropped

    @property
    def planner(self) -> Planner | None:
        return self.scheduling.planner

    def attach(self, pool: KvPool) -> bool:
        """The pool the shim mapped for this engine (at wake): from now on the
        connector claims, loads and saves. False: it cannot copy between
        vLLM's cache and the pool (vLLM registered no cache, or one whose
        layout the pool does not know), so it stays off and the engine
        recomputes, as without a pool; it must never offer vLLM positions it
        cannot load."""
        self.detach()
        try:
            if self.caches is None:
                raise ValueError(
                    self.unreadable or "vLLM registered no KV cache with the connector"
                )
            copier = _Copier(pool, self.caches)
        except ValueError as exc:
            log_event(log, "kv_pool_off", logging.ERROR, reason=exc)
            return False
        self.copier, self.scheduling = copier, Scheduling(Planner(pool, pool.spec.max_len))
        return True

    def detach(self) -> None:
        """No pool (asleep, or closed): both sides do nothing until the next attach."""
        if self.scheduling.preload is not None:  # its copies end before the cache is released
            self.scheduling.preload.finish(complete=False)
        self.copier, self.scheduling = None, Scheduling()
        self.invalid, self.cut = set(), frozenset()

    def preload(self, targets: list[Target], after: threading.Thread | None = None) -> None:
        """Load ``targets`` ahead (`vllm_kvpreload`), where the C moves copy
        and sum: torch's copies sum nothing, and their claims' checks run
        on a thread of their own already."""
        copier, planner = self.copier, self.planner
        if copier is None or copier.mover is None or planner is None or not targets:
            return
        pool = planner.pool
        self.scheduling.preload = Preload(
            targets, copier.load, pool.sums_of_blocks, pool.spec.block_tokens, after
        )

    def register(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's KV tensors, one per attention layer, in the model's layer order,
        when vLLM builds the engine (start-up, not a failover's path). Their
        layout is proven here, once: a cache the pool cannot read is never kept,
        so the connector stays off."""
        caches = [kv_caches[n] for n in sorted(kv_caches, key=_layer_order)]
        self.caches, self.unreadable = None, None
        first = caches[0] if caches else None
        try:
            if first is not None and first.device.type == "cpu" and first.dim() == 4:
                check_cpu_layout(first, int(first.shape[1]), int(first.shape[3]) // 2)
        except Exception as exc:  # a vLLM without the kernel we prove it with, too
            self.unreadable = f"{type(exc).__name__}: {exc}"
            log_event(log, "kv_layout_unknown", logging.ERROR, reason=self.unreadable)
            return
        self.caches = caches

    def run(self, plan: StepPlan | None, *, save: bool) -> None:
        """The worker side's copies of one step: its loads before the forward
        pass, its saves (each sealed in the pool's log) after it."""
        copier, planner = self.copier, self.planner
        if plan is None or copier is None or planner is None:
            return
        if save:
            for m in plan.saves:
                if m.req_id not in self.cut:
                    copier.save(m)
                    planner.pool.seal(m.slot, m.tokens, m.start, m.end)
            self.cut = frozenset()
            return
        cut = set()
        for m in plan.loads:
            t0 = time.monotonic()
            if m.ready:  # loaded ahead: the rest only, its sums from then
                if m.end > m.start + m.ready:
                    copier.load(replace(m, start=m.start + m.ready, ready=0, checking=None))
                total = m.sums
            else:
                sums = copier.sums_as_it_loads(m)
                copier.load(m, sums)
                total = None if sums is None else sums.total
            if m.checking is not None:  # the claim's checksums: summed, or read now
                pool = planner.pool
                pool.settle(m.checking, total)
                trusted = pool.confirm(m.checking)
                if trusted < m.checking.start:  # vLLM computes again from the bad block
                    planner.cut(m.req_id, trusted)
                    cut.add(m.req_id)
                    bs = copier.block_size
                    self.invalid.update(m.block_ids[max(trusted, m.start) // bs : -(-m.end // bs)])
            log_event(
                log, "kv_loaded", req=m.req_id, positions=m.end - m.start,
                seconds=round(time.monotonic() - t0, 4),
                by="c" if copier.mover is not None else "torch",
                summed=total is not None,  # the claim's checksums, as it copied
                ahead=m.ready,  # positions loaded ahead, at wake
            )  # fmt: skip
        self.cut = frozenset(cut)

    def load_errors(self) -> set[int]:
        """vLLM's blocks loaded this step from positions that failed their
        checksums (then forgotten: vLLM asks once per step)."""
        out, self.invalid = self.invalid, set()
        return out


# The engines' links by key, for the connector sides vLLM builds from its config
# alone; weak, so that a closed engine's link (its caches) goes with the engine.
_links: weakref.WeakValueDictionary[str, Link] = weakref.WeakValueDictionary()


class _Hooks:
    """vLLM's hooks, each handed to the code above (mixed into vLLM's base
    class by ``_connector_class``). The step's metadata is the `StepPlan`
    itself: vLLM passes it from the scheduler to the worker untouched."""

    if TYPE_CHECKING:  # vLLM's base class provides these, and __init__ the link
        _kv_cache_manager: Any
        link: Link

        def has_connector_metadata(self) -> bool: ...
        def _get_connector_metadata(self) -> Any: ...

    def _plan(self) -> StepPlan | None:
        return self._get_connector_metadata() if self.has_connector_metadata() else None

    # --- worker side: vLLM's cache <-> the pool ------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.link.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.link.run(self._plan(), save=False)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer already

    def save_kv_layer(self, layer: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # saved in wait_for_save, once every layer has written

    def wait_for_save(self) -> None:
        self.link.run(self._plan(), save=True)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.link.load_errors()

    # --- scheduler side: the plan ----------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, computed: int) -> tuple[int, bool]:
        return self.link.scheduling.matched(request, computed), False

    def update_state_after_alloc(self, request: Any, blocks: Any, external: int) -> None:
        self.link.scheduling.allocated(request, external)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        return self.link.scheduling.plan(scheduler_output, self._kv_cache_manager)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        self.link.scheduling.finished(request)
        return False, None


def _connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self.link = link_of(vllm_config.kv_transfer_config.kv_connector_extra_config)

    namespace = {"__module__": __name__, "__init__": __init__}
    return type(CONNECTOR, (_Hooks, KVConnectorBase_V1), namespace)
