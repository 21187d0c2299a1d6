"""The ``llama`` engine: a numpy Llama decoder over weights in GMS, with its own KV cache.

Weights follow the reference engine's pattern: the writer (``load``) packs
the checkpoint's safetensors into one GMS allocation on device 0 and records
every tensor in GMS metadata; ``attach`` builds the model over read-only
views of that memory (never a copy), for the writer and for readers alike.
``attach`` also runs the model once (a warm-up); ``wake`` allocates the KV
cache — engine-owned numpy arrays, never GMS memory, so the process's death
frees them — and starts the batching worker; ``sleep`` stops the worker and drops the cache before
the shim puts the weights to sleep.

The engine is a ``generation.Generator``, served by ``openai_api``.
`Batcher` runs continuous batching on one worker thread: every iteration
admits waiting requests into free cache slots (a prefill each, which yields
their first token), samples the next token of every running sequence, and
appends all of those tokens in one `LlamaModel.decode` call. A request that
continues a migrated stream (``resume``) is prefilled with its prompt only;
its resumed ids go through ``decode`` as the first engine's did, which keeps
the continuation identical (see `llama_model`). Tokens reach the asyncio
side through ``loop.call_soon_threadsafe`` into one queue per request.
"""

from __future__ import annotations

import argparse
import collections
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt
from aiohttp import web

from understudy.engine_shim import kvlog, memadvise, openai_api
from understudy.engine_shim.adapters import models, tiny_llama
from understudy.engine_shim.adapters.base import AdapterError, Engine, KvPoolRequest, UsesKvPool
from understudy.engine_shim.adapters.llama_backend import Cache, Forward
from understudy.engine_shim.adapters.llama_model import (
    KVCache,
    LlamaConfig,
    LlamaModel,
    Prompt,
    Row,
    config_digest,
    sample,
)
from understudy.engine_shim.adapters.llama_text import ChatTokenizer
from understudy.engine_shim.adapters.model_cache import cache_dir
from understudy.engine_shim.adapters.packing import (
    WEIGHTS_FILE,
    TensorRecord,
    WeightsError,
    pack_into,
    packed_size,
    views_from,
)
from understudy.engine_shim.generation import (
    Generator,
    NotServing,
    SamplingParams,
    Step,
    finish_of,
)
from understudy.engine_shim.kvlog import PoolSpec
from understudy.engine_shim.kvpool import BlockSums, Checking, KvPool
from understudy.engine_shim.step_thread import StepThread, send
from understudy.gms.client import Allocation, GmsClient
from understudy.wire.obs import log_event

__all__ = ["Batcher", "LlamaEngine", "NotServing", "Request"]

log = logging.getLogger("understudy.engine_shim.llama")

META_KEY: Final = "llama"
DEFAULT_MAX_NUM_SEQS: Final = 8
STUCK_AFTER_S: Final = 30.0  # one worker iteration longer than this: unhealthy
# Prompt positions computed per iteration, one request at least (a claim's
# adopted positions and the resumed ids, which go through decode, are free):
# vLLM's max_num_batched_tokens in spirit. Eight requests that arrive at once
# (a failover hands the next engine every stream in flight) are prefilled over
# several iterations, between decode steps, instead of in one long iteration:
# the running streams keep flowing, and no iteration of a real model on a
# busy CPU outlives STUCK_AFTER_S (whose liveness verdict would kill it).
PREFILL_BUDGET: Final = 256
# Rows (tokens) through decode per iteration. A continued stream feeds the
# ids an earlier engine already sent through decode, one row each (as the
# first engine computed them); a failover hands the next engine every stream
# at once, hundreds of rows. The running streams' next tokens go first, the
# feeds take what is left, over as many iterations as they need: rows are
# independent of each other, so the split changes no number.
DECODE_BUDGET: Final = 32
STOP_TIMEOUT_S: Final = 60.0
# Prompts run in chunks on a fixed grid (`chunks`) whose first chunk is this
# (a multiple of the KV pool's block size), 256 positions wide from position
# 256 on: a continuation that reuses blocks recomputes the same chunks, so the
# same bits. 64 positions ran as fast as one batch on a loaded machine (8.2 s
# against 10.5 s for 512 positions of smollm2-135m) and 16 took 3x longer; on
# an idle one with AVX-512 kernels, 1,024 positions took 2.6 s in chunks of
# 64 and 1.7 s on the grid.
PREFILL_CHUNK: Final = 64
# The warm-up's prompt: one whole chunk and then some, so it runs the matrix
# kernels a real prompt runs (OpenBLAS gives products of a few rows other
# kernels than products of a chunk's rows, and the first call of each pays
# its set-up). In process, SmolLM2, load 3-4: warmed with 3 positions, the
# first continuation (16 + 8 positions) after a wake took 0.7-1.3 s and the
# next 0.35 s; warmed with a chunk, the first took 0.42-0.64 s. (At load 11
# the two could not be told apart.)
WARMUP_LEN: Final = PREFILL_CHUNK + 8

