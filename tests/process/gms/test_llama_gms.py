"""The llama engine over real GMS, across processes: the primary loads the weights
into GMS, a second process attaches read-only and generates the same tokens,
and after the primary's kill -9 it continues the primary's streams exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from gmsprocs import Agent, Gms

from understudy.engine_shim.adapters import tiny_llama

pytestmark = pytest.mark.process

PROMPTS = [
    "Hello, my name is",
    "The shadow engine wakes when the lock is granted",
    "1, 2, 3,",
    "東京と大阪 café",
]
PARAMS = {
    "greedy": {"max_tokens": 32, "temperature": 0},
    "seeded": {"max_tokens": 32, "temperature": 0.9, "top_p": 0.95, "seed": 77},
}


def llama(gms: Gms, name: str, model: Path) -> Agent:
    agent = Agent(gms.tmp / f"{name}.log", "llama_agent.py", str(model))
    gms.procs.append(agent)
    return agent


def test_second_process_attaches_read_only_and_continues_after_the_writer_dies(
    gms: Gms, tmp_path: Path
) -> None:
    model = tiny_llama.build(tmp_path / "model")
    gms.server()
    writer = llama(gms, "writer", model)
    wrote = writer.ok("connect", path=str(gms.path()), mode="RW_OR_RO", timeout=10)
    assert wrote["loaded"]
    first = {k: writer.ok("generate", prompts=PROMPTS, params=p) for k, p in PARAMS.items()}
    assert first["greedy"]["finish"] == ["length"] * len(PROMPTS)
    assert first["greedy"]["tokens"] != first["seeded"]["tokens"]

    reader = llama(gms, "reader", model)
    read = reader.ok("connect", path=str(gms.path()), mode="RO", timeout=10)
    assert not read["loaded"] and read["layout_hash"] == wrote["layout_hash"]
    placed = reader.ok("placement")
    assert placed["tensors"] == 39 and placed["all_inside"] and not placed["any_writeable"]
    assert placed["nbytes"] <= placed["allocation"]
    for k, p in PARAMS.items():
        assert reader.ok("generate", prompts=PROMPTS, params=p)["tokens"] == first[k]["tokens"]

    # The writer dies; its streams continue on the reader after 17 ids each.
    writer.kill9()
    assert gms.state()["committed"]
    for k, p in PARAMS.items():
        cut = [ids[:17] for ids in first[k]["tokens"]]
        rest = reader.ok("generate", prompts=PROMPTS, params=p, resumes=cut)
        assert rest["tokens"] == [ids[17:] for ids in first[k]["tokens"]]
        assert rest["finish"] == ["length"] * len(PROMPTS)

    # A standby's path to Active: sleep, unmap, remap at the same addresses, wake.
    assert reader.ok("sleep_wake", timeout=10)["healthy"]
    again = reader.ok("generate", prompts=PROMPTS, params=PARAMS["greedy"])
    assert again["tokens"] == first["greedy"]["tokens"]
