"""What a KV cache in half precision would cost the `llama` engine's logits.

At 4,000 positions a decode step of SmolLM2 reads 184 MB of float32 keys
and values (docs/performance.md). Half the bytes would make that step
cheaper; this measures whether the logits would still hold the 1e-3 bound
that ``tests/vllm/test_smollm2.py`` holds against transformers.

One run of the engine's own model over a corpus prompt: a prefill, then one
decode step per token, with the cache as the engine keeps it (float32, the
baseline) and again with every key and value rounded to float16, then to
bfloat16, as it is written (each computed in float32 from the rounded
bytes, as a half-precision cache would be read). It prints, for each, the
largest logit difference at each step against the baseline's (p50, p99,
max), and how many greedy tokens differ. JSON: ``bench/results/kv_precision.json``.

    .venv/bin/python bench/kv_precision.py [--model builtin:smollm2-135m]
        [--prefill 200] [--steps 1000]

About 3-5 minutes on this 2-core machine (three runs of 1,000 steps).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads (see llama_model)

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import summary, write_results

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.adapters.llama_model import KVCache, Row
from understudy.engine_shim.adapters.models import resolve

F32 = npt.NDArray[np.float32]
BOUND = 1e-3  # tests/vllm/test_smollm2.py: any logit, against transformers


def float16(x: F32) -> F32:
    return x.astype(np.float16).astype(np.float32)


def bfloat16(x: F32) -> F32:
    """Round to nearest even on the upper 16 bits (numpy has no bfloat16)."""
    bits = x.view(np.uint32).astype(np.uint64)
    half = np.uint64(16)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> half) & np.uint64(1))) >> half << half
    return rounded.astype(np.uint32).view(np.float32)


ROUNDINGS: dict[str, Callable[[F32], F32] | None] = {
    "float32": None,
    "float16": float16,
    "bfloat16": bfloat16,
}


def run(
    engine: LlamaEngine, ids: list[int], prefill: int, rounding: Callable[[F32], F32] | None
) -> F32:
    """The logits of every decode step from position ``prefill`` on."""
    model = engine.model
    assert model is not None
    cache = KVCache(engine.config, 1, len(ids))
    model.prefill(ids[:prefill], cache, 0)
    if rounding is not None:
        cache.k[:, 0, :, :prefill] = rounding(cache.k[:, 0, :, :prefill])
        cache.v[:, 0, :, :prefill] = rounding(cache.v[:, 0, :, :prefill])
    rows = []
    for p in range(prefill, len(ids)):
        rows.append(model.decode([Row(0, p, ids[p])], cache)[0])
        if rounding is not None:  # the position this step wrote, as it would be stored
            cache.k[:, 0, :, p] = rounding(cache.k[:, 0, :, p])
            cache.v[:, 0, :, p] = rounding(cache.v[:, 0, :, p])
    return np.stack(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--prefill", type=int, default=200)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    engine = LlamaEngine(str(resolve(args.model)))
    engine.attach_private()
    engine.wake()
    ids = engine.encode(" ".join(tiny_llama.corpus()))[: args.prefill + args.steps]
    if len(ids) < args.prefill + args.steps:
        raise SystemExit(f"the corpus has {len(ids)} tokens: too few")
    logits = {name: run(engine, ids, args.prefill, r) for name, r in ROUNDINGS.items()}
    engine.close()
    base = logits["float32"]
    results = {}
    print(f"\n{args.model}: prefill {args.prefill}, {args.steps} decode steps; bound {BOUND:g}")
    print(f"{'KV stored as':14} {'p50':>9} {'p99':>9} {'max':>9}  {'greedy differs':>15}")
    for name in (n for n, rounding in ROUNDINGS.items() if rounding is not None):
        per_step = np.abs(logits[name] - base).max(axis=-1)
        s = summary([float(d) for d in per_step])
        differs = int((logits[name].argmax(-1) != base.argmax(-1)).sum())
        results[name] = {"max_abs_logit_diff_per_step": s, "greedy_differs": differs}
        cells = f"{s['p50']:>9.2e} {s['p99']:>9.2e} {s['max']:>9.2e}"
        print(f"{name:14} {cells}  {differs:>9} of {args.steps}")
        print(f"{'':14} max / bound {s['max'] / BOUND:.1f}x")
    write_results(
        "kv_precision",
        {
            "model": args.model,
            "prefill": args.prefill,
            "steps": args.steps,
            "bound": BOUND,
            "baseline": "the same run with the cache in float32",
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
