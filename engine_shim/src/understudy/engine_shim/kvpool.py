"""The KV cache in the GMS pool, with its seal log: the shell around ``kvlog``.

The pool's bytes (one GMS allocation, tag ``kv``, mapped read-write while
this engine holds the pod's lock) are laid out by ``kvlog.PoolSpec``: a
header, the seal log's ring, then the arena, which is the engine's KV cache
itself (keys, then values). Numpy arrays over the mapping are the cache: the
model writes into GMS memory directly, and nothing is copied at a failover.

On attach, the pool is **adopted**: the log is read up to its last complete
record and replayed into an index of sealed blocks (blocks written under
epochs newer than ours are ignored). A request then ``claim``s a slot: the
free slot whose sealed blocks hold the longest prefix of its tokens (by hash
chain), each of those blocks checked against its checksum before it is used;
a block that fails is recomputed with everything after it. The blocks of
the sequences in flight at the death are checked on a thread from the
adoption on (``check_ahead``), and their claims take what it found. An
engine may have a claim's other checksums computed on a thread while its
first step computes on the blocks they cover (``claim``'s ``defer``), and
``confirm`` the claim before that step's results count. Before the first
byte of a slot changes, the blocks about to be overwritten are retired in the
log. After every step, the blocks the step wrote into are ``seal``ed (a
sequence's last block as far as it is filled, sealed again as it grows).

Writes to the log go in two halves, with the ``kv.seal.torn`` failpoint
between them, so a test can kill the engine in the middle of one; the
``kv.block.corrupt`` failpoint changes an adopted block's bytes under its seal.

Given a ``reader`` (the same pool mapped read-only by this process while it
was a standby, its pages present: ``KvSession.peek``), the arena is read
through it (``rk``, ``rv``: the checksums, the attention) and written through
the read-write mapping (``k``, ``v``). The same pages at two addresses: what
the engine writes, it reads back at once; what the dead engine left, it reads
without a page fault per page of a fresh mapping.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from understudy.engine_shim import chunks, kvadopt, kvlog
from understudy.engine_shim.kvlog import HEADER_SIZE, RECORD_SIZE, PoolSpec
from understudy.wire import failpoints
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.engine_shim.kvpool")

__all__ = ["BlockSums", "Checking", "Claim", "KvPool"]

_HALF = RECORD_SIZE // 2
# `KvPool.check_ahead`: the log's last records, per slot, whose slots it checks.
AHEAD_RECORDS = 4


@dataclass(frozen=True, slots=True)
class Checking:
    """A deferred claim's checksums, computed on a thread of their own."""

    slot: int
    start: int  # the claim's start, which they cover (whole blocks below it)
    tokens: int  # the claim's tokens, prompt and chunk: where a start may go
    prompt: int
    chunk: int
    first_bad: Future[tuple[int, int] | None]  # (block, its epoch), or None: all hold
    # Summed by the engine's first step as it reads the blocks (`claim`'s
    # ``in_step``), then `KvPool.settle`d: the seals to compare them with.
    in_step: tuple[tuple[int, kvlog.Sealed], ...] = ()


@dataclass(frozen=True, slots=True)
class _Ahead:
    """A slot's adopted blocks, checked on `KvPool.check_ahead`'s thread: the
    seals checked, and the checksums their blocks' bytes have (block -> sum)."""

    seals: dict[int, kvlog.Sealed]  # block -> its seal
    sums: Future[dict[int, int]] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class BlockSums:
    """The checksums of a row's first ``total.size`` whole blocks
    (`kvlog.block_checksum`), summed by the engine's step as it reads them
    (`KvPool.block_sums`; the llama engine's attention kernel): ``rows``
    (2, layers, kv_heads, block_tokens) and ``cols`` (2, layers, kv_heads,
    words) are the weights of keys then values (`kvlog.checksum_weights`),
    ``total`` starts at 0."""

    rows: npt.NDArray[np.uint64]
    cols: npt.NDArray[np.uint64]
    total: npt.NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class Claim:
    slot: int
    start: int  # positions 0..start-1 of the slot already hold the request's KV
    reused: int  # whole blocks reused (start // block_tokens)
    corrupt: int  # sealed blocks found with a wrong checksum (recomputed)
    checking: Checking | None = None  # deferred: `KvPool.confirm` before results count