F32 = npt.NDArray[np.float32]
Deliver = Callable[[Step | BaseException], None]


@dataclass(eq=False, slots=True)
class Request:
    """One generation, as the worker tracks it (fields below ``deliver``: worker-only)."""

    prompt: tuple[int, ...]
    resume: tuple[int, ...]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    deliver: Deliver
    cancelled: bool = False
    slot: int = -1
    generated: int = 0  # ids generated so far, the resumed ones included
    position: int = 0  # the next cache position to fill
    feed: list[int] = field(default_factory=list)  # ids to append before sampling
    logits: F32 | None = None  # ready to sample from
    ids: list[int] = field(default_factory=list)  # the ids at cache positions 0..position-1
    checking: Checking | None = None  # its claim's checksums, until confirmed


class Batcher(StepThread[Request]):
    """Continuous batching of `Request`s over a model and its cache, on one thread
    (``steps``: decode calls so far)."""

    def __init__(
        self, model: Forward[Any], cache: Cache, max_model_len: int, pool: KvPool | None = None
    ) -> None:
        super().__init__("llama-batcher")
        self.model = model
        self.cache = cache
        self.pool = pool  # the cache lives in GMS's KV pool: claim slots, seal blocks
        self.max_model_len = min(max_model_len, cache.max_len)
        self._running: list[Request] = []
        self._free = list(range(cache.slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._redo: list[Request] = []  # back to a prompt chunk: a claim did not hold

    # --- the caller's side ------------------------------------------------------

    def cancel(self, request: Request) -> None:
        """The consumer has gone: free the request's slot at the next iteration."""
        with self._cond:
            request.cancelled = True
            self._cond.notify()

    def stop(self, reason: str = "the engine stopped", timeout: float = STOP_TIMEOUT_S) -> None:
        super().stop(reason, timeout)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._cond:
            return len(self._running), len(self._waiting)

    # --- the worker ---------------------------------------------------------------

    def _take_running(self) -> list[Request]:
        running, self._running = self._running, []
        return running

    def _iteration(self) -> bool:
        with self._cond:
            while not (self._stopping or self._waiting or self._running):
                self._cond.wait()
            if not self._running:
                self._gather()  # step_thread.ADMIT_QUIET_S
            if self._stopping:
                return False
            self._drop(r for r in self._running if r.cancelled)
            admitted = self._admit()
            self._running.extend(admitted)
            running = list(self._running)
        self.busy_since = time.monotonic()
        try:
            # A request that needs no prompt computed (a continuation whose
            # adopted KV covers its prompt) joins this step's decode, and the
            # step's tokens go out before the prompts are computed (in one
            # batch): the running streams' next tokens, a failover's
            # continuations among them, never wait for new requests'
            # prefills. A prompt prefilled in the last iteration has its first
            # token sampled first, and joins the step.
            redo, self._redo = self._redo, []
            cold = [r for r in (*redo, *admitted) if r.position < len(r.prompt) and not r.cancelled]
            for req in admitted:
                if req.position >= len(req.prompt):
                    self._resume(req)
            self._sample_ready(running)
            self._decode([r for r in running if r.feed and not r.cancelled])
            self._sample_ready(running)
            self._prefill(cold)
        finally:
            self.busy_since = None
        return True

    def _admit(self) -> list[Request]:
        """Waiting requests to start this iteration (the caller holds the lock),
        each with its slot claimed: while slots are free and the prompt
        positions to compute stay within PREFILL_BUDGET (one request at
        least). A continuation whose claim adopted its prompt computes none,
        so a failover's continuations all start in the first iteration."""
        admitted: list[Request] = []
        budget = PREFILL_BUDGET
        # Continued streams first, as vLLM puts a preempted request back at the
        # head of its queue: their claims take their own slots before a new
        # request can. (A new request that reuses nothing takes the slot that
        # loses least, and after a failover that was at times a continuation's
        # slot: 15 positions held, against 36 and more in the others.)
        if any(r.resume for r in self._waiting):
            self._waiting = collections.deque(sorted(self._waiting, key=lambda r: not r.resume))
        while self._waiting and self._free and (budget > 0 or not admitted):
            req = self._waiting.popleft()
            if req.cancelled:
                continue
            self._take_slot(req)
            admitted.append(req)
            budget -= max(0, len(req.prompt) - req.position)
        return admitted

    def _drop(self, requests: Any) -> None:
        with self._cond:
            for req in list(requests):
                if req in self._running:
                    self._running.remove(req)
                    self._free.append(req.slot)

    def _take_slot(self, req: Request) -> None:
        """A free slot for ``req``. With the KV pool, the one whose sealed blocks
        hold the longest prefix of its ids (an inherited cache, or a prefix this
        engine computed before); its computing starts after them."""
        if self.pool is None:
            req.slot = self._free.pop()
            return
        tokens = req.prompt + req.resume
        in_step = self.model.sums_blocks(self.pool.spec.block_tokens)
        claim = self.pool.claim(
            tokens, self._free, len(req.prompt), PREFILL_CHUNK, defer=True, in_step=in_step
        )
        self._free.remove(claim.slot)
        req.slot, req.position, req.checking = claim.slot, claim.start, claim.checking

    def _holds(self, req: Request) -> bool:
        """Whether the KV that ``req``'s claim reused holds (its checksums,
        computed on a thread since the claim, waited for here: after the
        first step computed on them, before its results are sampled or
        sealed). If not, ``req`` goes back to where they hold, in its slot:
        its prompt's chunk to prefill again, or its resumed ids to feed."""
        checking, req.checking = req.checking, None
        if checking is None or self.pool is None:
            return True
        start = self.pool.confirm(checking)
        if start == checking.start:
            return True
        ids = req.prompt + req.resume
        req.position, req.ids, req.logits = start, list(ids[:start]), None
        if start < len(req.prompt):  # the next prefill computes its chunks
            req.feed = []
            self._redo.append(req)
        else:  # the next decode feeds the ids again
            req.feed = list(ids[start:])
        return False

    def _prefill(self, requests: Sequence[Request]) -> None:
        """Fill the caches with the prompts (after what claims reused), in one
        batch, then hand each one's resumed ids to ``decode``, as the first
        engine fed them."""
        if not requests:
            return
        prompts = [Prompt(r.prompt, r.slot, r.position) for r in requests]
        logits = self.model.prefill_batch(prompts, self.cache, PREFILL_CHUNK, self._progress)
        for req, p, out in zip(requests, prompts, logits, strict=True):
            if not self._holds(req):
                continue
            req.position, req.feed = len(req.prompt), list(req.resume)
            self._started(req, p.start, out)

    def _resume(self, req: Request) -> None:
        """A claim whose reused blocks reach into the resumed ids: the rest of
        them go to ``decode``."""
        req.feed = list(req.resume[req.position - len(req.prompt) :])
        self._started(req, req.position, None)

    def _started(self, req: Request, before: int, logits: F32 | None) -> None:
        req.ids = list(req.prompt + req.resume)[: req.position]
        self._seal(req, before)
        req.generated = len(req.resume)
        if not req.feed:
            req.logits = logits

    def _progress(self) -> None:
        """A chunk of a long prompt is done: the worker is busy, not stuck."""
        self.busy_since = time.monotonic()

    def _seal(self, req: Request, before: int) -> None:
        if self.pool is not None:
            self.pool.seal(req.slot, req.ids, before, req.position)

    def _sample_ready(self, requests: Sequence[Request]) -> None:
        for req in requests:
            if req.logits is not None and not req.cancelled:
                self._sample(req)

    def _sample(self, req: Request) -> None:
        """Pick the next token and deliver it. A finished request leaves its slot
        before its consumer hears of the end."""
        assert req.logits is not None
        p = req.params
        token = sample(req.logits, p.temperature, p.top_p, req.seed, req.generated)
        req.logits = None
        req.generated += 1
        reason: str | None = None
        if token in req.stop_ids:
            reason = "stop"
        elif req.generated >= p.max_tokens or len(req.prompt) + req.generated >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._drop([req])
        else:
            req.feed = [token]
        send(req, Step(token, reason))

    def _sums_in_step(
        self, firsts: Sequence[tuple[Request, int]]
    ) -> dict[int, tuple[Checking, BlockSums]]:
        """By row: the claims whose checksums this step sums as that row's
        attention reads their blocks (a continuation's first step; `KvPool.claim`'s
        ``in_step``), and what it sums them into."""
        if self.pool is None:
            return {}
        return {
            row: (req.checking, self.pool.block_sums(req.checking))
            for req, row in firsts
            if req.checking is not None and req.checking.in_step
        }

    def _decode(self, requests: Sequence[Request]) -> None:
        rows: list[Row] = []
        done: list[tuple[Request, int]] = []  # fed completely: its logits' row
        fed: list[tuple[Request, int]] = []  # fed this step, from which position
        budget = max(DECODE_BUDGET, self.cache.slots)
        firsts: list[tuple[Request, int]] = []  # each request's first row this step
        # One-token feeds (streams generating) first, then the resumed ids.
        for req in sorted(requests, key=lambda r: len(r.feed) > 1):
            take = req.feed[:budget]
            if not take:
                break
            firsts.append((req, len(rows)))
            rows.extend(Row(req.slot, req.position + i, t) for i, t in enumerate(take))
            fed.append((req, req.position))
            req.position += len(take)
            req.ids += take
            req.feed = req.feed[len(take) :]
            budget -= len(take)
            if not req.feed:
                done.append((req, len(rows) - 1))
        if not rows:
            return
        checks = self._sums_in_step(firsts)
        logits = self.model.decode(rows, self.cache, {row: s for row, (_, s) in checks.items()})
        self.steps += 1
        for checking, summed in checks.values():
            assert self.pool is not None  # only a pool's claims have checks
            self.pool.settle(checking, summed.total)
        # The positions just written are in the cache: seal what they completed
        # (a part-fed continuation too, so a death mid-feed loses only this step),
        # unless they were computed on a claim that did not hold.
        dropped = {id(req) for req, _ in fed if not self._holds(req)}
        for req, was in fed:
            if id(req) not in dropped:
                self._seal(req, was)
        for req, row in done:
            if id(req) not in dropped:
                req.logits = logits[row]


def _parse_args(args: Sequence[str], context: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llama engine", add_help=False, exit_on_error=False)
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    parser.add_argument("--max-model-len", type=int, default=context)
    # Requests generating or waiting beyond this get 429 (OpenAI's "slow down").
    parser.add_argument("--max-pending", type=int, default=openai_api.MAX_PENDING)
    # The KV cache in GMS's KV pool, sealed and adopted by the next Active
    # engine (docs/kv-pool.md); off: engine-owned, recomputed after a failover.
    parser.add_argument("--kv-pool", choices=("on", "off"), default="on")
    # With the pool: whether the next engine adopts what the last one sealed
    # (off: it starts the pool's log afresh and recomputes; for measuring what
    # adoption saves with everything else equal).
    parser.add_argument("--kv-adopt", choices=("on", "off"), default="on")
    # One worker iteration longer than this makes the engine unhealthy (its
    # liveness fails): a hung engine. A prompt of thousands of positions on
    # this CPU engine takes longer than the default in one batch (--kv-pool
    # off); with the pool a prompt is run in chunks and each counts.
    parser.add_argument("--stuck-after", type=float, default=STUCK_AFTER_S)
    try:
        ns, unknown = parser.parse_known_args(list(args))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AdapterError(f"llama engine arguments {list(args)}: {exc}") from None
    if unknown:
        raise AdapterError(f"unknown llama engine arguments {unknown}")
    if ns.max_num_seqs < 1:
        raise AdapterError("--max-num-seqs must be at least 1")
    if ns.max_pending < 1:
        raise AdapterError("--max-pending must be at least 1")
    if ns.stuck_after <= 0:
        raise AdapterError("--stuck-after must be positive")
    if not 1 < ns.max_model_len <= context:
        raise AdapterError(f"--max-model-len must be in 2..{context} (the model's context)")
    return ns


class LlamaEngine:
    """The ``llama`` adapter: an Engine for the shim and a Generator for the OpenAI layer."""

    name = "llama"
    # Its load, attach and warm-up may run on a thread other than the main one
    # (the shim then runs a restart's start-up at a lower priority: mainloop).
    start_up_yields = True

    def __init__(self, model: str = tiny_llama.BUILTIN, engine_args: Sequence[str] = ()) -> None:
        try:
            self.model_dir = models.resolve(model)
        except ValueError as exc:
            raise AdapterError(str(exc)) from None
        except OSError as exc:  # e.g. no writable model cache: say where it looked
            raise AdapterError(
                f"model {model!r}: cannot build it in {cache_dir()} (UNDERSTUDY_MODEL_CACHE): {exc}"
            ) from exc
        if not (self.model_dir / WEIGHTS_FILE).is_file():
            raise AdapterError(f"model {model!r}: no {WEIGHTS_FILE} in {self.model_dir}")
        try:
            self.config = LlamaConfig.from_dir(self.model_dir)
            self.text = ChatTokenizer(self.model_dir)
        except (WeightsError, OSError, ValueError, KeyError) as exc:
            raise AdapterError(f"model {model!r}: {exc}") from exc
        args = _parse_args(engine_args, self.config.max_position_embeddings)
        self.model_id: str = models.served_name(model)
        self.max_model_len: int = args.max_model_len
        self.eos_ids: frozenset[int] = self.text.eos_ids
        self.max_num_seqs: int = args.max_num_seqs
        self.max_pending: int = args.max_pending
        self.stuck_after_s: float = args.stuck_after
        self.model: Forward[Any] | None = None
        self._digest = config_digest(self.model_dir)
        self._private: bytearray | None = None
        self._batcher: Batcher | None = None
        self.kv_spec: PoolSpec | None = None
        if args.kv_pool == "on":
            c, block = self.config, kvlog.BLOCK_TOKENS
            self.kv_spec = PoolSpec(
                model=self._digest,
                layers=c.num_layers,
                kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                dtype="float32",
                slots=self.max_num_seqs,
                max_len=-(-self.max_model_len // block) * block,
                block_tokens=block,
            )
        self.kv_pool: KvPool | None = None
        self.kv_adopt: bool = args.kv_adopt == "on"

    # --- weights ----------------------------------------------------------------

    def load(self, device: int, session: GmsClient) -> None:
        if device != 0:
            return  # the model lives on device 0; the others hold an empty layout
        alloc = session.allocate(packed_size(self.model_dir))
        records = self._pack(alloc)
        session.put_metadata(
            META_KEY,
            {
                "model": self.model_id,
                "config_sha256": self._digest,
                "allocation": alloc.id,
                "records": list(records),
            },
        )

    def _pack(self, alloc: Allocation) -> list[TensorRecord]:
        """The checkpoint written into ``alloc`` (a host mapping here; the
        torch engine on CUDA copies it to the device)."""
        return pack_into(alloc.view(), self.model_dir)

    def attach(self, sessions: Mapping[int, GmsClient]) -> None:
        session = sessions[min(sessions)]
        meta = session.metadata().get(META_KEY)
        if meta is None:
            raise AdapterError(f"GMS has no {META_KEY!r} metadata: not a llama layout")
        if meta.get("config_sha256") != self._digest:
            raise AdapterError(
                f"GMS holds {meta.get('model')!r}, packed from another config.json than "
                f"{self.model_dir}'s"
            )
        alloc = next((a for a in session.allocations if a.id == meta["allocation"]), None)
        if alloc is None:
            raise AdapterError(f"metadata points at allocation {meta['allocation']}, not in GMS")
        try:
            self.model = self._new_model(alloc, meta["records"])
        except WeightsError as exc:
            raise AdapterError(str(exc)) from exc
        self._warm_up()

    def attach_private(self) -> None:
        """Weights in a buffer of this process instead of GMS (tests, benchmarks)."""
        self._private = bytearray(packed_size(self.model_dir))
        records = pack_into(self._private, self.model_dir)
        self.model = self._new_model(self._private, records)
        self._warm_up()

    # --- the compute back-end (llama_backend): numpy here, torch in adapters.torch ---

    def _new_model(
        self, memory: Allocation | bytearray, records: Sequence[TensorRecord]
    ) -> Forward[Any]:
        """The model over the packed weights in ``memory`` (never a copy)."""
        host = memory.view() if isinstance(memory, Allocation) else memory
        model = LlamaModel(views_from(host, records), self.config)
        # Which forms this engine decodes in: engines of one pod must agree
        # (decode_kernels), and a slow node's log says why.
        products = "c" if model.native_products else "numpy" if model.decode_products else "rows"
        attention = "numpy" if model.decode_attention is None else "c"
        log_event(log, "decode_forms", products=products, attention=attention)
        return model

    def _new_cache(self, slots: int, max_len: int, pool: KvPool | None = None) -> Cache:
        """A cache of the engine's own, or the pool's arena (nothing allocated or copied)."""
        if pool is None:
            return KVCache(self.config, slots, max_len)
        return KVCache(self.config, slots, max_len, pool.k, pool.v, (pool.rk, pool.rv))

    def _warm_up(self) -> None:
        """Run prefill and decode once, at start-up: the first request in a fresh
        process pays their one-time costs, and a freshly restarted engine is
        often the next to wake. Waking touches no weights either: GMS maps RO
        memory with its pages present. On a cache of its own (the KV pool is
        not mapped yet, and holds another engine's sequences)."""
        assert self.model is not None
        ids = [i % self.config.vocab_size for i in range(WARMUP_LEN + 1)]
        cache = self._new_cache(2, len(ids))
        # Two prompts in one batch: its probe (LlamaModel.batch_parts) runs here,
        # not in a failover's first prefill. (prefill_chunks and prefill are
        # the same _extend: one path warms all three.)
        prompts = [Prompt(ids[:-1], 0, 0), Prompt(ids[:8], 1, 0)]
        self.model.prefill_batch(prompts, cache, PREFILL_CHUNK)
        self.model.decode([Row(0, WARMUP_LEN, ids[-1])], cache)

    # --- sleep / wake -------------------------------------------------------------

    def sleep(self) -> None:
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.stop("the engine went to sleep")  # drops the KV cache with it

    def wake(self) -> None:
        if self.model is None:
            raise AdapterError("wake before attach")
        pool = self.kv_pool
        if pool is None:
            cache = self._new_cache(self.max_num_seqs, self.max_model_len)
        else:  # the cache is the pool's arena: nothing is allocated, nothing copied
            cache = self._new_cache(pool.spec.slots, pool.spec.max_len, pool)
        batcher = Batcher(self.model, cache, self.max_model_len, pool)
        batcher.start()
        self._batcher = batcher

    # --- the KV pool (UsesKvPool) ---------------------------------------------------

    def kv_pool_request(self) -> KvPoolRequest | None:
        return KvPoolRequest.of(self.kv_spec)

    def attach_kv_pool(
        self, memory: memoryview, epoch: int, reader: memoryview | None = None
    ) -> None:
        """Adopt the pool the shim mapped (before ``wake``): read its seal log.
        The engine reads the pool through ``reader`` where the shim has one
        (mapped while this engine slept, its pages present); else the kernel
        maps what was sealed while the engine wakes."""
        assert self.kv_spec is not None
        pool = KvPool(memory, self.kv_spec, epoch, adopt=self.kv_adopt, reader=reader)
        self.kv_pool = pool
        if reader is None:
            pool.warming = memadvise.warm([(pool.sealed_spans(), memadvise.MADV_POPULATE_READ)])
        # Where the first step sums the continuations' blocks as it reads them,
        # a thread reading them ahead would only compete with it for memory.
        if self.model is None or not self.model.sums_blocks(pool.spec.block_tokens):
            pool.check_ahead()

    def close(self) -> None:
        self.sleep()

    def health(self) -> tuple[bool, str]:
        batcher = self._batcher
        if batcher is None or self.model is None:
            return False, "not awake"
        return batcher.health(self.stuck_after_s, time.monotonic())

    def routes(self) -> list[web.RouteDef]:
        # The OpenAI surface (completions, chat completions, streaming, the
        # front's continuation) is written once over the Generator protocol.
        return openai_api.routes(self, self.max_pending)

    # --- the Generator ------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.text.encode(text)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.text.encode_chat(messages)

    def decode(self, ids: Sequence[int]) -> str:
        return self.text.decode(ids)

    def request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        resume: Sequence[int] = (),
        deliver: Deliver | None = None,
    ) -> Request:
        """A validated `Request` (ValueError names what is wrong with it)."""
        vocab = self.config.vocab_size
        prompt, resume = tuple(prompt), tuple(resume)
        if not prompt:
            raise ValueError("the prompt is empty")
        if not all(0 <= t < vocab for t in prompt + resume):
            raise ValueError(f"a token id is outside the vocabulary (0..{vocab - 1})")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if finish_of(resume, params, self.eos_ids) is not None:
            raise ValueError("the resumed ids already finish this generation")
        stop = self.eos_ids | frozenset(params.stop_token_ids)
        if len(prompt) + len(resume) >= self.max_model_len:
            raise ValueError(
                f"prompt and resumed ids hold {len(prompt) + len(resume)} tokens; "
                f"the context is {self.max_model_len}"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return Request(prompt, resume, params, seed, stop, deliver or (lambda _: None))

    def submit(self, request: Request) -> None:
        batcher = self._batcher
        if batcher is None:
            raise NotServing("the engine is not awake")
        batcher.submit(request)

    def cancel(self, request: Request) -> None:
        batcher = self._batcher
        if batcher is not None:
            batcher.cancel(request)

    def expect(self, n: int) -> None:
        batcher = self._batcher
        if batcher is not None:
            batcher.expect(n)

    def generate(
        self, prompt: Sequence[int], params: SamplingParams, resume: Sequence[int] = ()
    ) -> AsyncIterator[Step]:
        # Validate now, so that a bad request fails before a response starts.
        req = self.request(prompt, params, resume)
        batcher = self._batcher
        if batcher is None:
            raise NotServing("the engine is not awake")
        return batcher.stream(req)

    @property
    def batcher(self) -> Batcher | None:
        return self._batcher


if TYPE_CHECKING:  # mypy holds the engine to both of its contracts

    def _conforms(engine: LlamaEngine) -> tuple[Engine, Generator, UsesKvPool]:
        return engine, engine, engine
