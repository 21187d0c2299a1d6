"""A failover's KV loaded before the kill: a standby copies the sequences in
flight into the blocks their continuations would get, as they are sealed.

The load ahead (`vllm_kvpreload`) copies the dead engine's slots from the
wake on, and a failover's first step waited for it: ~22 ms of its 123 at
4,000 positions of SmolLM2 (docs/performance.md). Yet a standby already
follows the pool's seal log ten times a second (`kvreader`), and while it
sleeps its vLLM hands out no block, so the guess the wake makes (which
slots, into which blocks: `vllm_kvpreload.targets`) is one it can make
before the kill. So `Following.follow`, on each of the reader's passes,
copies each in-flight slot's whole blocks sealed since its last pass into
their guessed blocks, summing their checksums as it copies; at the wake
`Following.ahead` tells the load ahead where each slot's copy stands, and
a failover copies only what was sealed since (a token or two a stream).

What it copied is taken only where it still holds:

- A slot's guessed blocks are the same at the wake (its continuation's
  blocks, as far as the copy went), and each block it copied has the very
  seal it had then (a slot retired and used again, or a block sealed
  again, is copied from its start at the wake instead). The claim then
  checks the checksums summed from the bytes copied against those seals:
  a block written under the copy fails them and is computed again.
- Whole blocks of the pool only: a block sealed in part still grows.
- It copies only where the guess held for two passes running (the slots'
  order and their first blocks): with many streams the newest-first order
  changes at nearly every seal, and each change would move later slots'
  blocks, so copies are not spent on a layout that does not hold.

The price: the standby keeps the pages of the blocks it wrote (at most
what the sequences in flight hold; its other pages stay released), and
the copies' CPU, once per sealed block, on the reader's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from understudy.engine_shim import kvlog, kvpool
from understudy.engine_shim.adapters.vllm_kvplan import Move
from understudy.engine_shim.adapters.vllm_kvpreload import Target, targets
from understudy.engine_shim.kvpool import BlockSums

Load = Callable[[Move, BlockSums], None]  # a copy from the pool into vLLM's blocks, summing


@dataclass(slots=True)
class _Copied:
    """A slot's whole blocks copied so far: into ``block_ids``, under ``seals``
    (one per pool block, from block 0), their checksums in ``total``."""

    block_ids: tuple[int, ...]
    seals: list[kvlog.Sealed]
    total: npt.NDArray[np.uint64]


class Following:
    """A standby's copies ahead of the kill, for a pool laid out by ``spec``
    and vLLM blocks of ``block_size`` positions."""

    def __init__(self, spec: kvlog.PoolSpec, block_size: int) -> None:
        self._spec, self._block_size = spec, block_size
        self._rows, self._cols = kvpool.weights(spec)
        self._copied: dict[int, _Copied] = {}
        self._layout: tuple[tuple[int, int], ...] = ()  # the last pass's guess
        self.positions = 0  # copied in all, for the logs

    def follow(self, index: kvlog.Index, free: Callable[[int], Sequence[int]], load: Load) -> int:
        """One pass: ``index`` (the log now), ``free(n)`` (the first ``n``
        blocks vLLM hands out next), ``load``; the positions copied."""
        held = index.held()
        size = self._block_size
        wanted = sum(-(-(n + 1) // size) for n in held.values())
        guess = targets(kvpool.in_flight(index), held, free(wanted), size)
        layout = tuple((t.slot, t.block_ids[0]) for t in guess)
        if layout != self._layout:  # copy once the guess holds for a second pass
            self._layout = layout
            return 0
        copied = sum(self._copy(t, index, load) for t in guess)
        self.positions += copied
        return copied

    def _copy(self, t: Target, index: kvlog.Index, load: Load) -> int:
        b = self._spec.block_tokens
        whole = 0
        while whole < t.positions // b and _whole(index.sealed.get((t.slot, whole)), b):
            whole += 1
        got = self._held(t, index)
        if got is None:
            got = _Copied(t.block_ids, [], np.zeros(self._spec.blocks_per_slot, np.uint64))
            self._copied[t.slot] = got
        start = len(got.seals)
        if whole <= start:
            return 0
        seals = [index.sealed[(t.slot, block)] for block in range(start, whole)]
        sums = BlockSums(self._rows, self._cols, got.total[:whole])
        load(Move("follow", t.slot, t.block_ids, start * b, whole * b), sums)
        got.block_ids = t.block_ids
        got.seals += seals
        return (whole - start) * b

    def _held(self, t: Target, index: kvlog.Index) -> _Copied | None:
        """What was copied of ``t``'s slot, if it still holds for ``t``."""
        got = self._copied.get(t.slot)
        if got is None:
            return None
        used = -(-len(got.seals) * self._spec.block_tokens // self._block_size)
        if got.block_ids[:used] == t.block_ids[:used] and all(
            index.sealed.get((t.slot, block)) == sealed for block, sealed in enumerate(got.seals)
        ):
            return got
        del self._copied[t.slot]
        return None

    def ahead(self, guess: Sequence[Target], index: kvlog.Index) -> list[Target]:
        """``guess`` (the wake's, over the adopted ``index``), each target with
        what was copied of it before the kill, where that holds."""
        out = []
        for t in guess:
            got = self._held(t, index)
            done = min(len(got.seals) * self._spec.block_tokens, t.positions) if got else 0
            out.append(replace(t, done=done, sums=got.total if got and done else None))
        return out


def _whole(sealed: kvlog.Sealed | None, block_tokens: int) -> bool:
    return sealed is not None and sealed.count == block_tokens
