"""Allocation records and the layout hash (pure).

The layout hash identifies *what was committed*: the allocations in the order
they were made (size, tag) and the metadata records (tensor names, dtypes,
shapes, offsets) — never the contents, and never the server-local ids, so
that the same model loaded twice into a fresh GMS has the same hash. A
sleeping engine compares it on wake (``remap``) to detect that the memory it
mapped before is not the memory that is committed now (a GMS that restarted
while it slept, and was loaded again since).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Same default as CUDA VMM's minimum granularity on current GPUs, so the host
# backend lays memory out the way the cuda backend will.
DEFAULT_GRANULARITY = 2 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    """One allocation as the server knows it. ``size`` is the aligned size."""

    id: int
    size: int
    requested: int
    tag: str


@dataclass(frozen=True, slots=True)
class MetadataRecord:
    """A small record pointing into allocations, kept as canonical JSON."""

    key: str
    value_json: str


def align_up(size: int, granularity: int) -> int:
    if granularity <= 0 or granularity & (granularity - 1):
        raise ValueError(f"granularity must be a positive power of two, got {granularity}")
    return (size + granularity - 1) // granularity * granularity


def canonical_json(value: object) -> str:
    """Key-sorted, whitespace-free JSON: equal values give equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def layout_hash(allocations: Iterable[AllocationRecord], metadata: Iterable[MetadataRecord]) -> str:
    """sha256 over (order, size, tag) of allocations and the sorted metadata."""
    doc = {
        "allocations": [[i, a.size, a.tag] for i, a in enumerate(allocations)],
        "metadata": sorted([m.key, m.value_json] for m in metadata),
    }
    return hashlib.sha256(canonical_json(doc).encode()).hexdigest()


def metadata_dict(metadata: Iterable[MetadataRecord]) -> dict[str, object]:
    return {m.key: json.loads(m.value_json) for m in metadata}


def put_metadata(
    metadata: tuple[MetadataRecord, ...], key: str, value: Mapping[str, object]
) -> tuple[MetadataRecord, ...]:
    """A new tuple with ``key`` set to ``value`` (replacing, order kept)."""
    record = MetadataRecord(key, canonical_json(value))
    kept = tuple(m for m in metadata if m.key != key)
    if len(kept) == len(metadata):
        return (*metadata, record)
    return tuple(record if m.key == key else m for m in metadata)
