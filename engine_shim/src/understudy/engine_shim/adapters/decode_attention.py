"""A decode row's attention in C, where the package was built with it.

`llama_model.LlamaModel.decode` attends each row over its own sequence. In
numpy that reads a KV head's keys once per query head sharing it and its
values again per query head (SmolLM2: 3 each); `_decode_attention.c` reads
each once, in chunks the L1 cache holds, and takes the softmax in the same
call. SmolLM2's 30 layers at 4,000 positions, one core: 15 ms against 24-30
(docs/performance.md).

The kernel is an optional part of the package: setuptools builds it where a
C compiler is found (``pip install``, ``hack/setup``) and installs the package
without it where none is (the image's base has none). `kernel` is None then,
or where ``UNDERSTUDY_DECODE_ATTENTION=numpy`` asks for numpy's form, and
the model keeps numpy's form. Every engine of a pod runs one installed
package, so a failover's next engine computes a stream's rows the same way
as the engine that began it; each form's bits depend only on the row's own
inputs (the kernel's comment says how).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["ENV", "Kernel", "kernel"]

F32 = npt.NDArray[np.float32]

ENV: Final = "UNDERSTUDY_DECODE_ATTENTION"
"""``numpy``: numpy's form even where the kernel is built (a benchmark's
baseline, or a pod whose engines must match one built without it)."""

_MODULE: Final = "understudy.engine_shim.adapters._decode_attention"

log = logging.getLogger("understudy.engine_shim.decode_attention")


class Kernel:
    """The C function over ctypes: one row's attention for every KV head."""

    HEAD_DIMS: Final = (64, 128)
    MAX_REP: Final = 16

    def __init__(self, path: str) -> None:
        fn = ctypes.CDLL(path).understudy_decode_attention
        ptr, size, i32 = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int
        fn.argtypes = [ptr, ptr, ptr, size, size, i32, i32, i32, ptr]
        fn.restype = i32
        self._fn = fn
        self.path: Final = path

    def takes(self, kv_heads: int, rep: int, head_dim: int) -> bool:
        """Whether the kernel computes heads of this shape (else numpy's form)."""
        return head_dim in self.HEAD_DIMS and 1 <= rep <= self.MAX_REP and kv_heads >= 1

    def attend(self, q: F32, keys: F32, values: F32, length: int, out: F32) -> None:
        """``out`` (kv_heads, rep, d) = softmax(q kᵀ) v over the first ``length``
        positions of ``keys`` and ``values`` (kv_heads, max_len, d), for ``q``
        (kv_heads, rep, d), scaled already. Each head's positions must be
        contiguous rows of d floats (a `KVCache` slot's are); q and out
        C-contiguous."""
        kvh, rep, d = q.shape
        if not (
            q.flags.c_contiguous
            and out.flags.c_contiguous
            and out.shape == q.shape
            and keys.shape == values.shape
            and keys.strides == values.strides
            and keys.strides[1:] == (4 * d, 4)
            and keys.shape[0] == kvh
            and keys.shape[2] == d
            and 1 <= length <= keys.shape[1]
            and q.dtype == keys.dtype == values.dtype == out.dtype == np.float32
        ):
            raise ValueError(
                f"decode attention: q {q.dtype}{q.shape}, keys and values {keys.dtype}"
                f"{keys.shape} strides {keys.strides} and {values.strides}, out"
                f" {out.dtype}{out.shape}, {length} positions: not the kernel's layout"
            )
        rc = self._fn(
            q.ctypes.data,
            keys.ctypes.data,
            values.ctypes.data,
            keys.strides[0] // 4,
            length,
            kvh,
            rep,
            d,
            out.ctypes.data,
        )
        if rc != 0:
            raise MemoryError(f"decode attention: the kernel refused {q.shape} over {length}")


def _load() -> Kernel | None:
    if os.environ.get(ENV, "") == "numpy":
        return None
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or spec.origin is None:
        return None
    try:
        return Kernel(spec.origin)
    except (OSError, AttributeError) as exc:  # a stale or foreign build: numpy's form
        log.warning("decode attention kernel not loaded from %s: %s", spec.origin, exc)
        return None


kernel: Final = _load()
"""The built kernel, or None (numpy's form): module docstring."""
