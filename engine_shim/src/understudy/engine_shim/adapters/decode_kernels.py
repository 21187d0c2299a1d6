"""A decode step's attention and products in C, where the package was built with them.

`llama_model.LlamaModel.decode` spends its step in two places numpy serves
badly on a CPU (docs/performance.md):

* **attention**, a row over its own sequence: numpy's forms read a KV head's
  keys once per query head sharing it and its values again per query head
  (SmolLM2: 3 each); `attend` reads each once, in chunks the L1 cache
  holds, and takes the softmax in the same call. SmolLM2's 30 layers at
  4,000 positions, one core: 15 ms against 24-30. A row of more than 512
  positions goes in parts, on `threads` cores (the caller's and the
  library's own workers): 24 ms against 14 on two cores of this project's
  Intel machine, whose one core reads memory at half the rate two do. A
  worker waits awake 2 ms for the next row before it sleeps (a step posts
  one a layer; `SPIN_ENV` sets it, 0: at once), and the rows ahead are
  prefetched: a step at 4,000 positions 58.9 ms against 63.1
  (docs/performance.md, 2026-12-07).
* **products**, the step's rows times each weight: numpy's form hands BLAS
  one small product per group of 8 weight rows; `products` streams each
  weight once through tiles of 4 rows x 3 weight rows held in AVX2
  registers (AVX2 and FMA CPUs only).

Both keep a row's bits a function of the row alone, by construction (the C
file's comments say how), which is what a failover's byte-identical
continuation rests on.

`attend` also sums the KV pool's block checksums of the positions it reads,
when given a `BlockSums`: a failover's first step checks the blocks it
adopted as it reads them, instead of a thread reading them a second time
beside it (kvpool's ``claim``, ``in_step``).

The kernels are an optional part of the package: setuptools builds them
where a C compiler is found (``pip install``, ``hack/setup``, the image's
build stage) and installs the package without them where none is. `kernels`
is None then, or where ``UNDERSTUDY_DECODE_KERNELS=numpy`` asks for numpy's
forms, and the model keeps those. Every engine of a pod runs one installed
package on one CPU, so a failover's next engine computes a stream's rows the
way the engine that began it did.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt

from understudy.engine_shim.kvpool import BlockSums

__all__ = [
    "BLOCK",
    "ENV",
    "SPIN_ENV",
    "THREADS_ENV",
    "Kernels",
    "Sums",
    "built",
    "cpu_share",
    "kernels",
    "spin_wanted",
    "sums_of",
    "threads_wanted",
]

F32 = npt.NDArray[np.float32]
_T = TypeVar("_T")

BLOCK: Final = 16
"""The positions of a block whose checksums `attend` sums (the C file's)."""

ENV: Final = "UNDERSTUDY_DECODE_KERNELS"
"""``numpy``: numpy's forms even where the kernels are built (a benchmark's
baseline, or a pod whose engines must match one built without them)."""

THREADS_ENV: Final = "UNDERSTUDY_DECODE_THREADS"
"""The cores a row's attention may use (`threads_wanted`); 1: the calling
thread alone. A row's bits are the same whatever the number."""

SPIN_ENV: Final = "UNDERSTUDY_DECODE_SPIN_US"
"""How long a worker waits awake for a step's next row before it sleeps, in
microseconds (`spin_wanted`; unset: 2,000); 0: it sleeps at once, for a
node whose other CPU has better to do than wait (OpenMP's
``OMP_WAIT_POLICY=passive``). The bits are the same either way."""

DEFAULT_THREADS: Final = 2
"""The most the default takes: two cores halve the attention's read at 4,000
positions on this project's machines; more were never measured."""

CPU_MAX: Final = Path("/sys/fs/cgroup/cpu.max")

_MODULE: Final = "understudy.engine_shim.adapters._decode"

log = logging.getLogger("understudy.engine_shim.decode_kernels")


class Sums(ctypes.Structure):
    """The C file's ``struct sums``: a `BlockSums` at a layer (`sums_of`)."""

    _fields_ = [
        ("blocks", ctypes.c_ssize_t),
        ("total", ctypes.c_void_p),
        ("key_rows", ctypes.c_void_p),
        ("key_cols", ctypes.c_void_p),
        ("value_rows", ctypes.c_void_p),
        ("value_cols", ctypes.c_void_p),
    ]


class Kernels:
    """The C functions over ctypes."""

    HEAD_DIMS: Final = (64, 128)
    MAX_REP: Final = 16

    def __init__(self, path: str, threads: int = 1, spin_us: int | None = None) -> None:
        lib = ctypes.CDLL(path)
        ptr, size, i32 = ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int
        attend = lib.understudy_decode_attention
        attend.argtypes = [ptr, ptr, ptr, size, size, i32, i32, i32, ptr, ctypes.POINTER(Sums)]
        attend.restype = i32
        products = lib.understudy_products
        products.argtypes = [ptr, ptr, ptr, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
        products.restype = i32
        supported = lib.understudy_products_supported
        supported.restype = i32
        set_threads = lib.understudy_decode_threads
        set_threads.argtypes = [i32]
        set_threads.restype = i32
        start = lib.understudy_decode_start
        start.restype = i32
        spin = lib.understudy_decode_spin_us
        spin.argtypes = [ctypes.c_long]
        spin.restype = ctypes.c_long
        self._attend, self._products, self._threads = attend, products, set_threads
        self._start, self._spin = start, spin
        self.path: Final = path
        self.set_threads(threads)
        if spin_us is not None:
            self.set_spin_us(spin_us)
        self.has_products: Final = bool(supported())
        """Whether this CPU runs `products` (AVX2 and FMA)."""

    @property
    def threads(self) -> int:
        """The cores a row's attention uses: one setting per process, the C
        library's (it clamps it to 1..8)."""
        return int(self._threads(0))

    def set_threads(self, threads: int) -> int:
        """Sets `threads` (1 or more; a row's bits do not change); the number
        in force."""
        if threads < 1:
            raise ValueError(f"decode attention threads: {threads}, where 1 or more are needed")
        return int(self._threads(threads))

    @property
    def spin_us(self) -> int:
        """How long a worker that took parts waits awake for the next row
        before it sleeps, in microseconds (the C file's ``spin_ns``)."""
        return int(self._spin(-1))

    def set_spin_us(self, us: int) -> int:
        """Sets `spin_us` (0: sleep at once); the microseconds in force."""
        if us < 0:
            raise ValueError(f"decode workers' spin: {us} us, where 0 or more are needed")
        return int(self._spin(us))

    def start(self) -> int:
        """Start the library's workers now, not at a row's first use of them
        (the C file's ``understudy_decode_start`` says why); those running."""
        return int(self._start())

    def takes(self, kv_heads: int, rep: int, head_dim: int) -> bool:
        """Whether `attend` computes heads of this shape (else numpy's form)."""
        return head_dim in self.HEAD_DIMS and 1 <= rep <= self.MAX_REP and kv_heads >= 1

    def takes_products(self, weights: list[F32]) -> bool:
        """Whether `products` runs on this CPU and takes every one of ``weights``
        (float32, C-contiguous, rows a multiple of 8 floats wide)."""
        return self.has_products and all(
            w.dtype == np.float32 and w.ndim == 2 and w.flags.c_contiguous and w.shape[1] % 8 == 0
            for w in weights
        )

    def attend(
        self,
        q: F32,
        keys: F32,
        values: F32,
        length: int,
        out: F32,
        sums: BlockSums | None = None,
        layer: int = 0,
    ) -> None:
        """``out`` (kv_heads, rep, d) = softmax(q kᵀ) v over the first ``length``
        positions of ``keys`` and ``values`` (kv_heads, max_len, d), for ``q``
        (kv_heads, rep, d), scaled already. Each head's positions must be
        contiguous rows of d floats (a `KVCache` slot's are); q and out
        C-contiguous. With ``sums``, the words of every head's keys and values
        of its blocks are added to their checksums, with ``layer``'s weights."""
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
        if sums is not None and sums.total.size * BLOCK > length:
            raise ValueError(f"block sums of {sums.total.size} blocks past {length} positions")
        rc = self._attend(
            q.ctypes.data,
            keys.ctypes.data,
            values.ctypes.data,
            keys.strides[0] // 4,
            length,
            kvh,
            rep,
            d,
            out.ctypes.data,
            None if sums is None else ctypes.byref(sums_of(sums, layer, kvh, d)),
        )
        if rc != 0:
            raise MemoryError(f"decode attention: the kernel refused {q.shape} over {length}")

    def products(self, x: F32, weight: F32) -> F32:
        """x (rows, in) @ weight.T, a row's bits its own (module docstring);
        ``weight`` one `takes_products` took."""
        rows, width = x.shape
        if weight.shape[1] != width or x.dtype != np.float32 or rows < 1:
            raise ValueError(f"products: x {x.dtype}{x.shape} against weight {weight.shape}")
        x = np.ascontiguousarray(x)
        out = np.empty((rows, weight.shape[0]), dtype=np.float32)
        rc = self._products(
            x.ctypes.data, weight.ctypes.data, out.ctypes.data, rows, weight.shape[0], width
        )
        if rc != 0:
            raise ValueError(f"products: the kernel refused x {x.shape} against {weight.shape}")
        return out


def sums_of(sums: BlockSums, layer: int, kv_heads: int, head_dim: int) -> Sums:
    """The C struct of ``sums`` at ``layer``, its arrays checked: the kernel
    writes into ``total`` and reads the weights by these shapes."""
    layers = sums.rows.shape[1]
    if not (
        0 <= layer < layers
        and sums.rows.shape == (2, layers, kv_heads, BLOCK)
        and sums.cols.shape == (2, layers, kv_heads, head_dim // 2)
        and sums.total.ndim == 1
        and sums.total.flags.writeable
        and all(a.dtype == np.uint64 for a in (sums.rows, sums.cols, sums.total))
        and all(a.flags.c_contiguous for a in (sums.rows, sums.cols, sums.total))
    ):
        raise ValueError(
            f"block sums: rows {sums.rows.dtype}{sums.rows.shape}, cols {sums.cols.dtype}"
            f"{sums.cols.shape}, total {sums.total.dtype}{sums.total.shape} at layer {layer}:"
            f" not for {kv_heads} heads of {head_dim}"
        )
    rows, cols = sums.rows[:, layer], sums.cols[:, layer]
    return Sums(
        sums.total.size,
        sums.total.ctypes.data,
        rows[0].ctypes.data,
        cols[0].ctypes.data,
        rows[1].ctypes.data,
        cols[1].ctypes.data,
    )


def cpu_share(cpu_max: Path = CPU_MAX) -> int:
    """The whole CPUs this process may use: its affinity, within its cgroup's
    CPU limit (cgroup v2 ``cpu.max``; a pod's ``limits.cpu``) where it has one.
    At least 1."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
        limit = cpus if quota == "max" else int(quota) // int(period)
    except (OSError, ValueError):  # no cgroup v2 here, or a file we do not know
        limit = cpus
    return max(1, min(cpus, limit))


def _whole(name: str, least: int, unit: str, environ: dict[str, str] | None) -> int | None:
    """The environment's ``name`` as a whole number of ``unit`` (``least`` or
    more), or None where it is unset or empty."""
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < least:
        raise ValueError(f"{name}={raw!r}: a whole number of {unit}, {least} or more")
    return int(raw)


def threads_wanted(environ: dict[str, str] | None = None) -> int:
    """`THREADS_ENV`, or else the CPU share up to `DEFAULT_THREADS`."""
    wanted = _whole(THREADS_ENV, 1, "threads", environ)
    return min(DEFAULT_THREADS, cpu_share()) if wanted is None else wanted


def spin_wanted(environ: dict[str, str] | None = None) -> int | None:
    """`SPIN_ENV` in microseconds, or None (the library's 2 ms)."""
    return _whole(SPIN_ENV, 0, "microseconds", environ)


def built(module: str, wrap: Callable[[str], _T]) -> _T | None:
    """``wrap`` of the C library the package built as ``module``, or None
    where it was built without it, or the build is stale or foreign (the
    caller's Python forms then)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    try:
        return wrap(spec.origin)
    except (OSError, AttributeError) as exc:
        log.warning("C kernels not loaded from %s: %s", spec.origin, exc)
        return None


kernels: Final = (
    None
    if os.environ.get(ENV, "") == "numpy"
    else built(_MODULE, functools.partial(Kernels, threads=threads_wanted(), spin_us=spin_wanted()))
)
"""The built kernels, or None (numpy's forms): module docstring."""
