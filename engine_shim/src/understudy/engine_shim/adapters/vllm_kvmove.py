"""The ``vllm`` engine's KV moves in C, where the package was built with them.

The KV connector (`vllm_kvconn`) copies positions between the pool's slots
and vLLM-CPU's paged cache: after every step the positions it computed into
the pool, and at a failover the adopted positions into the next engine's
blocks, which its first step waits for (4,000 positions of SmolLM2: 184 MB).
vLLM-CPU keeps a block's keys transposed, and torch's strided copy of them
took twice as long as a plain copy of as many bytes; `Mover.move` transposes
them in tiles of 8 x 8 in registers (the end of ``_decode.c``, whose
checksums' code a failover's load shares: given a `BlockSums`, it sums the
adopted blocks as it copies them, so the claim's checksums need no read of
their own; docs/performance.md).

An optional part of the package, as the decode kernels are
(`decode_kernels.built`): `mover` is None where it was built without them,
or where ``UNDERSTUDY_KV_MOVE=torch`` asks for torch's copies (a benchmark's
baseline). Either way the copies are exact: a sealed position's bits, and
so its checksum, arrive unchanged.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from understudy.engine_shim.adapters.decode_kernels import Sums, built, sums_of
from understudy.engine_shim.kvpool import BlockSums

__all__ = ["ENV", "Mover", "mover"]

ENV: Final = "UNDERSTUDY_KV_MOVE"
"""``torch``: the connector's torch copies even where the C moves are built."""

_MODULE: Final = "understudy.engine_shim.adapters._decode"


class Mover:
    """The C function over ctypes."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        ptr, size, i32 = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int
        move = lib.understudy_kv_move
        move.argtypes = [ptr, ptr, size, size, ptr, size, i32, i32, i32, i32, ptr, size, size]
        move.argtypes += [size, i32, ctypes.POINTER(Sums)]
        move.restype = i32
        self._move = move
        self.path: Final = path

    def move(
        self,
        keys: npt.NDArray[np.float32],
        values: npt.NDArray[np.float32],
        caches: npt.NDArray[np.uintp],
        cache_blocks: int,
        block_size: int,
        table: Sequence[int],
        start: int,
        end: int,
        *,
        into_pool: bool,
        sums: BlockSums | None = None,
    ) -> None:
        """Positions ``start..end-1`` of every layer and head between a pool
        slot's ``keys`` and ``values`` (layers, kv_heads, max_len, head_dim;
        rows contiguous) and vLLM-CPU's caches: ``caches`` holds each layer's
        address, a contiguous float32 ``[cache_blocks, kv_heads, block_size,
        2 * head_dim]``; ``table`` is the sequence's block ids. ``into_pool``:
        a save; else a load. ``sums`` (a load's): the pool's blocks from
        ``start`` (a block's first position) to ``sums.total.size`` are
        added to their checksums as they are copied. ValueError for
        arguments out of range, and then nothing is written."""
        layers, heads, max_len, dim = keys.shape
        if not (
            keys.dtype == values.dtype == np.float32
            and keys.shape == values.shape
            and keys.strides == values.strides
            and keys.strides[2:] == (4 * dim, 4)
            and caches.shape == (layers,)
            and 0 <= start <= end <= max_len
            and (not into_pool or (keys.flags.writeable and values.flags.writeable))
            and (sums is None or sums.rows.shape[1] == layers)
        ):
            raise ValueError(
                f"KV move: pool {keys.dtype}{keys.shape} strides {keys.strides}, "
                f"{caches.shape} caches, positions {start}..{end}: not the move's layout"
            )
        ids = np.asarray(table, dtype=np.int64)
        rc = self._move(
            keys.ctypes.data,
            values.ctypes.data,
            keys.strides[0] // 4,
            keys.strides[1] // 4,
            caches.ctypes.data,
            cache_blocks,
            layers,
            heads,
            dim,
            block_size,
            ids.ctypes.data,
            ids.size,
            start,
            end,
            int(into_pool),
            None if sums is None else ctypes.byref(sums_of(sums, 0, heads, dim)),
        )
        if rc != 0:
            raise ValueError(
                f"KV move: positions {start}..{end} over {ids.size} blocks of {block_size}"
                f" (ids {ids.min(initial=0)}..{ids.max(initial=0)} of {cache_blocks})"
            )


mover: Final = None if os.environ.get(ENV, "") == "torch" else built(_MODULE, Mover)
"""The built moves, or None (torch's copies): module docstring."""
