"""Weights from a safetensors file packed into one buffer, and zero-copy views back.

What every engine that keeps its weights in GMS needs, whatever the model:

* `weights_manifest` reads the safetensors header (names, dtypes, shapes,
  byte ranges) without loading any data;
* `pack_into` copies every tensor straight from the file into ONE
  caller-owned buffer (a GMS allocation) at 64-byte aligned offsets and
  returns JSON-ready records ``{name, dtype, shape, offset, nbytes}`` to store
  beside it (GMS metadata); `packed_size` says how big that buffer must be;
* `views_from` is the inverse: zero-copy, read-only numpy views over a buffer
  and its records. A read-only buffer (``mmap`` with ``PROT_READ``, an
  imported GMS allocation) works. The views keep the buffer exported, so an
  ``mmap`` cannot be closed while a model uses it.
"""

from __future__ import annotations

import json
import math
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypedDict

import numpy as np
import numpy.typing as npt

__all__ = [
    "ALIGNMENT",
    "WEIGHTS_FILE",
    "Buffer",
    "TensorRecord",
    "TensorSpec",
    "WeightsError",
    "layout",
    "pack_into",
    "packed_size",
    "views_from",
    "weights_manifest",
]

ALIGNMENT: Final = 64
"""Byte alignment of every tensor in a packed buffer (a cache line; AVX-512)."""

WEIGHTS_FILE: Final = "model.safetensors"

# safetensors dtype tag -> numpy dtype name. The format is little-endian; numpy
# has no bfloat16 (the reference models are float32, MiniLM plus one int64 buffer).
_DTYPES: Final[Mapping[str, str]] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_MAX_HEADER: Final = 100_000_000  # the cap of the safetensors reference reader

Buffer = bytes | bytearray | memoryview | mmap.mmap


class WeightsError(ValueError):
    """A weights file, a packed buffer or its records are malformed or do not fit."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    dtype: str  # numpy name, e.g. "float32"; data is little-endian
    shape: tuple[int, ...]
    nbytes: int
    file_offset: int  # absolute byte offset of the data in the file


class TensorRecord(TypedDict):
    """Where one tensor lives in a packed buffer; JSON-serialisable as is."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


def _le(dtype: str) -> np.dtype[np.generic]:
    return np.dtype(dtype).newbyteorder("<")


def _expected_nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _read_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """The safetensors header as a JSON object, where the data starts, and the
    file's size; reads nothing past the header."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise WeightsError(f"{path}: shorter than a safetensors header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > _MAX_HEADER:
            raise WeightsError(f"{path}: header of {header_len} bytes exceeds the cap")
        raw = f.read(header_len)
        if len(raw) != header_len:
            raise WeightsError(f"{path}: truncated header")
        file_size = f.seek(0, 2)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: header is not a JSON object")
    return header, 8 + header_len, file_size


def _spec(path: Path, name: str, entry: Any, data_start: int, file_size: int) -> TensorSpec:
    """One header entry, checked against its dtype, its shape and the file."""
    try:
        dtype = _DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"{path}: bad or unsupported entry {name!r}: {entry!r}") from e
    nbytes = end - begin
    if min(shape, default=0) < 0 or nbytes != _expected_nbytes(dtype, shape):
        raise WeightsError(f"{path}: {name!r}: {nbytes} bytes do not match {dtype}{shape}")
    if begin < 0 or data_start + end > file_size:
        raise WeightsError(f"{path}: {name!r}: data range lies outside the file")
    return TensorSpec(name, dtype, shape, nbytes, data_start + begin)


def weights_manifest(model_dir: Path | str) -> list[TensorSpec]:
    """Every tensor of ``model_dir/model.safetensors``, sorted by name; reads the header only."""
    path = Path(model_dir) / WEIGHTS_FILE
    header, data_start, file_size = _read_header(path)
    specs = [
        _spec(path, name, entry, data_start, file_size)
        for name, entry in header.items()
        if name != "__metadata__"
    ]
    specs.sort(key=lambda s: s.name)
    return specs


def layout(specs: Sequence[TensorSpec]) -> list[TensorRecord]:
    """Place ``specs`` one after another, in the given order, at ALIGNMENT-aligned offsets."""
    records: list[TensorRecord] = []
    offset = 0
    for s in specs:
        records.append(
            TensorRecord(
                name=s.name, dtype=s.dtype, shape=list(s.shape), offset=offset, nbytes=s.nbytes
            )
        )
        offset = -(-(offset + s.nbytes) // ALIGNMENT) * ALIGNMENT
    return records


def _extent(records: Sequence[TensorRecord]) -> int:
    return max((r["offset"] + r["nbytes"] for r in records), default=0)


def packed_size(model_dir: Path | str) -> int:
    """Bytes a buffer needs to hold every tensor of ``model_dir`` as `pack_into` lays them out."""
    return _extent(layout(weights_manifest(model_dir)))


def _byte_view(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise WeightsError("buffer is not contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def pack_into(buffer: Buffer, model_dir: Path | str) -> list[TensorRecord]:
    """Copy every tensor of ``model_dir`` into ``buffer``, straight from the file.

    Returns the records to store beside the buffer (e.g. as GMS metadata). Gaps
    between tensors are zeroed, so the buffer's bytes depend only on the file.
    """
    view = _byte_view(buffer)
    if view.readonly:
        raise WeightsError("cannot pack into a read-only buffer")
    specs = weights_manifest(model_dir)
    records = layout(specs)
    size = _extent(records)
    if view.nbytes < size:
        raise WeightsError(f"buffer holds {view.nbytes} bytes, the weights need {size}")
    cursor = 0
    with open(Path(model_dir) / WEIGHTS_FILE, "rb") as f:
        for spec, rec in zip(specs, records, strict=True):
            view[cursor : rec["offset"]] = bytes(rec["offset"] - cursor)
            f.seek(spec.file_offset)
            end = rec["offset"] + rec["nbytes"]
            done = rec["offset"]
            while done < end:
                n = f.readinto(view[done:end])
                if not n:
                    raise WeightsError(f"{spec.name}: file ended early")
                done += n
            cursor = end
    return records


def views_from(
    buffer: Buffer, records: Sequence[TensorRecord]
) -> dict[str, npt.NDArray[np.generic]]:
    """Zero-copy, read-only numpy views of the tensors that ``records`` place in ``buffer``."""
    view = _byte_view(buffer)
    arrays: dict[str, npt.NDArray[np.generic]] = {}
    for rec in records:
        name, dtype, offset, nbytes = rec["name"], rec["dtype"], rec["offset"], rec["nbytes"]
        shape = tuple(rec["shape"])
        if dtype not in _DTYPES.values():
            raise WeightsError(f"{name!r}: unsupported dtype {dtype!r}")
        if nbytes != _expected_nbytes(dtype, shape) or min(shape, default=0) < 0:
            raise WeightsError(f"{name!r}: {nbytes} bytes do not match {dtype}{shape}")
        if offset < 0 or offset % ALIGNMENT or offset + nbytes > view.nbytes:
            raise WeightsError(f"{name!r}: offset {offset} is unaligned or out of the buffer")
        if name in arrays:
            raise WeightsError(f"{name!r}: recorded twice")
        count = math.prod(shape)
        array = np.frombuffer(view, dtype=_le(dtype), count=count, offset=offset).reshape(shape)
        array.flags.writeable = False  # shared weights: no process may scribble on them
        arrays[name] = array
    return arrays
