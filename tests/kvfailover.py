"""What the KV-pool failover tests share (tests/process/test_kv_failover*.py):
the stream they kill engines under, and how they read the engines' logs."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time
from collections.abc import Callable

from localpod import LocalPod

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.tools.drill_load import stream_events

PROMPT = "The shadow engine wakes when the lock is granted, and the front holds the stream. " * 3
MAX_TOKENS = 160


def stream(
    port: int, on_chunk: Callable[[int], None], prompt: str = PROMPT
) -> tuple[str, list[float]]:
    """A streamed greedy completion of ``prompt`` through the front: its text,
    and when each chunk arrived (monotonic)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    parts: list[str] = []
    times: list[float] = []
    try:
        for doc in stream_events(resp):
            parts.append(doc["choices"][0]["text"])
            times.append(time.monotonic())
            on_chunk(len(parts))
    finally:
        conn.close()
    return "".join(parts), times


def killed_stream(
    pod: LocalPod, at: int, prompt: str = PROMPT
) -> tuple[str, float, int, list[float]]:
    """A stream of ``prompt`` with the Active engine kill -9'd at chunk ``at``:
    its text, the kill's time, the killed pid and the chunks' times."""
    active = pod.by_state("Active")[0]
    killed: list[float] = []

    def on_chunk(n: int) -> None:
        if n == at:
            os.kill(active["pid"], signal.SIGKILL)
            killed.append(time.monotonic())

    text, times = stream(pod.serve_port, on_chunk, prompt)
    assert killed, "the stream ended before the kill"
    return text, killed[0], active["pid"], times


def reused(log: str) -> list[int]:
    """The positions each claim in ``log`` reused from the pool."""
    return [int(m) for m in re.findall(r"kv_reused .*?positions=(\d+)", log)]


def gap_after(killed_at: float, times: list[float]) -> float:
    return min(t for t in times if t > killed_at) - killed_at


def adopted_line(log: str) -> dict[str, str]:
    lines = [ln for ln in log.splitlines() if "kv_adopted" in ln]
    assert lines, "no kv_adopted line"
    return dict(re.findall(r"(\w+)=(\S+)", lines[-1]))


def tiny_llama_ids(text: str) -> list[int]:
    return LlamaEngine(tiny_llama.BUILTIN).encode(text)


def local_pod(engine: str, *extra: str, shadows: int = 1, failpoints: str = "") -> LocalPod:
    """A local pod whose containers run with ``UNDERSTUDY_FAILPOINTS=failpoints``
    (the runner passes its environment on to them)."""
    old = os.environ.get("UNDERSTUDY_FAILPOINTS")
    os.environ["UNDERSTUDY_FAILPOINTS"] = failpoints
    try:
        return LocalPod(*extra, shadows=shadows, engine=engine)
    finally:
        if old is None:
            os.environ.pop("UNDERSTUDY_FAILPOINTS")
        else:
            os.environ["UNDERSTUDY_FAILPOINTS"] = old
