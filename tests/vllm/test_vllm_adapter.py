"""The ``vllm`` adapter in this process, over a real GMS server: its model loader
found through the ``vllm.general_plugins`` entry point; one engine publishes
vLLM's parameters into GMS, another maps them read-only with the checkpoint
gone and generates vLLM's own greedy tokens (a plain vLLM engine built
afterwards in this process, loading the same checkpoint the usual way); a
continuation after resumed ids generates the rest of the same answer."""

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
from vllmserver import free_port

from understudy.engine_shim.generation import SamplingParams
from understudy.gms.client import GmsClient
from understudy.gms.messages import Granted, Mode

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = ["Hello, my name is", "user: what is the capital of France?\nassistant:"]
MAX_TOKENS = 48


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


def test_published_then_mapped_without_the_checkpoint(
    model_dir: Path, gms: Path, tmp_path: Path
) -> None:
    from understudy.engine_shim.adapters.vllm import VllmEngine

    ckpt = tmp_path / "model"
    shutil.copytree(model_dir, ckpt)
    args = ("--dtype", "float32", "--max-model-len", "2048", "--seed", "0")

    writer = VllmEngine(str(ckpt), args)
    ws = GmsClient.connect(gms, Mode.RW_OR_RO, timeout=30)
    assert ws.granted_mode is Granted.RW
    writer.load(0, ws)
    ws.commit()
    writer.attach({0: ws})
    writer.sleep()  # on CPU: the engine that published is torn down
    ws.unmap()

    (ckpt / "model.safetensors").unlink()  # a mapped engine must never need it
    reader = VllmEngine(str(ckpt), args)
    rs = GmsClient.connect(gms, Mode.RO, timeout=30)
    rs.import_all()
    reader.attach({0: rs})
    reader.sleep()
    rs.unmap()
    rs.remap(30)
    reader.wake()
    prompts = [reader.encode(text) for text in PROMPTS]
    try:
        assert reader.health() == (True, "ok")
        ours = [_greedy(reader, p) for p in prompts]
        # A continuation (the front's, after a failover) finishes the same answer.
        for p, answer in zip(prompts, ours, strict=True):
            assert _greedy(reader, p, answer[:17]) == answer[17:]
    finally:
        reader.close()
        rs.close()
        ws.close()
    assert ours == _plain_vllm_greedy(model_dir, prompts)
    assert all(len(a) == MAX_TOKENS for a in ours)
