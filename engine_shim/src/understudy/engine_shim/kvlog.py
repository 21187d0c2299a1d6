"""The KV pool's seal log: which blocks of an inherited KV cache may be trusted (pure).

The Active engine keeps its KV cache in a pool that GMS owns, so the cache
outlives the engine's process (docs/kv-pool.md). The next Active engine maps
the same memory, but memory alone says nothing about what it holds: the dead
engine may have been half-way through a step, or through writing this log.
So a block of positions is trusted only once **sealed**: after a step, the
engine appends one record per block the step wrote into, naming

- the block (the cache slot and the block's index in it) and how many of its
  positions the seal covers (all of them, or, for a sequence's last block,
  those filled so far: it is sealed again as it grows, so a failover
  recomputes at most the step that was under way),
- the **hash chain** of the token ids the block's positions hold, each block's
  hash covering its parent's (so a match is a match of the whole prefix, as in
  vLLM's prefix caching),
- a **checksum** of the block's bytes (a block whose bytes no longer match is
  recomputed, never served; `block_checksum` says which, and why it is not
  CRC-32 since version 2),
- the **epoch** of the lock holder that wrote it.

Before an engine writes into positions of a slot that hold sealed blocks, it
appends a **retire** record for them: a block whose bytes are about to change
stops being trusted before the first byte changes.

The log is a ring of fixed-size records, append-only, each carrying a
**generation** (1, 2, 3, ... with no gaps) and a CRC of its own bytes. A
death in the middle of a write leaves a record whose CRC fails; the log is
read as the longest run of consecutive generations that ends at the newest
valid one, so a torn write costs that one record and never makes a wrong
record readable. A gap in the middle (memory corrupted) drops everything
older than the gap, which can only drop trust, never add it: a retire is
never kept without the seals before it being dropped too. The ring wraps:
a record that is about to be overwritten while it still seals a live block is
copied forward first (`Writer`), so wrapping forgets nothing still true.

This module is the pure part: the pool's layout (`PoolSpec`), the record
codec, the reading of a log (`read_log`), the replay into an `Index`, the
lookup of a token prefix (`Index.match`) and the planning of appends
(`Writer`). The shell that maps GMS memory and writes these bytes is
``kvpool``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BLOCK_TOKENS",
    "HEADER_SIZE",
    "RECORD_BODY_SIZE",
    "RECORD_DTYPE",
    "RECORD_SIZE",
    "ROOT",
    "Index",
    "Kind",
    "LogRead",
    "Match",
    "PoolSpec",
    "Record",
    "Sealed",
    "Write",
    "Writer",
    "block_checksum",
    "chain",
    "chains",
    "checksum_weights",
    "decode_header",
    "decode_record",
    "encode_header",
    "encode_record",
    "header_version",
    "read_from",
    "read_log",
    "word_dtype",
]

# 16 positions a block, as vLLM's default block size: a failover recomputes
# at most 15 positions past the last sealed block of a sequence.
BLOCK_TOKENS: Final = 16
RECORD_SIZE: Final = 64
HEADER_SIZE: Final = 4096
ARENA_ALIGN: Final = 4096
MAGIC: Final = b"USKVLOG1"
# 2: a seal's checksum is `block_checksum`'s weighted sums; 1 was CRC-32 of the
# block's bytes. A pool whose header says another version is not adopted
# (`header_version` lets the shell say why): its checksums mean something else.
VERSION: Final = 2
CHAIN_BYTES: Final = 16
ROOT: Final = bytes(CHAIN_BYTES)  # the parent of a sequence's first block

# A record: these fields (struct's format, numpy's type; None: padding), then
# the CRC of their bytes. Both readers take their layout from here: the codec
# below, and adoption's arrays (`RECORD_DTYPE`, ``kvadopt``).
_FIELDS: Final = (
    ("gen", "Q", "<u8"),
    ("kind", "B", "u1"),
    (None, "x", None),
    ("slot", "H", "<u2"),
    ("block", "I", "<u4"),
    ("epoch", "Q", "<u8"),
    ("chain", f"{CHAIN_BYTES}s", f"V{CHAIN_BYTES}"),
    ("checksum", "Q", "<u8"),
    ("count", "H", "<u2"),
)
_BODY: Final = struct.Struct("<" + "".join(fmt for _, fmt, _ in _FIELDS))
_CRC: Final = struct.Struct("<I")


def _record_dtype() -> np.dtype[np.void]:
    names, formats, offsets = [], [], []
    for i, (name, _, numpy_type) in enumerate(_FIELDS):
        if name is not None and numpy_type is not None:
            names.append(name)
            formats.append(numpy_type)
            offsets.append(struct.calcsize("<" + "".join(fmt for _, fmt, _ in _FIELDS[:i])))
    names.append("crc")
    formats.append("<u4")
    offsets.append(_BODY.size)
    spec = {"names": names, "formats": formats, "offsets": offsets, "itemsize": RECORD_SIZE}
    record: np.dtype[np.void] = np.dtype(spec)  # type: ignore[call-overload]
    return record


# A record as numpy reads it; its ``crc`` covers the first `RECORD_BODY_SIZE` bytes.
RECORD_DTYPE: Final = _record_dtype()
RECORD_BODY_SIZE: Final = _BODY.size
_HEADER: Final = struct.Struct("<8sI32sQ")
_DTYPES: Final = {"float32": 4, "float16": 2, "bfloat16": 2}
_MAX_U64: Final = 2**64 - 1


class Kind(enum.IntEnum):
    SEAL = 1
    RETIRE = 2  # the slot's blocks from ``block`` on are no longer trusted


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the pool holds and how it is laid out. Two engines share a pool only
    if their specs are equal (the header carries the spec's digest): the KV of
    another model, or another geometry, is never adopted.

    The arena is the engine's KV cache, keys then values, each
    ``(layers, slots, kv_heads, max_len, head_dim)``: a slot holds one
    sequence at the positions it has in that sequence, so adopting a prefix
    costs no copy, and a block ``(slot, b)`` is positions ``b*block_tokens``
    to ``(b+1)*block_tokens - 1`` of that slot, in every layer and head.
    """

    model: str  # digest of the model's configuration: which weights made the KV
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    slots: int
    max_len: int  # positions a slot holds
    block_tokens: int = BLOCK_TOKENS
    log_slack: int = 64  # ring records beyond twice the blocks (tests shrink it)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for name in ("layers", "kv_heads", "head_dim", "slots", "max_len", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.log_slack < 0:
            raise ValueError("log_slack must not be negative")
        if self.slots >= 2**16 or self.blocks_per_slot >= 2**32:
            raise ValueError("too many slots or blocks for the record format")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def blocks_per_slot(self) -> int:
        """Complete blocks a slot can hold (positions past the last are never sealed)."""
        return self.max_len // self.block_tokens

    @property
    def total_blocks(self) -> int:
        return self.slots * self.blocks_per_slot

    @property
    def log_capacity(self) -> int:
        """Records in the ring: at least twice the live seals there can be, so a
        write copies forward less than one live record on average."""
        return 2 * self.total_blocks + self.log_slack

    @property
    def log_offset(self) -> int:
        return HEADER_SIZE

    @property
    def arena_offset(self) -> int:
        end = HEADER_SIZE + self.log_capacity * RECORD_SIZE
        return -(-end // ARENA_ALIGN) * ARENA_ALIGN

    @property
    def cache_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, self.slots, self.kv_heads, self.max_len, self.head_dim)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the keys (and as many of the values)."""
        n = self.layers * self.slots * self.kv_heads * self.max_len * self.head_dim
        return n * self.itemsize

    @property
    def pool_bytes(self) -> int:
        return self.arena_offset + 2 * self.cache_bytes

    def as_json(self) -> dict[str, str | int]:  # the header's digest covers all of it
        return {
            "model": self.model,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "slots": self.slots,
            "max_len": self.max_len,
            "block_tokens": self.block_tokens,
            "log_slack": self.log_slack,
        }

    def digest(self) -> bytes:
        text = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).digest()


# --- header -------------------------------------------------------------------


def encode_header(spec: PoolSpec) -> bytes:
    """Magic, version, the spec's digest and the ring's capacity, then their CRC."""
    body = _HEADER.pack(MAGIC, VERSION, spec.digest(), spec.log_capacity)
    return body + _CRC.pack(zlib.crc32(body))


def decode_header(raw: bytes | memoryview) -> tuple[bytes, int] | None:
    """(spec digest, capacity) of a valid header; None for anything else (a
    fresh pool's zeros, a torn header, another version)."""
    size = _HEADER.size + _CRC.size
    if len(raw) < size:
        return None
    body = bytes(raw[: _HEADER.size])
    (crc,) = _CRC.unpack(bytes(raw[_HEADER.size : size]))
    if zlib.crc32(body) != crc:
        return None
    magic, version, digest, capacity = _HEADER.unpack(body)
    if magic != MAGIC or version != VERSION:
        return None
    return digest, capacity


def header_version(raw: bytes | memoryview) -> int | None:
    """The format version of a header that is intact (its CRC holds, its magic
    is ours), whatever the version; None for anything else. ``decode_header``
    refuses another version: this tells a pool written by an older engine from
    a fresh or torn one."""
    size = _HEADER.size + _CRC.size
    if len(raw) < size:
        return None
    body = bytes(raw[: _HEADER.size])
    (crc,) = _CRC.unpack(bytes(raw[_HEADER.size : size]))
    magic, version, _, _ = _HEADER.unpack(body)
    if zlib.crc32(body) != crc or magic != MAGIC:
        return None
    return int(version)


# --- records ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    gen: int
    kind: Kind
    slot: int
    block: int
    epoch: int
    chain: bytes = ROOT  # SEAL only
    checksum: int = 0  # SEAL only
    count: int = 0  # SEAL only: positions of the block it covers, from its first


def encode_record(rec: Record) -> bytes:
    body = _BODY.pack(
        rec.gen,
        rec.kind,
        rec.slot,
        rec.block,
        rec.epoch,
        rec.chain,
        rec.checksum & _MAX_U64,
        rec.count,
    )
    out = body + _CRC.pack(zlib.crc32(body))
    return out + bytes(RECORD_SIZE - len(out))


def decode_record(raw: bytes | memoryview) -> Record | None:
    """The record in ``raw`` (RECORD_SIZE bytes), or None if it is empty, torn or
    not one (its CRC fails, an unknown kind)."""
    if len(raw) < RECORD_SIZE:
        return None
    body = bytes(raw[: _BODY.size])
    (crc,) = _CRC.unpack(bytes(raw[_BODY.size : _BODY.size + _CRC.size]))
    if zlib.crc32(body) != crc:
        return None
    gen, kind, slot, block, epoch, chain_, checksum, count = _BODY.unpack(body)
    if gen == 0 or kind not in (Kind.SEAL, Kind.RETIRE):
        return None
    return Record(gen, Kind(kind), slot, block, epoch, chain_, checksum, count)


@dataclass(frozen=True, slots=True)
class LogRead:
    """What a reader trusts of a log: ``records`` in generation order."""

    records: tuple[Record, ...]
    next_gen: int  # the generation the next append takes
    torn: int  # ring positions that hold something that is not a valid record
    dropped: int  # valid records left out (older than a gap, or misplaced)


def read_log(raw: bytes | memoryview, capacity: int) -> LogRead:
    """The readable run of a ring of ``capacity`` records (module docstring)."""
    if capacity < 1 or len(raw) < capacity * RECORD_SIZE:
        raise ValueError(f"a log of {capacity} records needs {capacity * RECORD_SIZE} bytes")
    by_gen: dict[int, Record] = {}
    torn = misplaced = 0
    for i in range(capacity):
        chunk = raw[i * RECORD_SIZE : (i + 1) * RECORD_SIZE]
        rec = decode_record(chunk)
        if rec is None:
            if any(bytes(chunk)):
                torn += 1
            continue
        if rec.gen % capacity != i:
            misplaced += 1  # not where its generation puts it: not written by a Writer
            continue
        by_gen[rec.gen] = rec
    if not by_gen:
        return LogRead((), 1, torn, misplaced)
    newest = max(by_gen)
    gen = newest
    while gen - 1 in by_gen:  # one record a ring position: at most capacity long
        gen -= 1
    run = tuple(by_gen[g] for g in range(gen, newest + 1))
    return LogRead(run, newest + 1, torn, misplaced + len(by_gen) - len(run))


def read_from(raw: bytes | memoryview, capacity: int, gen: int) -> tuple[Record, ...] | None:
    """The records of a ring of ``capacity`` from generation ``gen`` on, in
    order, up to the first place that does not hold the next one yet (empty,
    torn, or an older record): a reader that follows a live log a few records
    at a time, not a whole ring. None where only a whole reading (`read_log`)
    says what the ring holds: a newer generation holds one of those places
    (the ring wrapped past what this reader last saw), or the place of
    ``gen - 1``, which it read, no longer holds that record or a newer one
    (the log was begun again: a pool an engine did not adopt)."""
    if capacity < 1 or gen < 1 or len(raw) < capacity * RECORD_SIZE:
        raise ValueError(f"a log of {capacity} records from generation {gen}")

    def at(g: int) -> Record | None:
        place = (g % capacity) * RECORD_SIZE
        return decode_record(raw[place : place + RECORD_SIZE])

    if gen > 1:
        before = at(gen - 1)
        if before is None or before.gen < gen - 1:
            return None
    out: list[Record] = []
    while len(out) < capacity:
        want = gen + len(out)
        rec = at(want)
        if rec is None or rec.gen < want:
            break
        if rec.gen > want:
            return None
        out.append(rec)
    return tuple(out)


# --- hashing ------------------------------------------------------------------


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block whose positions hold ``tokens``, after ``parent``'s."""
    h = hashlib.blake2b(parent, digest_size=CHAIN_BYTES)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


def chains(tokens: Sequence[int], block_tokens: int, parent: bytes = ROOT) -> list[bytes]:
    """The hash chain of every complete block of ``tokens``, from position 0."""
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = chain(parent, tokens[start : start + block_tokens])
        out.append(parent)
    return out


# Odd multipliers for the weights (the golden ratio's and a murmur constant's).
_ROW_MUL: Final = 0x9E3779B97F4A7C15
_COL_MUL: Final = 0xC2B2AE3D27D4EB4F


def word_dtype(row_bytes: int) -> type[np.unsignedinteger[Any]]:
    """The widest unsigned word that tiles a position's row of ``row_bytes``
    (a head's values at one position): the checksum's unit."""
    for dtype in (np.uint64, np.uint32, np.uint16):
        if row_bytes % np.dtype(dtype).itemsize == 0:
            return dtype
    return np.uint8


@functools.lru_cache(maxsize=8)
def checksum_weights(
    pieces: int, block_tokens: int, words: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """(row weights ``(pieces, block_tokens)``, column weights ``(pieces, words)``)
    of `block_checksum`: distinct odd and distinct even numbers mod 2**64."""
    rows = np.arange(pieces * block_tokens, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    cols = np.arange(pieces * words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    rows *= np.uint64(_ROW_MUL)  # odd times odd: odd (uint64 arrays wrap, mod 2**64)
    cols *= np.uint64(_COL_MUL)
    cols *= np.uint64(2)  # even
    rows.flags.writeable = cols.flags.writeable = False
    return rows.reshape(pieces, block_tokens), cols.reshape(pieces, words)


def block_checksum(words: npt.NDArray[np.unsignedinteger[Any]], block_tokens: int) -> int:
    """The checksum of a block (format version 2), given as its words
    ``(pieces, positions, words)``: the pieces are keys then values, layer by
    layer, head by head; ``positions`` the block's first ones that the seal
    covers (1..``block_tokens``); a position's row of a piece read as
    `word_dtype` words.

    Two weighted sums mod 2**64: each (piece, position)'s row sum times an odd
    weight, plus each (piece, word)'s column sum over the positions times an
    even one. A change confined to one word changes the two by the same delta
    d, so the checksum by d times an odd number: never 0 mod 2**64, so every
    change of one word (any of its bits, the sign or exponent of a value) is
    detected; a change of whole rows or columns (a position or a block written
    with other bytes, zeroed, moved) is missed only if its weighted sums cancel.
    It is not CRC-32 (version 1): numpy reads a block's bytes in two
    sums at memory speed, where ``zlib.crc32`` took 45,000 calls and 3-4x as
    long for the 184 MB a continuation of 4,000 positions of SmolLM2 adopts,
    all of it before the first token (docs/performance.md).
    """
    pieces, positions, n = words.shape
    if not 0 < positions <= block_tokens:
        raise ValueError(f"a block has 1..{block_tokens} positions, not {positions}")
    row_w, col_w = checksum_weights(pieces, block_tokens, n)
    rows = words.sum(axis=2, dtype=np.uint64)
    cols = words.sum(axis=1, dtype=np.uint64)
    by_rows = int((rows * row_w[:, :positions]).sum(dtype=np.uint64))
    by_cols = int((cols * col_w).sum(dtype=np.uint64))
    return (by_rows + by_cols) & _MAX_U64


# --- the index ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sealed:
    gen: int
    epoch: int
    chain: bytes
    checksum: int
    count: int  # positions covered, from the block's first


@dataclass(frozen=True, slots=True)
class Match:
    """A slot whose sealed blocks hold the first ``positions`` of the tokens looked
    up: ``blocks`` sealed blocks, the last of them possibly covered in part."""

    slot: int
    positions: int
    blocks: int


@dataclass(slots=True)
class Index:
    """The sealed blocks a log describes now: ``(slot, block) -> Sealed``."""

    spec: PoolSpec
    sealed: dict[tuple[int, int], Sealed] = field(default_factory=dict)
    ignored: int = 0  # records that named a block outside the pool, or a newer epoch

    @classmethod
    def replay(cls, spec: PoolSpec, records: Iterable[Record], epoch: int | None = None) -> Index:
        """The index after ``records`` in order. With ``epoch``, a record written
        under a newer epoch than that is ignored (a reader never trusts a writer
        that came after it)."""
        index = cls(spec)
        for rec in records:
            if epoch is not None and rec.epoch > epoch:
                index.ignored += 1
                continue
            index.apply(rec)
        return index

    def apply(self, rec: Record) -> None:
        if not (0 <= rec.slot < self.spec.slots and 0 <= rec.block < self.spec.blocks_per_slot):
            self.ignored += 1
            return
        if rec.kind is Kind.SEAL and not 0 < rec.count <= self.spec.block_tokens:
            self.ignored += 1
            return
        if rec.kind is Kind.SEAL:
            sealed = Sealed(rec.gen, rec.epoch, rec.chain, rec.checksum, rec.count)
            self.sealed[(rec.slot, rec.block)] = sealed
        else:
            for b in self.blocks_from(rec.slot, rec.block):
                del self.sealed[(rec.slot, b)]

    def blocks_from(self, slot: int, block: int) -> list[int]:
        """The sealed blocks of ``slot`` at ``block`` or later."""
        return sorted(b for (s, b) in self.sealed if s == slot and b >= block)

    def run(self, slot: int) -> int:
        """How many blocks of ``slot`` are sealed from block 0 on, without a hole."""
        n = 0
        while (slot, n) in self.sealed:
            n += 1
        return n

    def match(self, tokens: Sequence[int], slots: Iterable[int]) -> Match | None:
        """The slot among ``slots`` whose sealed blocks hold the longest prefix of
        ``tokens`` (whole blocks by their chain, then at most one block covered
        in part); None if none holds even one position."""
        best: Match | None = None
        for got in self.prefixes(tokens, slots):
            if got.positions and (best is None or got.positions > best.positions):
                best = got
        return best

    def prefixes(
        self, tokens: Sequence[int], slots: Iterable[int], hashes: Sequence[bytes] | None = None
    ) -> list[Match]:
        """For each of ``slots``, how much of a prefix of ``tokens`` its sealed
        blocks hold (`match`'s measure; 0 positions for none). ``hashes``:
        ``chains(tokens, block_tokens)``, where the caller has them."""
        if hashes is None:
            hashes = chains(tokens, self.spec.block_tokens)
        return [self._prefix(slot, tokens, hashes) for slot in slots]

    def held(self) -> dict[int, int]:
        """The positions each slot's sealed blocks cover (slots with none: absent)."""
        held: dict[int, int] = {}
        for (slot, _), sealed in self.sealed.items():
            held[slot] = held.get(slot, 0) + sealed.count
        return held

    def _prefix(self, slot: int, tokens: Sequence[int], hashes: Sequence[bytes]) -> Match:
        b = self.spec.block_tokens
        block, parent = 0, ROOT
        while (got := self.sealed.get((slot, block))) is not None:
            if got.count == b:
                if block >= len(hashes) or got.chain != hashes[block]:
                    break
                parent = hashes[block]
                block += 1
                continue
            start, end = block * b, block * b + got.count  # a sequence's last block, in part
            if end <= len(tokens) and got.chain == chain(parent, tokens[start:end]):
                return Match(slot, end, block + 1)
            break
        return Match(slot, block * b, block)


# --- the writer ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Write:
    """Put ``data`` (one record) at byte ``offset`` of the log region."""

    offset: int
    data: bytes
    record: Record


@dataclass(slots=True)
class Writer:
    """Plans appends to a ring of ``capacity`` records, keeping ``index`` current.

    Each call returns the writes to carry out, in order; the caller must carry
    them out in that order (a seal record after the block's bytes, a retire
    before them). A record about to be overwritten while it still seals a live
    block is first copied to the head of the ring (in the place it leaves), so
    the ring forgets nothing that is still true.
    """

    index: Index
    epoch: int
    next_gen: int = 1
    _live: dict[int, tuple[int, int]] = field(init=False)  # gen -> (slot, block)

    def __post_init__(self) -> None:
        if self.next_gen < 1:
            raise ValueError("generations start at 1")
        self._live = {s.gen: key for key, s in self.index.sealed.items()}

    @property
    def capacity(self) -> int:
        return self.index.spec.log_capacity

    def seal(
        self, slot: int, block: int, chain_: bytes, checksum: int, count: int | None = None
    ) -> list[Write]:
        """Seal ``count`` positions of the block (all of them by default); a seal
        of the same block supersedes the one before (a growing last block)."""
        self._check(slot, block)
        count = self.index.spec.block_tokens if count is None else count
        if len(chain_) != CHAIN_BYTES:
            raise ValueError(f"a chain hash has {CHAIN_BYTES} bytes")
        if not 0 < count <= self.index.spec.block_tokens:
            raise ValueError(f"a seal covers 1..{self.index.spec.block_tokens} positions")
        rec = Record(0, Kind.SEAL, slot, block, self.epoch, chain_, checksum, count)
        return self._append(rec)

    def retire(self, slot: int, block: int) -> list[Write]:
        """Stop trusting ``slot``'s blocks from ``block`` on (nothing to write if
        none of them is sealed)."""
        self._check(slot, block)
        if not self.index.blocks_from(slot, block):
            return []
        return self._append(Record(0, Kind.RETIRE, slot, block, self.epoch))

    def _check(self, slot: int, block: int) -> None:
        spec = self.index.spec
        if not (0 <= slot < spec.slots and 0 <= block < spec.blocks_per_slot):
            raise ValueError(f"no block {block} in slot {slot}")

    def _append(self, rec: Record) -> list[Write]:
        writes: list[Write] = []
        while True:
            gen = self.next_gen
            evicted = self._live.pop(gen - self.capacity, None)
            if evicted is None:
                break
            # A live seal sits where the next record goes: copy it forward first.
            old = self.index.sealed[evicted]
            copy = Record(gen, Kind.SEAL, *evicted, old.epoch, old.chain, old.checksum, old.count)
            writes.append(self._put(copy))
        writes.append(self._put(replace(rec, gen=self.next_gen)))
        return writes

    def _put(self, rec: Record) -> Write:
        key = (rec.slot, rec.block)
        if rec.kind is Kind.SEAL:
            before = self.index.sealed.get(key)
            if before is not None:
                self._live.pop(before.gen, None)
            self._live[rec.gen] = key
        else:
            for b in self.index.blocks_from(rec.slot, rec.block):
                self._live.pop(self.index.sealed[(rec.slot, b)].gen, None)
        self.index.apply(rec)
        self.next_gen = rec.gen + 1
        offset = (rec.gen % self.capacity) * RECORD_SIZE
        return Write(offset, encode_record(rec), rec)


def touched(spec: PoolSpec, before: int, after: int) -> Iterator[tuple[int, int]]:
    """(block, positions of it filled) for every block written into when a slot's
    filled positions went from ``before`` to ``after`` (counts from 0)."""
    b = spec.block_tokens
    if after <= before:
        return
    for block in range(before // b, min(-(-after // b), spec.blocks_per_slot)):
        yield block, min(b, after - block * b)
