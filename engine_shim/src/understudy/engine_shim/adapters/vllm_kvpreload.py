"""A failover's KV loaded ahead: the dead engine's sequences copied into
vLLM's cache while the next engine wakes, before their continuations come.

A continuation's load (``vllm_kvconn.Link.run``) copies the positions the
pool holds into the blocks vLLM allocated for it, before the step's forward
pass: at 4,000 positions of SmolLM2, 184 MB and ~25 ms on the failover's
path. Yet the engine knows at wake which slots the dead engine was serving
(`KvPool.in_flight`) and which blocks vLLM will hand out next (its free
queue, in order: ``vllm_kv.next_free_blocks``), and the continuations come
back only after the wake. So `Preload` copies each in-flight slot into the
blocks its continuation would get, on a thread of its own, summing the
checksums of its blocks as it copies (the C moves), while the engine turns
Active and the front resends.

It is a guess, and the guess is only taken where it held:

- The first step after the wake stops it (``finish``, from the scheduler
  side's ``build_connector_meta``, before that step's forward pass: no
  forward pass ever writes a block the thread is writing), and what it
  finished (`Ready`, by slot) goes to that step's plan only.
- A load of that step takes a slot's `Ready` only if it starts at position
  0 into the very blocks that were loaded (``Planner.step``); any other
  request that got them, or a later step, finds the blocks as vLLM would
  (written before read) and its load copies as before.
- Nothing else writes those blocks or the slot's positions in between: vLLM
  does not zero the blocks it hands out where its cache is of one precision
  (where it would, ``vllm_kv.zeroes_new_blocks``, nothing is loaded ahead),
  and the pool's positions change only after a claim, which comes with or
  after the step that stops this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import numpy as np
import numpy.typing as npt

from understudy.engine_shim.adapters.vllm_kvplan import Move, Ready
from understudy.engine_shim.kvpool import BlockSums
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.engine_shim.vllm_kv")


@dataclass(frozen=True, slots=True)
class Target:
    """A slot's positions ``0..positions-1`` to copy into ``block_ids``; the
    first ``done`` of them (whole pool blocks) copied already, before the
    kill (`vllm_kvfollow`), their blocks' checksums ``sums`` as summed then."""

    slot: int
    block_ids: tuple[int, ...]
    positions: int
    done: int = 0
    sums: npt.NDArray[np.uint64] | None = field(default=None, compare=False)


def targets(
    slots: Sequence[int], held: Mapping[int, int], free: Sequence[int], block_size: int
) -> list[Target]:
    """Where each of ``slots`` (in the order their continuations are guessed
    to come) would land: a continuation's prompt is the slot's ``held``
    positions and the token sampled last, so vLLM hands it the next
    ``ceil((held + 1) / block_size)`` blocks of ``free``; the held positions
    fill the first ``ceil(held / block_size)`` of them. Stops where ``free``
    runs out."""
    out, at = [], 0
    for slot in slots:
        n = held.get(slot, 0)
        need, takes = -(-n // block_size), -(-(n + 1) // block_size)
        if n == 0 or at + takes > len(free):
            break
        out.append(Target(slot, tuple(free[at : at + need]), n))
        at += takes
    return out


# A slot is copied in pieces of this many positions (whole blocks of the
# pool's, so that each piece sums its own blocks): the first step, which waits
# for the slot under way, copies the pieces left beside the thread.
PIECE: Final = 512


class Preload:
    """Copy ``targets`` one slot after another on a thread (started here,
    after ``after`` ends: the warming of the same pages), with ``load(move,
    sums)`` (the copier's) and ``sums(blocks)`` (the pool's
    `KvPool.sums_of_blocks`; None: none summed), in pieces of `PIECE`
    positions."""

    def __init__(
        self,
        targets: Sequence[Target],
        load: Callable[[Move, BlockSums | None], None],
        sums: Callable[[int], BlockSums] | None,
        block_tokens: int,
        after: threading.Thread | None = None,
    ) -> None:
        self._targets = list(targets)
        self._load, self._block_tokens = load, block_tokens
        piece = max(1, PIECE // block_tokens) * block_tokens  # whole blocks
        self._after = after
        self._lock = threading.Lock()
        # The pieces not begun, in order: (target, first position, end).
        self._pieces = deque(
            (t, p, min(p + piece, t.positions))
            for t in targets
            for p in range(t.done, t.positions, piece)
        )
        self._left = {t.slot: -(-(t.positions - t.done) // piece) for t in targets}  # not done
        self._sums = {t.slot: None if sums is None else self._begun_sums(t, sums) for t in targets}
        self._begun: set[int] = set()  # slots with a piece taken
        self._failed: set[int] = set()
        self._copying_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-preload", daemon=True)
        self._thread.start()

    def _begun_sums(self, t: Target, sums: Callable[[int], BlockSums]) -> BlockSums:
        """What ``t``'s pieces sum into: its blocks copied before the kill
        hold the checksums summed then."""
        whole = sums(t.positions // self._block_tokens)
        before = t.done // self._block_tokens
        if before:
            if t.sums is None or t.sums.size < before:
                raise ValueError(f"slot {t.slot}: {before} blocks copied ahead, not summed")
            whole.total[:before] = t.sums[:before]
        return whole

    def _copy(self) -> bool:
        """Copy the next piece; False if none is left."""
        with self._lock:
            if not self._pieces:
                return False
            t, start, end = self._pieces.popleft()
            self._begun.add(t.slot)
        # The pieces of a slot sum its blocks into one array, each into its
        # own blocks' entries: two threads never add into the same one.
        whole = self._sums[t.slot]
        blocks = end // self._block_tokens
        sums = None if whole is None else replace(whole, total=whole.total[:blocks])
        try:
            self._load(Move("preload", t.slot, t.block_ids, start, end), sums)
        except Exception as exc:  # a guess: the continuation's own load copies
            log_event(log, "kv_preload_failed", logging.WARNING, slot=t.slot, error=exc)
            with self._lock:
                self._failed.add(t.slot)
        with self._lock:
            self._left[t.slot] -= 1
        return True

    def _run(self) -> None:
        if self._after is not None:
            self._after.join()
        t0 = time.monotonic()
        while self._copy():
            pass
        self._copying_s = time.monotonic() - t0

    def finish(self, *, complete: bool = True) -> dict[int, Ready]:
        """No slot begun from now on; the ones under way copied to their end,
        beside the thread, where ``complete`` (else dropped); the slots copied."""
        t0 = time.monotonic()
        with self._lock:
            self._pieces = deque(x for x in self._pieces if complete and x[0].slot in self._begun)
        while self._copy():
            pass
        self._thread.join()
        done = {}
        for t in self._targets:
            if self._left[t.slot] == 0 and t.slot not in self._failed:
                sums = self._sums[t.slot]
                done[t.slot] = Ready(t.block_ids, t.positions, None if sums is None else sums.total)
        log_event(
            log, "kv_preloaded", slots=len(done), of=len(self._targets),
            positions=sum(r.positions for r in done.values()),
            before=sum(t.done for t in self._targets if t.slot in done),  # the kill
            seconds=round(self._copying_s, 4), waited=round(time.monotonic() - t0, 4),
        )  # fmt: skip
        return done
