"""A decode step's matrix products four ways, on a model's own weights.

The `llama` engine's decode must give a row the same bits whatever rows
share its step (``llama_model``'s docstring), so its products cannot be
BLAS's GEMM of the step's rows. This measures one step's products, every
weight of the model once (SmolLM2: 30 layers x 7 matrices and the output
head, 540 MB of float32), at 1 and 8 rows:

* ``4-row products``: the form until 8844117, products of exactly 4 rows
  (zero-padded) over 512 KiB blocks of each weight, which OpenBLAS packs on
  every call (kept here as the baseline of history);
* ``per weight row``: the form from 8844117 until e81f46b, the rows
  padded to 8 and each weight row one ``(1, in) @ (in, 8)`` product of a
  stack that BLAS's matrix-vector kernel runs;
* ``by weight rows``: numpy's form the engine runs without its C kernels
  (``_by_weight_rows``), the same padding and each group of 8 weight rows
  one ``(8, in) @ (in, 8)`` product; the ratio's baseline;
* ``native``: the engine's C kernel (``decode_kernels.Kernels.products``,
  AVX2 and FMA, every element summed in one fixed order), what the engine
  runs where the package was built with it; skipped, and said so, where it
  was not or on a CPU without AVX2 and FMA.

Each form's invariance is checked too, on one weight of each shape: a row
alone against the same row at every place of a step of 8 and of 16 rows.
The weights are packed into anonymous page-aligned memory, as the engine
packs them into GMS's (4 KiB pages), and read as the engine reads them.

    PYTHONPATH=$(ls -d $PWD/*/src | paste -sd:) .venv/bin/python bench/decode_products.py
        [--model builtin:smollm2-135m] [--repeats 7]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads (see llama_model)

import argparse
import mmap
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, summary, warn_forced_openblas, write_results

from understudy.engine_shim.adapters import decode_kernels, models
from understudy.engine_shim.adapters.llama_model import LAYER_PARTS, LlamaConfig, _by_weight_rows
from understudy.engine_shim.adapters.packing import pack_into, packed_size, views_from

F32 = np.ndarray[Any, np.dtype[np.float32]]
Product = Callable[[F32, F32], F32]
BASELINE = "by weight rows"


def four_row_products(x: F32, weight: F32) -> F32:
    """The decode products until 8844117 (``_in_products``), for the baseline of history."""
    rows, block = x.shape[0], max(1, (512 << 10) // (weight.shape[1] * 4))
    padded = -(-rows // 4) * 4
    if padded != rows:
        x = np.concatenate((x, np.zeros((padded - rows, x.shape[1]), dtype=np.float32)))
    out = np.empty((padded, weight.shape[0]), dtype=np.float32)
    for begin in range(0, weight.shape[0], block):
        wt = weight[begin : begin + block].T
        for r in range(0, padded, 4):
            np.matmul(x[r : r + 4], wt, out=out[r : r + 4, begin : begin + block])
    return out[:rows]


def per_weight_row(x: F32, weight: F32) -> F32:
    """The decode products from 8844117 until ``_by_weight_rows``: one
    ``(1, in) @ (in, 8)`` product per weight row (rows padded to 8)."""
    rows, width = x.shape
    padded = -(-rows // 8) * 8
    groups = np.zeros((padded, width), dtype=np.float32)
    groups[:rows] = x
    columns = groups.reshape(-1, 8, width).transpose(0, 2, 1)
    out = np.matmul(weight[:, None, None, :], columns)
    return out.reshape(weight.shape[0], padded).T[:rows]


def native_product() -> tuple[Product | None, str]:
    """The engine's C kernel (``decode_kernels``); (None, why) where it is not there."""
    kernels = decode_kernels.kernels
    if kernels is None:
        return None, f"the package was built without its C kernels, or {decode_kernels.ENV}=numpy"
    if not kernels.has_products:
        return None, "this CPU has no AVX2 and FMA"
    return kernels.products, f"loaded from {kernels.path}"


def packed_weights(model_dir: Path) -> tuple[mmap.mmap, list[F32]]:
    """The decode's matrices in the order a step reads them, views of page-aligned memory."""
    config = LlamaConfig.from_dir(model_dir)
    memory = mmap.mmap(-1, packed_size(model_dir))
    tensors = views_from(memory, pack_into(memory, model_dir))
    matrices = [part for part in LAYER_PARTS if not part.endswith("layernorm")]
    names = [
        f"model.layers.{n}.{part}.weight" for n in range(config.num_layers) for part in matrices
    ]
    names.append("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
    return memory, [tensors[name] for name in names]  # type: ignore[misc]


def keeps_rows(product: Product, weights: Sequence[F32]) -> bool:
    """A row alone against the same row at every place of 8 and of 16 rows."""
    rng = np.random.default_rng(0)
    for w in {(w.shape, w.strides): w for w in weights}.values():
        x = rng.standard_normal((1, w.shape[1]), dtype=np.float32)
        alone = product(x, w)[0]
        for rows in (8, 16):
            for place in range(rows):
                step = rng.standard_normal((rows, w.shape[1]), dtype=np.float32)
                step[place] = x[0]
                if not np.array_equal(product(step, w)[place], alone):
                    return False
    return True


def step_times(product: Product, weights: Sequence[F32], rows: int, repeats: int) -> list[float]:
    rng = np.random.default_rng(1)
    inputs = {
        w.shape[1]: rng.standard_normal((rows, w.shape[1]), dtype=np.float32) for w in weights
    }
    times = []
    for _ in range(repeats + 1):  # the first pass warms the caches and the page tables
        t0 = time.perf_counter()
        for w in weights:
            product(inputs[w.shape[1]], w)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    warn_forced_openblas()
    load_at_start = os.getloadavg()
    _memory, weights = packed_weights(models.resolve(args.model))
    forms: dict[str, Product] = {
        "4-row products": four_row_products,
        "per weight row": per_weight_row,
        BASELINE: _by_weight_rows,
    }
    native, how = native_product()
    print(f"native: {how}" if native else f"native skipped: {how}")
    if native is not None:
        forms["native"] = native
    results: dict[str, Any] = {}
    for name, product in forms.items():
        keeps = keeps_rows(product, weights)
        results[name] = {"keeps_a_rows_bits": keeps}
        for rows in (1, 8):
            results[name][f"rows_{rows}"] = summary(
                step_times(product, weights, rows, args.repeats)
            )
        print(f"{name}: a row's bits kept in any step: {keeps}", flush=True)
    for rows in (1, 8):
        key = f"rows_{rows}"
        print_table(f"a step's products, {rows} row(s)", {n: r[key] for n, r in results.items()})
        base = results[BASELINE][key]["p50"]
        print("p50 against " + BASELINE + ": " + ", ".join(
            f"{n} {r[key]['p50'] / base:.2f}x" for n, r in results.items()
        ))  # fmt: skip
    write_results(
        "decode_products",
        {
            "unit": "seconds",
            "model": args.model,
            "weights_bytes": sum(w.nbytes for w in weights),
            "repeats": args.repeats,
            "load_at_start": load_at_start,
            "native": how,
            "numpy": np.__version__,
            "results": results,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
