"""What vLLM's KV connector moves between vLLM's cache and the KV pool, step by step.

The ``vllm`` engine keeps its own paged KV cache (vLLM allocates it; its
kernels read it) and keeps a copy of every request's KV in the GMS KV pool,
in the same geometry the ``llama`` engine uses (``kvlog.PoolSpec``: a slot
per sequence, a position at its place in the sequence, keys then values),
under the same seal log. This module is the scheduler's half of that: it
runs in vLLM's scheduler (``vllm_kvconn``'s connector calls it) and decides,
without touching memory:

- **A new request claims a slot** (``KvPool.claim``: the free slot whose
  sealed blocks hold the longest prefix of its ids; what lies past that
  prefix is retired before anything writes there). The claim's start is
  what the pool can give vLLM: ``matched`` answers vLLM's
  ``get_num_new_matched_tokens`` with the positions past vLLM's own prefix
  cache hit, and ``allocated`` turns vLLM's answer into a **load** (pool →
  the blocks vLLM allocated), run before the step's forward pass.
- **The claim's checksums are summed by its load** as it copies the blocks
  (the claim is deferred, ``in_step``; the load carries its ``Checking``).
  The worker settles it before the forward pass; a request whose blocks
  failed is ``cut`` back to its last good block, in the pool and here, and
  the worker reports the vLLM blocks it loaded from there on as load
  errors, which vLLM computes again (``kv_load_failure_policy=recompute``).
- **A load ahead** (``vllm_kvpreload``): at wake, before any continuation
  comes back, the engine copies the slots the dead engine was serving into
  the blocks vLLM hands out next, summing their checksums. The first step
  after the wake stops it; a load of that step whose request got those very
  blocks from position 0 finds its positions in place (`Ready`), and copies
  only what lies past them.
- **Every scheduled step of a request with a slot saves** the positions the
  pool does not hold yet, up to where the step leaves the request (pool ←
  vLLM's blocks, after the forward pass), and the worker seals them.
- **A finished request frees its slot**; its sealed blocks stay for the next
  request with the same prefix, and for the next engine after a failover.

A request that finds no free slot runs as without a pool. The scheduler and
the worker run in one thread of the engine process (vLLM's engine core is
in-process), one after the other, so the plan needs no lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from understudy.engine_shim.kvpool import Checking, Claim, KvPool

__all__ = ["Move", "Planner", "Ready", "StepPlan"]


@dataclass(frozen=True, slots=True)
class Ready:
    """A slot loaded ahead: its positions ``0..positions-1`` in vLLM's blocks
    ``block_ids`` (position ``p`` in ``block_ids[p // block_size]``), and
    the checksums of its whole blocks as the copy summed them (None: not
    summed)."""

    block_ids: tuple[int, ...]
    positions: int
    sums: npt.NDArray[np.uint64] | None = None


@dataclass(frozen=True, slots=True)
class Move:
    """Positions ``start..end-1`` of one request, between its pool slot and
    vLLM's blocks ``block_ids`` (the request's block table: position ``p`` is
    in ``block_ids[p // block_size]``). ``tokens`` are the request's ids at
    positions ``0..end-1`` (a save seals them)."""

    req_id: str
    slot: int
    block_ids: tuple[int, ...]
    start: int
    end: int
    tokens: tuple[int, ...] = ()
    checking: Checking | None = None  # a load's: the claim's checksums, to settle
    # A load's positions from ``start`` already in its blocks (loaded ahead),
    # and the checksums that load summed of the blocks ``checking`` settles
    # (None: they are read then).
    ready: int = 0
    sums: npt.NDArray[np.uint64] | None = None


@dataclass(slots=True)
class StepPlan:
    loads: list[Move] = field(default_factory=list)  # before the forward pass
    saves: list[Move] = field(default_factory=list)  # after it, then sealed


@dataclass(slots=True)
class _Held:
    slot: int
    saved: int  # the pool holds positions 0..saved-1 of this request (or will, once saved)
    given: int = 0  # vLLM's own hit when it last asked (what a load starts from)
    load: int = 0  # positions to load at the next step
    checking: Checking | None = None  # the claim's checksums, until a load takes them


class Planner:
    """The scheduler side's state: which request holds which slot, and how far
    the pool holds it."""

    def __init__(self, pool: KvPool, max_len: int) -> None:
        self.pool = pool
        self.max_len = max_len  # positions a slot holds
        self._held: dict[str, _Held] = {}
        self._pending: dict[str, int] = {}  # requests with a load at the next step

    def matched(
        self, req_id: str, tokens: Sequence[int], computed: int
    ) -> tuple[int, Claim | None]:
        """Positions past ``computed`` (vLLM's own prefix hit, whole blocks)
        that the pool can give this request, and the claim if this call made
        it (the first call claims the request's slot)."""
        held, claim = self._held.get(req_id), None
        if held is None:
            free = self._free()
            if not free or len(tokens) > self.max_len:
                return 0, None
            # prompt=0: every sealed position is reused, none moved back to a
            # chunk grid. vLLM's prefill keeps no fixed chunks (the grid is the
            # numpy engine's, for its bits), so moving back would only have vLLM
            # recompute up to a block of positions as a prefill: 8 of a
            # continuation's 24 at a kill, where one position is what a decode
            # step computes.
            chunk = self.pool.spec.block_tokens
            claim = self.pool.claim(tokens, free, prompt=0, chunk=chunk, defer=True, in_step=True)
            held = _Held(claim.slot, claim.start, checking=claim.checking)
            self._held[req_id] = held
        held.given = computed
        # Never the last id: its logits are what vLLM must compute.
        return max(0, min(held.saved, len(tokens) - 1) - computed), claim

    def allocated(self, req_id: str, external: int) -> None:
        """vLLM allocated blocks for ``external`` positions from the pool (0:
        none). They are loaded at the request's next scheduled step."""
        held = self._held.get(req_id)
        if held is not None and external > 0:
            held.load = external
            self._pending[req_id] = external

    def step(
        self,
        scheduled: Sequence[tuple[str, int, int, Sequence[int], Sequence[int]]],
        ready: Mapping[int, Ready] | None = None,
    ) -> StepPlan:
        """This step's loads and saves. ``scheduled``: for every request the
        step runs, ``(req_id, computed before the step, positions scheduled,
        its block ids, its ids so far)``; ``ready``: the slots loaded ahead
        (by slot), which a load from position 0 into the same blocks takes."""
        plan = StepPlan()
        for req_id, computed, count, block_ids, tokens in scheduled:
            held = self._held.get(req_id)
            if held is None:
                continue
            blocks = tuple(block_ids)
            if self._pending.pop(req_id, None) is not None and held.load > 0:
                start, end, checking = held.given, held.given + held.load, held.checking
                move = Move(req_id, held.slot, blocks, start, end, checking=checking)
                got = (ready or {}).get(held.slot)
                if got is not None and start == 0 and blocks[: len(got.block_ids)] == got.block_ids:
                    move = replace(
                        move, ready=min(got.positions, end), sums=_below(got.sums, checking)
                    )
                plan.loads.append(move)
                held.load, held.checking = 0, None
            end = min(computed + count, self.max_len)
            if end > held.saved:
                ids = tuple(tokens[:end])
                plan.saves.append(Move(req_id, held.slot, blocks, held.saved, end, ids))
                held.saved = end
        return plan

    def cut(self, req_id: str, trusted: int) -> None:
        """The request's load failed its checksums from position ``trusted``
        on (the pool retired its blocks from there): vLLM computes them
        again, and what is saved next starts there."""
        held = self._held.get(req_id)
        if held is not None:
            held.saved = min(held.saved, trusted)

    def finished(self, req_id: str) -> None:
        self._held.pop(req_id, None)
        self._pending.pop(req_id, None)

    def holds(self, req_id: str) -> int | None:
        held = self._held.get(req_id)
        return None if held is None else held.slot

    def _free(self) -> list[int]:
        taken = {h.slot for h in self._held.values()}
        return [s for s in range(self.pool.spec.slots) if s not in taken]


def _below(
    sums: npt.NDArray[np.uint64] | None, checking: Checking | None
) -> npt.NDArray[np.uint64] | None:
    """Of a load ahead's ``sums`` (a slot's first blocks), those of the blocks
    below ``checking``'s start, which it settles; None where they do not
    cover them."""
    if sums is None or checking is None:
        return None
    blocks = len(checking.in_step)
    return sums[:blocks] if sums.size >= blocks else None
