"""The ``vllm`` adapter in this process, over a real GMS server.

Its model loader is found through the ``vllm.general_plugins`` entry point.
One engine publishes vLLM's parameters into GMS and serves; it is closed,
as a dead engine would be, and another maps them read-only with the
checkpoint gone. That one holds a built engine core in standby with its KV
cache released (the process's memory drops by the cache's size), wakes
without building anything, generates vLLM's own greedy tokens (a plain vLLM
engine built afterwards in this process, loading the same checkpoint the
usual way), and continues the first engine's streams, greedy and seeded,
chat and completion, byte for byte: what the front asks of the next engine
after a failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from memstat import working_set as _working_set
from vllmserver import free_port

from understudy.engine_shim.generation import SamplingParams
from understudy.gms.client import GmsClient
from understudy.gms.messages import Granted, Mode
from understudy.wire.serving import parse_token_comment

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = ["Hello, my name is", "user: what is the capital of France?\nassistant:"]
MAX_TOKENS = 48
ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--seed", "0")
IDS = {"request_id": "cmpl-test", "created": 1700000000}
# Streams the first engine serves whole and the second continues.
STREAMS = [
    ("/v1/completions", {"temperature": 0}),
    ("/v1/completions", {"temperature": 0.9, "top_p": 0.95, "seed": 5}),
    ("/v1/chat/completions", {"temperature": 0.8, "seed": 11}),
    ("/v1/chat/completions", {"temperature": 1.0, "top_p": 0.5, "seed": 2}),
]
CUTS = (1, 13, 47, 48)  # 48: the first engine died after the last token, before the end


@pytest.fixture(scope="module")
def gms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A GMS server (host backend, one device); yields its weights socket."""
    run = tmp_path_factory.mktemp("gms")
    proc = subprocess.Popen(
        [sys.executable, "-m", "understudy.cli", "gms", "serve", "--socket-dir", str(run),
         "--devices", "0", "--backend", "host", "--metrics-port", str(free_port())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    sock = run / "gms_0_weights.sock"
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "GMS did not start"
        time.sleep(0.05)
    yield sock
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(10)


def _greedy(engine: Any, prompt: list[int], resume: Sequence[int] = ()) -> list[int]:
    async def run() -> list[int]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        return [s.token_id async for s in engine.generate(prompt, params, resume)]

    return asyncio.run(run())


def _body(path: str, sampling: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "stream": True, **sampling}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": PROMPTS[1]}]
    else:
        body["prompt"] = PROMPTS[0]
    return body


def _token_ids(event: bytes) -> list[int]:
    return list(parse_token_comment(event.split(b"\n", 1)[0]) or ())


def _serve(engine: Any, calls: list[tuple[str, dict[str, Any]]]) -> list[list[bytes]]:
    """POST each (path, body) to the engine's OpenAI routes; each stream's SSE events."""

    async def run() -> list[list[bytes]]:
        app = web.Application()
        app.add_routes(engine.routes())
        out = []
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            for path, body in calls:
                resp = await client.post(path, json=body)
                assert resp.status == 200, await resp.text()
                out.append([e for e in (await resp.read()).split(b"\n\n") if e])
        return out

    return asyncio.run(run())


def _continuations(full: list[bytes]) -> list[tuple[dict[str, Any], list[bytes]]]:
    """For each cut k: the resume payload after k tokens, and the events owed after it."""
    ids = [t for e in full for t in _token_ids(e)]
    assert len(ids) == MAX_TOKENS and full[-1] == b"data: [DONE]"
    out = []
    for k in CUTS:
        seen, cut = 0, 0
        while seen < k:
            seen += len(_token_ids(full[cut]))
            cut += 1
        out.append(({"token_ids": ids[:k], "started": True}, full[cut:]))
    return out


def test_the_entry_point_registers_the_loader() -> None:
    from importlib.metadata import entry_points

    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("understudy") == "understudy.engine_shim.adapters.vllm_loader:register"
    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format="understudy"))
    assert type(loader).__name__ == "UnderstudyModelLoader"


