"""Shared by the benchmarks: percentiles, a printed table, JSON results.

Benchmarks run on demand (never from the test suite), measure a baseline in
the same run, and write their results to ``bench/results/<name>.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "min": min(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def ratio_interval(
    pairs: Sequence[tuple[float, float]], level: float = 0.9, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A bootstrap interval for ``p50(a) / p50(b)`` over ``(a, b)`` pairs.

    The pairs are resampled whole: where ``a`` and ``b`` ran alternately
    (round ``i`` of each, back to back), what drifts over a run (the
    machine's other work) moves both sides of a pair, and the interval
    shows the noise that is left, not the drift. A fixed seed makes the
    interval a function of the data."""
    if not pairs:
        raise ValueError("no pairs")
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        drawn = rng.choices(pairs, k=len(pairs))
        ratios.append(percentile([a for a, _ in drawn], 50) / percentile([b for _, b in drawn], 50))
    tail = (1 - level) / 2 * 100
    return percentile(ratios, tail), percentile(ratios, 100 - tail)


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "load1": os.getloadavg()[0],
        "openblas": openblas(),
    }


def openblas() -> dict[str, str | None]:
    """Which OpenBLAS kernels this process runs, and the variables that chose
    them. A machine can force a core (``OPENBLAS_CORETYPE``, e.g. Haswell's
    AVX2 kernels on an AVX-512 CPU, where old builds were wrong): numpy's
    float32 GEMMs then run at half the speed they have on a node that does
    not, so a result says which it measured."""
    core = None
    maps = Path("/proc/self/maps")
    libs = {line.split()[-1] for line in maps.read_text().splitlines() if "openblas" in line}
    for lib in sorted(libs):
        try:
            dll = ctypes.CDLL(lib)
        except OSError:
            continue
        for name in ("scipy_openblas_get_corename64_", "openblas_get_corename"):
            fn = getattr(dll, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                core = fn().decode()
                break
    return {
        "core": core,
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
    }


def stop_cleanly_on_sigterm() -> None:
    """A SIGTERM (``timeout``, ``kill``) ends the benchmark through its
    ``finally`` blocks, as Ctrl-C does, so that the pods and servers it
    started are stopped: they run in sessions of their own, and Python's
    default for SIGTERM would leave them running."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def warn_forced_openblas() -> None:
    """Say so when this environment forces OpenBLAS's kernels (`openblas`)."""
    if forced := os.environ.get("OPENBLAS_CORETYPE"):
        print(
            f"note: OPENBLAS_CORETYPE={forced} forces numpy's kernels; a node without it "
            "runs its CPU's own. To measure those: env -u OPENBLAS_CORETYPE "
            "-u OPENBLAS_L2_SIZE <this command>",
            flush=True,
        )


def print_table(
    title: str, rows: dict[str, dict[str, float]], unit: str = "ms", scale: float = 1000.0
) -> None:
    w = max(28, *map(len, rows))  # a long name would push its row's columns
    print(f"\n{title}")
    print(f"{'':{w}} {'n':>5} {'p50':>9} {'p95':>9} {'p99':>9} {'max':>9}  ({unit})")
    for name, s in rows.items():
        print(
            f"{name:{w}} {s['n']:>5} {s['p50'] * scale:>9.3f} {s['p95'] * scale:>9.3f} "
            f"{s['p99'] * scale:>9.3f} {s['max'] * scale:>9.3f}"
        )


def write_results(name: str, payload: dict[str, Any], out: Path | None = None) -> Path:
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nresults: {path}")
    return path
