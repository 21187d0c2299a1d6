"""The reference engine: all-MiniLM-L6-v2 on the CPU, weights in GMS.

The writer packs the safetensors into one GMS allocation on device 0 and
records every tensor (name, dtype, shape, offset) in GMS metadata; readers
import the same memory. The numpy model holds views over that memory — never
a copy — at addresses that stay fixed across sleep and wake. Serves the
OpenAI-compatible ``POST /v1/embeddings`` (``encoding_format`` float or
base64) and ``GET /v1/models``.

With several devices the model lives on device 0 and the others carry an
empty committed layout: a 22M-parameter model has nothing to shard; the
synthetic adapter exercises multi-device weights.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from understudy.engine_shim.adapters.base import AdapterError
from understudy.engine_shim.adapters.minilm import (
    MiniLM,
    default_model_dir,
    pack_into,
    packed_size,
)
from understudy.gms.client import GmsClient

MODEL_ID = "all-MiniLM-L6-v2"
META_KEY = "minilm"
MAX_INPUTS = 256
MAX_CHARS = 100_000
# Working memory: the activations of one request are allocated per request by
# numpy. The warm-up embedding runs once, at attach (start-up, weights mapped),
# for the first request's one-time costs. Waking needs none: the remapped
# weights come back with their pages present (GMS maps RO memory populated),
# and a warm-up there delayed every failover's first answer by one embedding.
WARMUP_TEXT = "understudy warm-up"


def model_dir_for(model: str) -> Path:
    if model in ("", "builtin", f"builtin:{MODEL_ID}"):
        return default_model_dir()
    path = Path(model)
    if not (path / "model.safetensors").is_file():
        raise AdapterError(f"model {model!r}: no model.safetensors there")
    return path


class ReferenceEngine:
    name = "reference"

    def __init__(self, model: str) -> None:
        self.model_dir = model_dir_for(model)
        self.model: MiniLM | None = None
        self.awake = False
        # One worker: requests are computed one at a time, in arrival order,
        # which keeps every answer bit-identical (see minilm's determinism note).
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embed")
        self.inflight_since: float | None = None

    # --- weights ----------------------------------------------------------

    def load(self, device: int, session: GmsClient) -> None:
        if device != 0:
            return  # empty layout on the other devices (module docstring)
        alloc = session.allocate(packed_size(self.model_dir))
        records = pack_into(alloc.view(), self.model_dir)
        session.put_metadata(
            META_KEY, {"model": MODEL_ID, "allocation": alloc.id, "records": list(records)}
        )

    def attach(self, sessions: Mapping[int, GmsClient]) -> None:
        session = sessions[min(sessions)]
        meta = session.metadata().get(META_KEY)
        if meta is None:
            raise AdapterError(f"GMS has no {META_KEY!r} metadata: not a {MODEL_ID} layout")
        allocs = {a.id: a for a in session.allocations}
        alloc = allocs.get(meta["allocation"])
        if alloc is None:
            raise AdapterError(f"metadata points at allocation {meta['allocation']}, not in GMS")
        self.model = MiniLM.from_buffer(alloc.view(), meta["records"], self.model_dir)
        self.model.embed([WARMUP_TEXT])

    # --- sleep / wake -----------------------------------------------------

    def sleep(self) -> None:
        self.awake = False

    def wake(self) -> None:
        if self.model is None:
            raise AdapterError("wake before attach")
        self.awake = True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def health(self) -> tuple[bool, str]:
        if not self.awake or self.model is None:
            return False, "not awake"
        if self.inflight_since is not None and time.monotonic() - self.inflight_since > 30:
            return False, "a request has been computing for more than 30s"
        return True, "ok"

    # --- serving ------------------------------------------------------------

    def _embed(self, texts: list[str]) -> np.ndarray:
        assert self.model is not None
        self.inflight_since = time.monotonic()
        try:
            return self.model.embed(texts)
        finally:
            self.inflight_since = None

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            body: Any = await request.json()
        except (ValueError, RecursionError):  # nested too deep is not JSON to us
            return _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        raw = body.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return _error(400, "'input' must be a string or a list of strings")
        if not 0 < len(texts) <= MAX_INPUTS:
            return _error(400, f"'input' must hold 1..{MAX_INPUTS} strings")
        if any(len(t) > MAX_CHARS for t in texts):
            return _error(400, f"an input is longer than {MAX_CHARS} characters")
        model = body.get("model", MODEL_ID)
        if model not in (MODEL_ID, f"sentence-transformers/{MODEL_ID}"):
            return _error(404, f"model {model!r} is not served here; this is {MODEL_ID}")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            return _error(400, "'encoding_format' must be 'float' or 'base64'")
        loop = asyncio.get_running_loop()
        vectors = await loop.run_in_executor(self._pool, self._embed, texts)
        assert self.model is not None
        tokens = sum(len(self.model.tokenize(t)) for t in texts)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": (
                    base64.b64encode(v.astype("<f4").tobytes()).decode()
                    if fmt == "base64"
                    else v.tolist()
                ),
            }
            for i, v in enumerate(vectors)
        ]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": MODEL_ID,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": MODEL_ID, "object": "model", "owned_by": "understudy"}],
            }
        )

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/embeddings", self.embeddings), web.get("/v1/models", self.models)]


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error"}}, status=status
    )