def _plain_vllm_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM's own answers: an engine loading the checkpoint with its default loader."""
    from vllm import SamplingParams as VllmParams
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=2048, seed=0, enforce_eager=True
    )
    engine = LLMEngine.from_engine_args(args)
    try:
        params = VllmParams(max_tokens=MAX_TOKENS, temperature=0)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
        return [out[str(i)] for i in range(len(prompts))]
    finally:
        engine.engine_core.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()


def _first_engine(ckpt: Path, gms: Path) -> tuple[GmsClient, list[list[bytes]]]:
    """The GMS writer: publishes, goes through standby, serves the whole streams, dies."""
    from understudy.engine_shim.adapters.vllm import VllmEngine

    writer = VllmEngine(str(ckpt), ARGS)
    ws = GmsClient.connect(gms, Mode.RW_OR_RO, timeout=30)
    assert ws.granted_mode is Granted.RW
    try:
        writer.load(0, ws)
        ws.commit()
        writer.attach({0: ws})
        writer.sleep()
        ws.unmap()
        ws.remap(30)
        writer.wake()
        calls = [(path, {**_body(path, s), "understudy": IDS}) for path, s in STREAMS]
        full = _serve(writer, calls)
    finally:
        writer.close()
    return ws, full


def test_published_then_mapped_then_continued_on_another_engine(
    model_dir: Path, gms: Path, tmp_path: Path
) -> None:
    from understudy.engine_shim.adapters.vllm import VllmEngine

    ckpt = tmp_path / "model"
    shutil.copytree(model_dir, ckpt)
    ws, full = _first_engine(ckpt, gms)

    (ckpt / "model.safetensors").unlink()  # a mapped engine must never need it
    reader = VllmEngine(str(ckpt), ARGS)
    rs = GmsClient.connect(gms, Mode.RO, timeout=30)
    rs.import_all()
    reader.attach({0: rs})
    core = reader._engine
    awake = _working_set()
    reader.sleep()
    # The standby holds its engine core but not its KV cache (1 GiB): the
    # pages went back to the kernel (at once by default; the working set
    # counts the same when they are released reclaimably).
    released = awake - _working_set()
    assert released > 0.9 * 2**30, f"standby released only {released / 2**20:.0f} MiB"
    rs.unmap()
    rs.remap(30)
    reader.wake()
    assert reader._engine is core  # the wake built nothing
    prompts = [reader.encode(text) for text in PROMPTS]
    try:
        assert reader.health() == (True, "ok")
        ours = [_greedy(reader, p) for p in prompts]
        for p, answer in zip(prompts, ours, strict=True):
            assert _greedy(reader, p, answer[:17]) == answer[17:]
        calls, owed = [], []
        for (path, sampling), events in zip(STREAMS, full, strict=True):
            for resume, rest in _continuations(events):
                body = {**_body(path, sampling), "understudy": {**IDS, "resume": resume}}
                calls.append((path, body))
                owed.append((path, sampling, len(resume["token_ids"]), rest))
        got = _serve(reader, calls)
        for (path, sampling, k, rest), events in zip(owed, got, strict=True):
            assert events == rest, f"{path} {sampling}: continued after {k} tokens"
    finally:
        reader.close()
        rs.close()
        ws.close()
    # The seeded streams really sampled (not the greedy answer).
    streamed = [[t for e in events for t in _token_ids(e)] for events in full]
    assert len({tuple(ids) for ids in streamed[:2]}) == 2
    assert ours == _plain_vllm_greedy(model_dir, prompts)
    assert all(len(a) == MAX_TOKENS for a in ours)


def test_a_crash_signal_kills_the_engine_at_once() -> None:
    """vLLM imports tvm-ffi, whose native SIGSEGV handler prints a symbolized
    backtrace before the process dies (seconds, during which the dead
    engine still holds the lock); the adapter gives the signal back its
    default action once the engine is built (engine_shim/crash.py). In a
    child process: this one's handlers are pytest's."""
    code = (
        "import signal, tvm_ffi\n"
        "from understudy.engine_shim import crash\n"
        "before = signal.SIGSEGV in crash.caught_signals()\n"
        "reset = crash.die_at_once()\n"
        "print(before, reset >= 1, signal.SIGSEGV in crash.caught_signals())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "False"]