def arena(memory: memoryview, spec: PoolSpec) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """The arena's keys and values over ``memory``, each ``spec.cache_shape``
    (read-only arrays over a read-only view)."""
    count = spec.cache_bytes // spec.itemsize
    # numpy has no bfloat16: its bytes are held as uint16 (the checksums are
    # over bytes; an engine views them in its own dtype).
    storage = "uint16" if spec.dtype == "bfloat16" else spec.dtype
    arena = np.frombuffer(memory, dtype=storage, count=2 * count, offset=spec.arena_offset)
    return arena[:count].reshape(spec.cache_shape), arena[count:].reshape(spec.cache_shape)


def sum_weights(
    spec: PoolSpec, words: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """`kvlog.checksum_weights` by piece: row weights ``(2, layers, kv_heads,
    block_tokens)`` and column weights ``(2, layers, kv_heads, words)``, keys
    then values, as the arena holds them (what a step sums with, `BlockSums`)."""
    pieces = 2 * spec.layers * spec.kv_heads
    rows, cols = kvlog.checksum_weights(pieces, spec.block_tokens, words)
    shape = (2, spec.layers, spec.kv_heads, -1)
    return rows.reshape(shape), cols.reshape(shape)


@functools.lru_cache(maxsize=8)
def block_weights(spec: PoolSpec, words: int) -> npt.NDArray[np.uint64]:
    """Each word's weight in its whole block's checksum, ``(2, layers,
    kv_heads, block_tokens * words)``, from `sum_weights`: its row's weight
    plus its column's. Made once per spec (read-only), and only where blocks
    are summed apart from a step (`KvPool.checksums`): 0.7 MB for SmolLM2,
    1-2 ms of a waking engine's adoption when each pool made its own."""
    rows, cols = sum_weights(spec, words)
    weights = rows[..., :, None] + cols[..., None, :]  # (..., positions, words)
    weights.flags.writeable = False
    return weights.reshape(*rows.shape[:3], -1)


def weights(spec: PoolSpec) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """`sum_weights` for ``spec``'s rows (a head's position, in checksum words)."""
    row = spec.head_dim * spec.itemsize
    return sum_weights(spec, row // np.dtype(kvlog.word_dtype(row)).itemsize)


def in_flight(index: kvlog.Index) -> list[int]:
    """The slots sealed last, newest first: those with a seal among the
    log's last `AHEAD_RECORDS` records per slot. A decode step seals at most
    two records per sequence, so these are the sequences in flight (at a
    death: those the continuations claim first)."""
    newest: dict[int, int] = {}
    for (slot, _), sealed in index.sealed.items():
        newest[slot] = max(newest.get(slot, 0), sealed.gen)
    after = max(newest.values(), default=0) - AHEAD_RECORDS * index.spec.slots
    return sorted((s for s, gen in newest.items() if gen > after), key=lambda s: -newest[s])


def sealed_extents(index: kvlog.Index) -> dict[int, int]:
    """How many positions from the start of each slot its seals cover."""
    b = index.spec.block_tokens
    extent: dict[int, int] = {}
    for (slot, block), sealed in index.sealed.items():
        extent[slot] = max(extent.get(slot, 0), block * b + sealed.count)
    return extent


def spans(
    k: npt.NDArray[Any], v: npt.NDArray[Any], spec: PoolSpec, runs: dict[int, tuple[int, int]]
) -> Iterator[tuple[int, int]]:
    """(address, bytes) of positions ``lo``..``hi - 1`` of each ``slot: (lo,
    hi)`` of ``runs`` in the arena ``k``, ``v``: keys then values, layer by
    layer, each layer's slots' heads; made as they are taken."""
    row = spec.head_dim * spec.itemsize
    ordered = sorted(runs.items())
    return (
        (base + layer * s0 + slot * s1 + head * s2 + lo * row, (hi - lo) * row)
        for base, (s0, s1, s2, *_) in ((a.ctypes.data, a.strides) for a in (k, v))
        for layer in range(spec.layers)
        for slot, (lo, hi) in ordered
        for head in range(spec.kv_heads)
    )


def _start_at(positions: int, tokens: int, prompt: int, chunk: int) -> int:
    """Where computing starts when ``positions`` of ``tokens`` are reused
    (`KvPool.claim`): never past the last token, on the chunk grid in the prompt."""
    start = min(positions, tokens - 1)
    return chunks.start_before(start, chunk) if start < prompt else start


@dataclass(slots=True)
class Stats:
    """Counts since attach (for logs and the engine's /state)."""

    records: int = 0  # log records read at adoption
    torn: int = 0
    dropped: int = 0
    sealed_at_adoption: int = 0
    claims: int = 0
    reused_blocks: int = 0
    corrupt_blocks: int = 0
    checked: int = 0  # blocks whose checksums a claim computed
    summed_in_step: int = 0  # of them, summed by an engine's step as it read them
    checked_ahead: int = 0  # blocks `KvPool.check_ahead` checked
    sealed: int = 0
    retired: int = 0
    by_epoch: dict[int, int] = field(default_factory=dict)  # sealed blocks adopted per epoch


class KvPool:
    def __init__(
        self,
        memory: memoryview,
        spec: PoolSpec,
        epoch: int,
        *,
        adopt: bool = True,
        reader: memoryview | None = None,
    ) -> None:
        for what, mem in (("pool", memory), ("reader", reader)):
            if mem is not None and len(mem) < spec.pool_bytes:
                raise ValueError(
                    f"the {what} has {len(mem)} bytes; the spec needs {spec.pool_bytes}"
                )
        self.spec = spec
        self.epoch = epoch
        self._mem = memory
        cap = spec.log_capacity
        self._log = memory[spec.log_offset : spec.log_offset + cap * RECORD_SIZE]
        self.stats = Stats()
        header = kvlog.decode_header(memory[:HEADER_SIZE])
        version = kvlog.header_version(memory[:HEADER_SIZE])
        if adopt and version is not None and version != kvlog.VERSION:
            # Another engine's format (its checksums mean something else):
            # nothing of it is trusted; the pool starts afresh, and says why.
            log_event(
                log,
                "kv_not_adopted",
                logging.WARNING,
                epoch=epoch,
                reason=f"the seal log is format version {version}; this engine reads "
                f"{kvlog.VERSION}",
            )
        if adopt and header == (spec.digest(), cap):
            read = kvadopt.adopt(self._log, spec, epoch)
        else:  # a fresh pool, a header never written, another version, or adoption off
            self._log[:] = bytes(len(self._log))
            memory[:HEADER_SIZE] = bytes(HEADER_SIZE)
            raw = kvlog.encode_header(spec)
            memory[: len(raw)] = raw
            read = kvadopt.Adopted(kvlog.Index(spec), 0, 1, 0, 0)
        self.index = read.index
        self.writer = kvlog.Writer(self.index, epoch, read.next_gen)
        st = self.stats
        st.records, st.torn, st.dropped = read.records, read.torn, read.dropped
        st.sealed_at_adoption = len(self.index.sealed)
        for sealed in self.index.sealed.values():
            st.by_epoch[sealed.epoch] = st.by_epoch.get(sealed.epoch, 0) + 1
        self.k, self.v = arena(memory, spec)
        self.rk, self.rv = (self.k, self.v) if reader is None else arena(reader, spec)
        # The same bytes as the checksum's words: (layers, slots, heads, max_len, words).
        word = kvlog.word_dtype(spec.head_dim * spec.itemsize)
        self._words = (self.rk.view(word), self.rv.view(word))
        self._sum_weights = weights(spec)  # `block_sums`'s
        self._chains: dict[int, list[bytes]] = {s: [] for s in range(spec.slots)}
        # The thread that maps the sealed pages (memadvise.warm), if any: a
        # deferred claim's checksums wait for it (`_check_later`).
        self.warming: threading.Thread | None = None
        self._ahead: dict[int, _Ahead] = {}
        self.ahead: threading.Thread | None = None  # `check_ahead`'s, once started
        if self.index.sealed and failpoints.hit("kv.block.corrupt"):
            self._corrupt_one()
        log_event(
            log,
            "kv_adopted",
            epoch=epoch,
            records=st.records,
            sealed=st.sealed_at_adoption,
            torn=st.torn,
            dropped=st.dropped,
            ignored=self.index.ignored,
            epochs=",".join(f"{e}:{n}" for e, n in sorted(st.by_epoch.items())) or None,
        )

    def _corrupt_one(self) -> None:
        """Test only (the failpoint): change a byte of an adopted block under its
        seal, as memory corrupted between two holders would. Block 2 of the
        first slot that has one (else the first sealed block)."""
        keys = sorted(self.index.sealed)
        slot, block = next((k for k in keys if k[1] == 2), keys[0])
        row = self.k[0, slot, 0, block * self.spec.block_tokens]
        row.view(np.uint8)[-1] ^= 0x40  # an exponent bit of the row's last value
        log_event(log, "kv_failpoint_corrupted", logging.WARNING, slot=slot, block=block)

    # --- the adopted blocks checked before a request claims them ---------------

    def check_ahead(self) -> None:
        """Check the blocks of the slots the dead engine sealed last on a
        thread now, before the continuations claim them (after ``warming``,
        as `_check_later`). A claim then waits for its slot's checksums, or,
        if the thread has not begun that slot yet, takes it over.

        The bytes cannot change between this check and the claim: the engine
        that wrote them is gone (the lock is granted after its death), and
        this one writes into a block only after a claim retired it. So a
        check now is worth the claim's own, and a failover's first step no
        longer runs beside it: at 4,000 positions of SmolLM2 (184 MB) the
        check takes ~8 ms, done while the engine turns Active and the
        continuation comes back.

        The slots: `in_flight`, newest first; older prefixes, which may
        never be claimed, wait for a claim. What it finds is only compared
        at a claim (`_sums_ahead`): a block that a claim retires while the
        thread reads it (the engine writes there next) is never taken from
        it.
        """
        order = self.in_flight()
        if not order:
            return
        for slot in order:
            self._ahead[slot] = _Ahead(dict(self._seals(slot, 0, self.index.run(slot))))
        warming = self.warming

        def run() -> None:
            if warming is not None:
                warming.join()
            t0, blocks = time.monotonic(), 0
            for slot in order:
                ahead = self._ahead[slot]
                if not ahead.sums.set_running_or_notify_cancel():
                    continue  # a claim came first, and checks it itself
                try:
                    sums = self.checksums(slot, [(b, s.count) for b, s in ahead.seals.items()])
                except BaseException as exc:  # the claim waiting for it raises it
                    ahead.sums.set_exception(exc)
                    continue
                ahead.sums.set_result(dict(zip(ahead.seals, sums, strict=True)))
                blocks += len(ahead.seals)
            self.stats.checked_ahead += blocks
            seconds = round(time.monotonic() - t0, 4)
            log_event(log, "kv_checked_ahead", slots=len(order), blocks=blocks, seconds=seconds)

        self.ahead = threading.Thread(target=run, name="kv-check-ahead", daemon=True)
        self.ahead.start()

    def in_flight(self) -> list[int]:
        """The slots the dead engine sealed last, newest first (`in_flight`)."""
        return in_flight(self.index)

    def _sums_ahead(
        self, slot: int, seals: list[tuple[int, kvlog.Sealed]], *, wait: bool = True
    ) -> dict[int, int]:
        """The checksums `check_ahead` found for those of ``seals`` it checked
        (the very seals: a block sealed again since is not among them),
        waited for; none if it had not begun ``slot`` (it then never will:
        the caller computes them), or, unless ``wait``, if it is still on it."""
        ahead = self._ahead.get(slot)
        if ahead is None:
            return {}
        same = [block for block, sealed in seals if ahead.seals.get(block) is sealed]
        if not same or ahead.sums.cancel() or not (wait or ahead.sums.done()):
            return {}
        found = ahead.sums.result()
        return {block: found[block] for block in same}

    # --- a request takes a slot -------------------------------------------------

    def claim(
        self,
        tokens: Sequence[int],
        free: Sequence[int],
        prompt: int,
        chunk: int,
        *,
        defer: bool = False,
        in_step: bool = False,
    ) -> Claim:
        """The free slot to run ``tokens`` in, and the position its computing starts at.

        The slot whose sealed blocks hold the longest prefix of ``tokens``
        that a start can reuse, its checksums verified. The last token is
        always computed (its logits are what the request needs), even when a
        sealed block holds it. A start inside the first ``prompt`` tokens
        moves back to a chunk start of the grid whose first chunk is
        ``chunk`` (`chunks`): the prompt is computed in chunks at fixed
        boundaries, and only the same chunks give the same bits. The blocks
        from the start's on are retired before anything is written there,
        so among slots that give the same start the one that loses least is
        taken: the fewest sealed positions that are not a
        prefix of ``tokens``. (After a failover every stream comes back at
        once; a new request with the prompt of a continuation, reusing less
        than a chunk of it, would otherwise take the continuation's slot and
        retire its KV, and the drill's requests share their prompts. A slot
        that holds just this request's prompt, its own from the dead engine,
        loses nothing.)

        ``defer``: the checksums of the whole blocks below the start are
        computed on a thread (the claim's ``checking``), while the engine
        computes on them; the block the start falls inside is checked now,
        before the engine writes into it. The engine must `confirm` the
        claim before any result computed on it is sampled or sealed.
        Deferred, the checksums run on the other core during the first step,
        which reads the same pages. Blocks `check_ahead` checked are not read
        again, deferred or not.

        ``in_step`` (with ``defer``): the engine's first step sums those
        checksums itself as its attention reads the blocks (`block_sums`,
        then `settle`), where the claim's start is past the prompt (what
        follows it is decoded, row by row over every position before it); no
        thread reads them a second time beside the step. A claim whose start
        is inside the prompt (a prefill follows) is checked on a thread.
        """
        if not free:
            raise ValueError("no free slot")
        t0 = time.monotonic()
        b = self.spec.block_tokens
        if chunk % b:
            raise ValueError(f"a prefill chunk of {chunk} is not a multiple of {b}")

        def start_at(positions: int) -> int:
            return _start_at(positions, len(tokens), prompt, chunk)

        held = self.index.held()
        # The chain of every whole block, once: to match, and for the slot.
        # (4,000 positions: 250 hashes, 0.7 ms, on a failover's path.)
        hashes = kvlog.chains(tokens, b)
        best = min(
            self.index.prefixes(tokens, free, hashes),
            key=lambda m: (
                -start_at(m.positions),
                held.get(m.slot, 0) - m.positions,
                held.get(m.slot, 0),
                m.slot,
            ),
        )
        slot, trusted, corrupt, later = best.slot, 0, 0, 0
        if start_at(best.positions):  # (a match it cannot use is retired unread)
            if defer:  # now: only the block the start falls inside, if any
                at = start_at(best.positions)
                inside = min(best.blocks, -(-at // b))
                # That one block is read at once rather than waited for while
                # `check_ahead` is still on the slot: the rest of its check
                # then runs beside the step, as a deferred check does.
                trusted = self._verified(slot, inside, best.positions, at // b, wait=False)
            else:
                trusted = self._verified(slot, best.blocks, best.positions)
            corrupt = int(trusted < best.positions)
        start = start_at(trusted)
        if defer and start >= b:
            later = start // b
        self._retire(slot, start // b)
        self._chains[slot] = hashes[: start // b]
        st = self.stats
        st.claims += 1
        st.reused_blocks += start // b
        st.corrupt_blocks += corrupt
        if start or corrupt:
            log_event(
                log,
                "kv_reused",
                slot=slot,
                positions=start,
                of=len(tokens),
                corrupt=corrupt or None,
                checking=later or None,  # blocks whose checksums are still computing
                seconds=round(time.monotonic() - t0, 4),  # the match, its checksums verified
            )
        checking = None
        if later and in_step and start >= prompt:
            seals = tuple(self._seals(slot, 0, later))
            checking = Checking(slot, start, len(tokens), prompt, chunk, Future(), seals)
        elif later:
            first_bad = self._check_later(slot, self._seals(slot, 0, later))
            checking = Checking(slot, start, len(tokens), prompt, chunk, first_bad)
        return Claim(slot, start, start // b, corrupt, checking)

    def confirm(self, checking: Checking) -> int:
        """Wait for a deferred claim's checksums: the start that holds. If a
        block failed, it is the start before that block (`claim`'s rule),
        and the slot's blocks from there on are retired, as a claim that had
        found it would have; what the engine computed from the claim's start
        is to be dropped and computed again from this one."""
        t0 = time.monotonic()
        if checking.in_step and not checking.first_bad.done():
            self.settle(checking)  # no step summed them (it failed first): read them now
        bad = checking.first_bad.result()
        slot, b = checking.slot, self.spec.block_tokens
        if bad is None:
            log_event(
                log,
                "kv_verified",
                slot=slot,
                by="step" if checking.in_step else "thread",  # who summed the blocks
                waited=round(time.monotonic() - t0, 4),
            )
            return checking.start
        block, epoch = bad
        log_event(log, "kv_corrupt_block", logging.WARNING, slot=slot, block=block, epoch=epoch)
        start = _start_at(block * b, checking.tokens, checking.prompt, checking.chunk)
        self._retire(slot, start // b)
        del self._chains[slot][start // b :]
        st = self.stats
        st.reused_blocks -= checking.start // b - start // b
        st.corrupt_blocks += 1
        log_event(log, "kv_reused", slot=slot, positions=start, of=checking.tokens, corrupt=1)
        return start

    def block_sums(self, checking: Checking) -> BlockSums:
        """What the engine's step sums ``checking``'s blocks into (an
        ``in_step`` claim's): every block below its start, from 0."""
        return self.sums_of_blocks(checking.start // self.spec.block_tokens)

    def sums_of_blocks(self, blocks: int) -> BlockSums:
        """What a read of a slot's first ``blocks`` whole blocks sums their
        checksums into (`block_sums`; a load ahead of its claim's)."""
        rows, cols = self._sum_weights
        return BlockSums(rows, cols, np.zeros(blocks, np.uint64))

    def settle(self, checking: Checking, total: npt.NDArray[np.uint64] | None = None) -> None:
        """Settle an ``in_step`` claim's checksums: ``total``, as the step summed
        them (`block_sums`), against its seals; or, given none (no step summed
        them), the blocks read now. `confirm` then has its answer."""
        if checking.first_bad.done():
            return
        seals = list(checking.in_step)
        if total is None or total.size != len(seals):
            bad = self._first_bad(checking.slot, seals)
        else:
            self.stats.checked += len(seals)
            self.stats.summed_in_step += len(seals)
            bad = next(((b, s.epoch) for b, s in seals if int(total[b]) != s.checksum), None)
        checking.first_bad.set_result(bad)

    @property
    def reads_premapped(self) -> bool:
        """Whether reads go through a view of their own (``reader``)."""
        return self.rk is not self.k

    def sealed_spans(self) -> Iterator[tuple[int, int]]:
        """Where the sealed positions' bytes lie, (address, bytes), in the
        order a claim's checksums read them (keys then values, layer by
        layer; in each, every slot's heads): what a failover's first requests
        read first (``memadvise.warm``). The sealed extents are read now;
        the spans are made as they are taken, by the warming thread, off
        the wake (a span each per layer, slot and head: tens of thousands
        for a large batch)."""
        runs = {slot: (0, n) for slot, n in sealed_extents(self.index).items()}
        return spans(self.k, self.v, self.spec, runs)

    def _verified(
        self, slot: int, blocks: int, positions: int, first: int = 0, *, wait: bool = True
    ) -> int:
        """How many of the ``positions`` that ``slot``'s first ``blocks`` sealed
        blocks cover hold the bytes their seals say: up to the first block that
        does not (the blocks before ``first`` are taken as they are)."""
        bad = self._first_bad(slot, self._seals(slot, first, blocks), wait=wait)
        if bad is None:
            return positions
        block, epoch = bad
        log_event(log, "kv_corrupt_block", logging.WARNING, slot=slot, block=block, epoch=epoch)
        return block * self.spec.block_tokens

    def _retire(self, slot: int, block: int) -> None:
        """Stop trusting ``slot``'s blocks from ``block`` on, in the log."""
        retire = self.writer.retire(slot, block)
        self._write(retire)
        self.stats.retired += len(retire)

    def _seals(self, slot: int, lo: int, hi: int) -> list[tuple[int, kvlog.Sealed]]:
        """``slot``'s seals of blocks ``lo``..``hi - 1``, read from the index now."""
        return [(block, self.index.sealed[(slot, block)]) for block in range(lo, hi)]

    def _first_bad(
        self, slot: int, seals: list[tuple[int, kvlog.Sealed]], *, wait: bool = True
    ) -> tuple[int, int] | None:
        """The first of ``slot``'s ``seals`` whose block's bytes are not what it
        says: (block, the seal's epoch); None if all hold. Reads only the
        blocks' bytes, so it may run on another thread."""
        sums = self._sums_ahead(slot, seals, wait=wait)
        rest = [(block, s.count) for block, s in seals if block not in sums]
        if rest:
            sums.update(zip((block for block, _ in rest), self.checksums(slot, rest), strict=True))
            self.stats.checked += len(rest)
        for block, sealed in seals:
            if sums[block] != sealed.checksum:
                return block, sealed.epoch
        return None

    def _check_later(
        self, slot: int, seals: list[tuple[int, kvlog.Sealed]]
    ) -> Future[tuple[int, int] | None]:
        """`_first_bad` on a thread of its own (numpy's reductions let go of
        the GIL): the engine's step runs meanwhile. After the pages are
        mapped (``warming``), not beside it: with the step, the mapping and
        the checksums runnable at once on two cores, a step at 4,000
        positions of SmolLM2 on a fresh mapping took 70-82 ms; with the
        mapping and then the checksums on one thread, 51-56 ms, both done
        within the step (47-50 ms with the mapping alone; in process, 6 each,
        SkylakeX kernels)."""
        out: Future[tuple[int, int] | None] = Future()
        warming = self.warming

        def run() -> None:
            try:
                if warming is not None:
                    warming.join()
                out.set_result(self._first_bad(slot, seals))
            except BaseException as exc:  # the waiter (confirm) raises it
                out.set_exception(exc)

        threading.Thread(target=run, name="kv-check", daemon=True).start()
        return out

    # --- after a step ----------------------------------------------------------

    def seal(self, slot: int, tokens: Sequence[int], before: int, after: int) -> None:
        """Seal the blocks of ``slot`` written into when its filled positions went
        from ``before`` to ``after``; ``tokens`` are the ids at positions 0.."""
        b = self.spec.block_tokens
        chain = self._chains[slot]
        touched = list(kvlog.touched(self.spec, before, after))
        sums = self.checksums(slot, touched)  # all at once: a prefill seals hundreds
        for (block, count), checksum in zip(touched, sums, strict=True):
            if len(chain) != block:
                raise AssertionError(f"slot {slot}: sealing block {block} after {len(chain)}")
            parent = chain[-1] if chain else kvlog.ROOT
            digest = kvlog.chain(parent, tokens[block * b : block * b + count])
            self._write(self.writer.seal(slot, block, digest, checksum, count))
            if count == b:
                chain.append(digest)
            self.stats.sealed += 1

    def checksum(self, slot: int, block: int, count: int) -> int:
        """Of the block's first ``count`` positions, in every layer and head."""
        return self.checksums(slot, [(block, count)])[0]

    def checksums(self, slot: int, blocks: Sequence[tuple[int, int]]) -> list[int]:
        """`checksum` of each ``(block, count)`` of ``slot``: ``kvlog.block_checksum``
        of the block's words (keys then values, layer by layer, head by head).

        The whole blocks are summed together, all keys and then all values of
        their run at once (`_whole_sums`), instead of a call per block, layer
        and head. A block covered in part (a sequence's last) is summed on
        its own."""
        b = self.spec.block_tokens
        out = [0] * len(blocks)
        whole = [i for i, (_, count) in enumerate(blocks) if count == b]
        if whole:
            lo = min(blocks[i][0] for i in whole)
            hi = max(blocks[i][0] for i in whole) + 1
            sums = self._whole_sums(slot, lo, hi)
            for i in whole:
                out[i] = int(sums[blocks[i][0] - lo])
        for i, (block, count) in enumerate(blocks):
            if count != b:
                start = block * b
                words = np.stack([w[:, slot, :, start : start + count] for w in self._words])
                shape = (-1, count, words.shape[-1])  # (pieces, positions, words)
                out[i] = kvlog.block_checksum(words.reshape(shape), b)
        return out

    def _whole_sums(self, slot: int, lo: int, hi: int) -> npt.NDArray[np.uint64]:
        """``block_checksum`` of every whole block ``lo``..``hi - 1`` of ``slot``.

        The two weighted sums are one: a word's weight is its row's plus its
        column's (`block_weights`), so a block's checksum is the dot product of
        its words with those weights, in uint64 (it wraps, as the sums do). One
        einsum per keys or values reads their run at memory speed: 8 ms for the
        184 MB of 4,000 positions of SmolLM2, where a row sum and a column sum
        per layer took 20 (in process, 5 each)."""
        spec, b, n = self.spec, self.spec.block_tokens, hi - lo
        total = np.zeros(n, dtype=np.uint64)
        weights_kv = block_weights(spec, self._words[0].shape[-1])
        for arr, weights in zip(self._words, weights_kv, strict=True):
            run = arr[:, slot, :, lo * b : hi * b]
            run = run.reshape(spec.layers, spec.kv_heads, n, b * arr.shape[-1])
            total += np.einsum("lhnk,lhk->n", run, weights, dtype=np.uint64)
        return total

    def _write(self, writes: list[kvlog.Write]) -> None:
        for w in writes:
            self._log[w.offset : w.offset + _HALF] = w.data[:_HALF]
            failpoints.hit("kv.seal.torn")
            self._log[w.offset + _HALF : w.offset + RECORD_SIZE] = w.data[_HALF:]
