"""A failover's cost against the context length, with the KV pool adopted or not.

For each context (16, 1,000 and 4,000 prompt tokens by default) and each mode
(``on``: the next engine adopts the dead one's sealed KV blocks; ``noadopt``:
the same engines and pool, but the next engine recomputes the prompt and the
tokens already streamed; ``off``: no pool at all, the engine as it was
before it, whose one-batch prefill of 4,000 positions takes many minutes
here), a local pod runs (lock server, GMS, front, a primary and a shadow
engine of ``--engine``: ``llama``, or ``vllm``, whose KV connector keeps its
cache in the same pool; the real model), and each round:

1. streams a greedy completion of the prompt through the front,
2. kill -9s the Active engine when the ``--kill-after``-th token arrives,
3. times the kill to the next token the client receives (the next engine:
   detect, lock, wake, adopt or not, compute what it must, one decode step),
   and the stream's own stall (its last token before the kill to its first
   after, ``understudy.tools.stalls``, as the drill reports it) against its
   time between tokens otherwise (TPOT),
4. checks that the whole stream is byte for byte the uninterrupted answer
   (an uninterrupted stream of the same prompt, through the same pod, first).

The contexts' rounds are interleaved (``schedule``), so each context's
ratio to the first is paired round by round. It prints the stream's stall
against its TPOT and the kill → next-token times (p50, max) per context
and mode, the ratio of each context's time to the 16-token one in the same
mode (with a 90 % bootstrap interval over the paired rounds), and of
adopted to not, and writes everything with the machine's load to
``bench/results/kv_failover.json`` (``kv_failover_vllm.json`` for vLLM).
The engines run one sequence each (``--max-num-seqs 1``), one BLAS thread,
on a 2-core machine shared with other work: the load average is in the JSON.

    .venv/bin/python bench/kv_failover.py [--engine llama|vllm] [--model builtin:smollm2-135m]
        [--contexts 16,1000,4000] [--modes on,noadopt] [--rounds 3] [--kill-after 8]
        [--order interleaved|blocked]
        [--max-tokens 24] [--figure docs/report/kv_failover.svg]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    machine,
    ratio_interval,
    stop_cleanly_on_sigterm,
    summary,
    warn_forced_openblas,
    write_results,
)

from understudy.tools.drill_load import stream_events
from understudy.tools.stalls import stream_times

PY = sys.executable
# Any text: its token ids are repeated to the context wanted (the prompt is sent
# as ids, so its length is exact).
TEXT = (
    "The pod keeps a shadow engine asleep beside the active one. When the active "
    "engine dies, the lock passes, the shadow wakes, and the front continues every "
    "stream where it stopped. "
)


# How the engines run in each mode: ``on``, the KV pool adopted by the next
# engine; ``noadopt``, the same engines and pool, but the next engine starts
# the pool's log afresh and recomputes (adoption alone is what differs);
# ``off``, no pool (an engine-owned cache, the prompt in one batch: what the
# engine did before the pool).
MODES = {
    "on": ("--engine-arg=--kv-pool=on", "--engine-arg=--kv-adopt=on"),
    "noadopt": ("--engine-arg=--kv-pool=on", "--engine-arg=--kv-adopt=off"),
    "off": ("--engine-arg=--kv-pool=off",),
}


@dataclass
class Round:
    context: int
    mode: str
    kill_to_next_s: float
    identical: bool
    reused_positions: int | None  # what the next engine reused (its log), None: nothing
    first_token_s: float  # request to first token, before the kill
    in_flight: int  # chunks that arrived within 20 ms of the kill (sent before it)
    stall_s: float = math.nan  # the stream's last token before the kill -> first after
    between_s: list[float] = field(default_factory=list)  # its other intervals (TPOT)
    phases_s: dict[str, float] = field(default_factory=dict)  # kill -> next token, in parts
    index: int = 0  # the round's number in its context: round i of each context ran together


@dataclass
class Pod:
    dir: Path
    port: int
    status_ports: list[int]
    proc: subprocess.Popen[bytes]
    log_files: list[Path] = field(default_factory=list)

    def states(self) -> list[dict[str, Any]]:
        out = []
        for port in self.status_ports:
            try:
                out.append(get_json(port, "/state"))
            except OSError:
                out.append({})
        return out

    def active(self, not_pid: int | None = None) -> dict[str, Any] | None:
        for s in self.states():
            if s.get("state") == "Active" and s.get("pid") != not_pid:
                return s
        return None

    def armed(self) -> bool:
        states = [s.get("state") for s in self.states()]
        return states.count("Active") == 1 and states.count("Standby") == len(states) - 1

    def log(self, name: str) -> str:
        path = self.dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if os.environ.get("KEEP"):  # the pod's logs, for a closer look
            print(f"kept: {self.dir}", flush=True)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def get_json(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def start_pod(engine: str, model: str, mode: str, max_len: int, base: int, extra: list[str]) -> Pod:
    run = Path(tempfile.mkdtemp(prefix="us-kvb-", dir="/dev/shm"))
    # Without the pool a 4,000-position prompt is one llama worker iteration
    # of minutes here: not a hung engine (vLLM's prefill is chunked).
    stuck = ["--engine-arg=--stuck-after=1800"] if engine == "llama" else []
    args = [
        PY, "-m", "understudy.cli", "local", "up", "--engine", engine, "--model", model,
        "--dir", str(run), "--port", str(base), "--status-port", str(base + 4),
        "--metrics-port", str(base + 12), "--shadows", "1", "--max-backoff", "1",
        # A prefill of thousands of positions keeps the engine's event loop
        # busy at times: only a real hang should count as one here.
        "--hang-after", "30",
        "--hold", "600",
        "--engine-arg=--max-num-seqs=1", f"--engine-arg=--max-model-len={max_len}",
        *MODES[mode],
        *stuck,
        *(f"--engine-arg={a}" for a in extra),
    ]  # fmt: skip
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(run / "bench-up.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=log, env=env, start_new_session=True)
    pod = Pod(run, base, [base + 4, base + 5], proc)
    deadline = time.monotonic() + 900
    while not pod.armed():
        if proc.poll() is not None or time.monotonic() > deadline:
            pod.close()
            raise RuntimeError(f"the pod did not arm: {(run / 'bench-up.log').read_text()[-2000:]}")
        time.sleep(0.5)
    return pod


def stream(
    pod: Pod, prompt: list[int], max_tokens: int, kill_after: int | None
) -> tuple[str, list[float], float, float | None, int | None]:
    """(text, chunk arrival times, request start, kill time, killed pid)."""
    conn = http.client.HTTPConnection("127.0.0.1", pod.port, timeout=3600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {resp.read()[:500]!r}")
    parts: list[str] = []
    times: list[float] = []
    killed_at: float | None = None
    killed_pid: int | None = None
    try:
        for doc in stream_events(resp):
            parts.append(doc["choices"][0]["text"])
            times.append(time.monotonic())
            if kill_after is not None and len(parts) == kill_after and killed_at is None:
                active = pod.active()
                assert active is not None, pod.states()
                # The time before the kill: the lock server may log the death
                # (its death word) before this process runs again after it.
                killed_at, killed_pid = time.monotonic(), active["pid"]
                os.kill(killed_pid, signal.SIGKILL)
    finally:
        conn.close()
    return "".join(parts), times, t0, killed_at, killed_pid


def next_log(pod: Pod, killed_pid: int) -> str:
    """The log of the engine Active after the kill, since its last start
    ("" if none is Active within a minute)."""
    deadline = time.monotonic() + 60
    while (active := pod.active(not_pid=killed_pid)) is None:
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.2)
    return pod.log(active["name"]).split("event=starting")[-1]


def reused(log: str) -> int | None:
    found = [int(m) for m in re.findall(r"event=kv_reused .*?positions=(\d+)", log)]
    return found[-1] if found else None


# The pod's log lines' time (``obs``'s asctime: local wall clock, to the ms).
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?event=(\w+)(.*)$", re.M)
PHASES = ("detect", "grant", "wake", "claim", "copy", "first_step")


def _events(text: str, after: float) -> list[tuple[float, str, str]]:
    out = []
    for m in _STAMP.finditer(text):
        at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at >= after - 0.002:  # the stamp is cut to the ms
            out.append((at, m[2], m[3]))
    return out


def phases(pod: Pod, log: str, kill_wall: float, next_wall: float) -> dict[str, float]:
    """Kill -> next token in parts, from the pod's logs: the death seen by
    the lock server (the holder's disconnection: the dead engine's teardown
    and its socket's EOF), the lock granted, the next engine Active (weights
    and pool mapped), the continuation resent by the front and claimed
    (``kv_reused``: matched, checksums verified), for ``vllm`` the adopted
    blocks copied into its cache (``kv_loaded``), and the first step after
    it to the client. A part whose line is missing is left out."""
    lock = "".join(pod.log(p.stem) for p in (pod.dir / "logs").glob("lock*.log"))
    ev = _events(lock, kill_wall)
    # The grant is fed by the holder's disconnection and logged before it.
    granted = next((t for t, e, _ in ev if e == "granted"), None)
    seen = [t for t, e, f in ev if e == "released" or "was_holder=True" in f]
    released = min([*seen, granted]) if seen and granted is not None else None
    mine = _events(log, kill_wall)  # the next Active's (``next_log``)
    woke = next((t for t, e, f in mine if e == "transition" and "to_state=Active" in f), None)
    claimed = next((t for t, e, _ in mine if e == "kv_reused"), None)
    copied = next((t for t, e, _ in mine if e == "kv_loaded"), None)  # vllm's only
    marks = [
        ("detect", released), ("grant", granted), ("wake", woke), ("claim", claimed),
        ("copy", copied),
    ]  # fmt: skip
    out: dict[str, float] = {}
    last = kill_wall
    for name, at in marks:
        if at is not None:
            out[name] = at - last
            last = at
    out["first_step"] = next_wall - last
    return out


def wait_armed(pod: Pod, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not pod.armed():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not re-armed: {pod.states()}")
        time.sleep(0.5)


def prompt_ids(model: str, n: int) -> list[int]:
    from understudy.engine_shim.adapters.llama import LlamaEngine

    ids = LlamaEngine(model, ("--kv-pool", "off")).encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def schedule(contexts: list[int], rounds: int, order: str) -> list[tuple[int, int]]:
    """``(context, round)`` in the order they run. ``interleaved``: each round
    runs every context back to back, in an order that flips every round, so
    what drifts over a run (the machine's other work) falls on every context
    alike and no context always runs after the same one; the ratio between
    contexts is then paired. ``blocked``: every round of one context, then the
    next (how this benchmark ran before 2026-12-06's evening)."""
    if order == "blocked":
        return [(c, r) for c in contexts for r in range(rounds)]
    return [(c, r) for r in range(rounds) for c in (contexts[::-1] if r % 2 else contexts)]


def run_mode(args: argparse.Namespace, mode: str, base: int) -> list[Round]:
    rounds: list[Round] = []
    max_len = max(args.contexts) + args.max_tokens + 64
    pod = start_pod(args.engine, args.model, mode, max_len, base, args.engine_arg)
    try:
        prompts = {c: prompt_ids(args.model, c) for c in args.contexts}
        wants = {}
        for context, prompt in prompts.items():
            wants[context], _, _, _, _ = stream(pod, prompt, args.max_tokens, None)
            print(f"[{mode}] context {context}: reference {len(wants[context])} chars", flush=True)
        for context, r in schedule(args.contexts, args.rounds, args.order):
            got = one_round(args, pod, mode, context, r, prompts[context], wants[context])
            rounds.append(got)
            print(
                f"[{mode}] context {context} round {r}: stall {got.stall_s:.3f}s "
                f"(TPOT p50 {statistics.median(got.between_s or [math.nan]):.3f}s), "
                f"kill->next {got.kill_to_next_s:.3f}s "
                f"identical={got.identical} reused={got.reused_positions} "
                f"load={os.getloadavg()[0]:.2f}\n    parts (ms): "
                + " ".join(f"{k} {v * 1000:.0f}" for k, v in got.phases_s.items()),
                flush=True,
            )
    finally:
        pod.close()
    return rounds


def one_round(
    args: argparse.Namespace, pod: Pod, mode: str, context: int, index: int,
    prompt: list[int], want: str,
) -> Round:  # fmt: skip
    """Stream ``prompt``, kill the Active engine at the ``--kill-after``-th
    token, and time what the client saw."""
    wait_armed(pod)
    text, times, t0, killed_at, pid = stream(pod, prompt, args.max_tokens, args.kill_after)
    assert killed_at is not None and pid is not None
    after = [t for t in times if t > killed_at]
    in_flight = sum(1 for t in after if t - killed_at < 0.02)
    gap = after[in_flight] - killed_at if len(after) > in_flight else float("nan")
    caught = stream_times(times, [killed_at])
    wall = time.time() - time.monotonic()
    log = next_log(pod, pid)
    parts = (
        phases(pod, log, killed_at + wall, after[in_flight] + wall)
        if len(after) > in_flight
        else {}
    )
    return Round(
        context, mode, gap, text == want, reused(log),
        times[0] - t0, in_flight,
        caught.stalls[0].stall_s if caught.stalls else math.nan,
        list(caught.between_s), parts, index,
    )  # fmt: skip


def stall_table(rounds: list[Round], contexts: list[int]) -> dict[str, Any]:
    """Per mode and context: the streams' stalls at their kills, and their TPOT."""
    out: dict[str, Any] = {}
    for mode in MODES:
        for c in contexts:
            caught = [
                r for r in rounds if r.mode == mode and r.context == c and not math.isnan(r.stall_s)
            ]
            tpot = [v for r in caught for v in r.between_s]
            if caught and tpot:
                out[f"{mode}/{c}"] = {
                    "stall_s": summary([r.stall_s for r in caught]),
                    "tpot_s": summary(tpot),
                }
    return out


def parts_table(rounds: list[Round], contexts: list[int]) -> dict[str, Any]:
    """Per mode and context: each part of kill -> next token (``phases``)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        for c in contexts:
            mine = [r.phases_s for r in rounds if r.mode == mode and r.context == c]
            got = {k: [p[k] for p in mine if k in p] for k in PHASES}
            if any(got.values()):
                out[f"{mode}/{c}"] = {k: summary(v) for k, v in got.items() if v}
    return out


def context_ratios(
    table: dict[str, Any], stalls: dict[str, Any], contexts: list[int]
) -> dict[str, float]:
    """Per mode, each context's kill -> next token p50 against the first's;
    beside it what the context costs a decode step anyway (the same streams'
    TPOT p50): kill -> next token holds one such step, so its ratio falls
    below the TPOT's only through costs that do not grow with the context;
    and the ratio of what is left beyond that step."""
    ratios: dict[str, float] = {}
    base = contexts[0]
    for mode in MODES:
        b, tb = table.get(f"{mode}/{base}"), stalls.get(f"{mode}/{base}", {}).get("tpot_s")
        for c in contexts[1:]:
            a, ta = table.get(f"{mode}/{c}"), stalls.get(f"{mode}/{c}", {}).get("tpot_s")
            if not (a and b):
                continue
            ratios[f"{mode}: {c} vs {base}"] = a["p50"] / b["p50"]
            if ta and tb:
                ratios[f"{mode}: TPOT {c} vs {base}"] = ta["p50"] / tb["p50"]
                if b["p50"] > tb["p50"]:
                    ratios[f"{mode}: beyond a step {c} vs {base}"] = (a["p50"] - ta["p50"]) / (
                        b["p50"] - tb["p50"]
                    )
    return ratios


def ratio_intervals(rounds: list[Round], contexts: list[int]) -> dict[str, list[float]]:
    """Per mode, a 90 % bootstrap interval of each context's kill -> next token
    p50 against the first context's, its rounds paired by number: under
    ``--order interleaved`` round i of each context ran back to back."""
    out: dict[str, list[float]] = {}
    base = contexts[0]
    for mode in MODES:
        got = {
            (r.context, r.index): r.kill_to_next_s
            for r in rounds
            if r.mode == mode and not math.isnan(r.kill_to_next_s)
        }
        for c in contexts[1:]:
            pairs = [(v, got[base, i]) for (k, i), v in got.items() if k == c and (base, i) in got]
            if len(pairs) >= 4:  # fewer make an interval that says nothing
                out[f"{mode}: {c} vs {base}"] = list(ratio_interval(pairs))
    return out


def report(rounds: list[Round], contexts: list[int]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for mode in MODES:
        for c in contexts:
            # NaN: the stream ended before a token after the kill (a tiny
            # model's short answer); sorted with the rest it would skew the p50.
            gaps = [
                r.kill_to_next_s
                for r in rounds
                if r.mode == mode and r.context == c and not math.isnan(r.kill_to_next_s)
            ]
            if gaps:
                table[f"{mode}/{c}"] = summary(gaps)
    stalls = stall_table(rounds, contexts)
    ratios = context_ratios(table, stalls, contexts)
    for c in contexts:
        for other in ("noadopt", "off"):
            a, b = table.get(f"on/{c}"), table.get(f"{other}/{c}")
            if a and b:
                ratios[f"{c}: on vs {other}"] = a["p50"] / b["p50"]
    return {
        "stream_stall_s": stalls,
        "kill_to_next_token_parts_s": parts_table(rounds, contexts),
        "kill_to_next_token_s": table,
        "ratios_p50": ratios,
        "ratios_p50_interval_90": ratio_intervals(rounds, contexts),
    }


def figure(result: dict[str, Any], contexts: list[int]) -> str:
    """An SVG bar chart: kill -> next token (p50, log scale) per context, on and off."""
    table = result["kill_to_next_token_s"]
    width, height, left, bottom, top = 560, 300, 60, 40, 30
    values = [s["p50"] for s in table.values()]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))

    def y(v: float) -> float:
        frac = (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        return height - bottom - frac * (height - bottom - top)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{width / 2}" y="16" text-anchor="middle">kill → next token (p50, s, '
        "log scale)</text>",
    ]
    decade = lo
    while decade <= hi:
        out.append(
            f'<line x1="{left}" x2="{width - 10}" y1="{y(decade):.1f}" y2="{y(decade):.1f}" '
            'stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y(decade) + 4:.1f}" text-anchor="end">{decade:g}</text>'
        )
        decade *= 10
    group = (width - left - 10) / len(contexts)
    colours = {"on": "#2b7bba", "noadopt": "#d95f02", "off": "#7570b3"}
    modes = [m for m in MODES if any(k.startswith(m + "/") for k in table)]
    for i, c in enumerate(contexts):
        x0 = left + i * group + group * 0.15
        for j, mode in enumerate(modes):
            s = table.get(f"{mode}/{c}")
            if s is None:
                continue
            x = x0 + j * group * 0.7 / len(modes)
            out.append(
                f'<rect x="{x:.1f}" y="{y(s["p50"]):.1f}" width="{group * 0.6 / len(modes):.1f}" '
                f'height="{height - bottom - y(s["p50"]):.1f}" fill="{colours[mode]}"/>'
                f'<text x="{x + group * 0.3 / len(modes):.1f}" y="{y(s["p50"]) - 4:.1f}" '
                f'text-anchor="middle">{s["p50"]:.2f}</text>'
            )
        out.append(
            f'<text x="{left + (i + 0.5) * group:.1f}" y="{height - bottom + 16}" '
            f'text-anchor="middle">{c} tokens</text>'
        )
    names = {"on": "adopted", "noadopt": "not adopted", "off": "no pool"}
    for j, mode in enumerate(modes):
        out.append(
            f'<rect x="{left + j * 110}" y="{height - 16}" width="10" height="10" '
            f'fill="{colours[mode]}"/><text x="{left + 14 + j * 110}" y="{height - 7}">'
            f"{names[mode]}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("llama", "vllm"), default="llama")
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--contexts", default="16,1000,4000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=8, help="kill at this streamed token")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--modes", default="on,noadopt", help=f"of {', '.join(MODES)}")
    parser.add_argument(
        "--order", choices=("interleaved", "blocked"), default="interleaved",
        help="the contexts' rounds alternated (the default), or each context's all at once",
    )  # fmt: skip
    parser.add_argument("--base-port", type=int, default=29400)
    parser.add_argument(
        "--engine-arg", action="append", default=[], metavar="ARG",
        help="passed to every engine (repeatable), e.g. --engine-arg=--kv-release=reclaimable",
    )  # fmt: skip
    parser.add_argument("--figure", help="also draw the result as an SVG here")
    parser.add_argument("--figure-from", help="only draw the figure, from this results JSON")
    args = parser.parse_args()
    stop_cleanly_on_sigterm()
    warn_forced_openblas()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    if args.figure_from:
        saved = json.loads(Path(args.figure_from).read_text())
        Path(args.figure).write_text(figure(saved, saved["contexts"]))
        return 0
    load_before = os.getloadavg()
    rounds: list[Round] = []
    for i, mode in enumerate(args.modes.split(",")):
        rounds += run_mode(args, mode, args.base_port + 20 * i)
        save(args, rounds, load_before)  # what is measured so far survives a stop
    result = save(args, rounds, load_before)
    print("\na stream's stall at the kill (last token before -> first after) vs its TPOT (s)")
    for key, st in result["stream_stall_s"].items():
        a, b = st["stall_s"], st["tpot_s"]
        print(
            f"  {key:>10}  n={a['n']}  stall p50={a['p50']:.3f} p99={a['p99']:.3f} "
            f"max={a['max']:.3f}  TPOT p50={b['p50']:.3f} p99={b['p99']:.3f} max={b['max']:.3f}"
        )
    print("kill -> next token (s)")
    for key, s in result["kill_to_next_token_s"].items():
        print(f"  {key:>10}  n={s['n']}  p50={s['p50']:.3f}  max={s['max']:.3f}")
    print("kill -> next token in parts, p50 (ms): " + " / ".join(PHASES))
    for key, got in result["kill_to_next_token_parts_s"].items():
        print(f"  {key:>10}  " + "  ".join(
            f"{k} {got[k]['p50'] * 1000:.0f}" if k in got else f"{k} -" for k in PHASES
        ))  # fmt: skip
    print("ratios (p50)")
    intervals = result["ratios_p50_interval_90"]
    for key, v in result["ratios_p50"].items():
        lo, hi = intervals.get(key, (math.nan, math.nan))
        print(
            f"  {key:>34}  {v:.2f}x"
            + (f"  (90 % interval {lo:.2f}-{hi:.2f}x)" if key in intervals else "")
        )
    identical = all(r.identical for r in rounds)
    print(f"every stream byte-identical across its kill: {identical}")
    if args.figure:
        Path(args.figure).write_text(figure(result, args.contexts))
    return 0 if identical else 1


def save(args: argparse.Namespace, rounds: list[Round], load_before: Any) -> dict[str, Any]:
    result = report(rounds, args.contexts)
    write_results(
        "kv_failover" if args.engine == "llama" else f"kv_failover_{args.engine}",
        {
            "engine": args.engine,
            "engine_args": args.engine_arg,
            "model": args.model,
            "contexts": args.contexts,
            "order": args.order,
            "kill_after": args.kill_after,
            "max_tokens": args.max_tokens,
            "rounds": [r.__dict__ for r in rounds],
            **result,
            "identical": all(r.identical for r in rounds),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "machine": machine(),
        },
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
