"""A `llama` decode step at a long context against one at 16 positions.

The 1.3x bound of issue 32 (kill -> next token at 4,000 tokens against 16)
rests first on what one decode step costs at each context: SmolLM2's 30
layers read 540 MB of weights a step whatever the context, and 184 MB more
of keys and values at 4,000 positions. This times steady steps of the
engine's own model (`LlamaModel.decode`, the C kernels, one row) at 16
positions and at ``--positions``, in blocks that alternate, in one process,
with the CPU time the process spent a step (every thread's).

``--against REV``: the kernels of another revision too (its ``_decode.c``,
from git, built here with the package's flags), alternated block by block
with this tree's in the same process: a baseline from the same minutes. It
prints p50s and the long / 16 ratio for each, with a bootstrap 90 %
interval over the blocks' pairs, and writes
``bench/results/decode_context.json``.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/decode_context.py [--against HEAD~1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, ratio_interval, summary, warn_forced_openblas, write_results

from understudy.engine_shim.adapters import decode_kernels
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.adapters.llama_model import KVCache, LlamaModel, Row

SHORT = 16
SOURCE = "engine_shim/src/understudy/engine_shim/adapters/_decode.c"
FLAGS = (
    "-O3",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-Wno-psabi",
)  # engine_shim/pyproject.toml's
ROOT = Path(__file__).resolve().parent.parent


def build(rev: str, into: Path) -> Path:
    """``rev``'s kernels, built as a library of their own (ctypes loads it
    beside the installed one: its workers are its own)."""
    source = into / "decode.c"
    text = subprocess.check_output(["git", "-C", str(ROOT), "show", f"{rev}:{SOURCE}"])
    if b"understudy_decode_spin_us" not in text:  # before 2026-12-07: no spin to set
        text += b"\nlong understudy_decode_spin_us(long us) { (void)us; return 0; }\n"
    source.write_bytes(text)
    lib = into / "decode.so"
    cmd = ["cc", *FLAGS, "-fPIC", "-shared", "-pthread", "-o", str(lib), str(source), "-lm"]
    subprocess.run(cmd, check=True)
    return lib


def block(model: LlamaModel, cache: KVCache, position: int, steps: int) -> tuple[float, float]:
    """The p50 of ``steps`` steps at ``position``, after two untimed ones, and
    the CPU time the process spent a step (every thread's: the workers' spin
    too)."""
    for _ in range(2):
        model.decode([Row(0, position, 5)], cache)
    out = []
    cpu0 = time.process_time()
    for _ in range(steps):
        t0 = time.perf_counter()
        model.decode([Row(0, position, 5)], cache)
        out.append(time.perf_counter() - t0)
    return float(np.median(out)), (time.process_time() - cpu0) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=12, help="blocks of each (mode, context)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps a block")
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--against", help="a git revision whose kernels run alternated with these")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    warn_forced_openblas()
    kernels = decode_kernels.kernels
    if kernels is None:
        print("the package was built without its C kernels: nothing to time", file=sys.stderr)
        return 1
    engine = LlamaEngine(args.model, ("--kv-pool", "off"))
    engine.attach_private()
    model = engine.model
    assert isinstance(model, LlamaModel)
    c = model.config
    # Keys and values of random normals: the step's cost does not go by them.
    cache = KVCache(c, 1, args.positions + 8)
    rng = np.random.default_rng(0)
    shape = (c.num_kv_heads, args.positions + 1, c.head_dim)
    for layer in range(c.num_layers):
        cache.k[layer][0, :, : args.positions + 1] = rng.standard_normal(shape, np.float32)
        cache.v[layer][0, :, : args.positions + 1] = rng.standard_normal(shape, np.float32)
    forms = {"this tree": kernels}
    scratch = tempfile.TemporaryDirectory()
    if args.against:
        forms[args.against] = decode_kernels.Kernels(
            str(build(args.against, Path(scratch.name))), kernels.threads
        )
    for form in forms.values():
        form.start()
    load_at_start = os.getloadavg()[0]
    p50s: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    names = list(forms)
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else names[::-1]:  # neither always first
            model.decode_attention = forms[name]  # type: ignore[misc]
            for position in (SHORT, args.positions):
                wall, spent = block(model, cache, position, args.steps)
                p50s.setdefault(f"{name}: {position}", []).append(wall)
                cpu.setdefault(f"{name}: {position}", []).append(spent)
    model.decode_attention = kernels  # type: ignore[misc]
    scratch.cleanup()
    results = {name: summary(s) for name, s in p50s.items()}
    cpu_results = {name: summary(s) for name, s in cpu.items()}
    print_table(
        f"a decode step of {args.model}, one row, {kernels.threads} attention threads "
        f"(each sample a block's p50 of {args.steps} steps)",
        results,
    )
    print_table("the process's CPU time a step, every thread (a block's mean)", cpu_results)
    ratios: dict[str, Any] = {}
    print(f"\n{args.positions} / {SHORT}, p50 (90 % interval over the blocks' pairs):")
    for name in names:
        long, short = p50s[f"{name}: {args.positions}"], p50s[f"{name}: {SHORT}"]
        r = results[f"{name}: {args.positions}"]["p50"] / results[f"{name}: {SHORT}"]["p50"]
        lo, hi = ratio_interval(list(zip(long, short, strict=True)))
        ratios[name] = {"ratio": r, "interval_90": [lo, hi]}
        print(f"  {name:12} {r:.3f}x  ({lo:.3f}-{hi:.3f})")
    payload: dict[str, Any] = {
        "unit": "seconds",
        "model": args.model,
        "positions": args.positions,
        "attention_threads": kernels.threads,
        "against": args.against,
        "rounds": args.rounds,
        "steps": args.steps,
        "load_at_start": load_at_start,
        "load_at_end": os.getloadavg()[0],
        "results": results,
        "cpu_per_step": cpu_results,
        "ratios": ratios,
    }
    write_results("decode_context", payload, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
