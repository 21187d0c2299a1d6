"""The llama engine's KV cache in a pool: what one engine seals, the next adopts,
and a continuation gives the same tokens as the uninterrupted run, whatever
the prompt's length and wherever the first engine stopped; a corrupt block
or a torn log record costs a recompute, never a wrong token.

The pool here is memory both engines map in turn (the processes and GMS
around it are in tests/process/test_kv_failover.py): a bytearray, or a memfd
mapped twice, read-write and read-only with its pages present, as an engine
promoted from standby maps it (kvreader): every test runs both ways."""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from understudy.engine_shim import chunks, kvlog
from understudy.engine_shim.adapters import decode_kernels
from understudy.engine_shim.adapters.llama import PREFILL_CHUNK, LlamaEngine
from understudy.engine_shim.generation import SamplingParams, Step
from understudy.engine_shim.kvlog import RECORD_SIZE

GREEDY = SamplingParams(max_tokens=30, temperature=0)
SEEDED = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=7)
ARGS = ("--max-num-seqs", "3", "--max-model-len", "512")


class Pod:
    """One pool, and the engines that hold it one after the other."""

    def __init__(self, model_dir: Path, *args: str, premapped: bool = False) -> None:
        self.model_dir = model_dir
        self.args = args or ARGS
        probe = LlamaEngine(str(model_dir), self.args)
        assert probe.kv_spec is not None
        self.spec = probe.kv_spec
        self.memory: bytearray | mmap.mmap = bytearray(self.spec.pool_bytes)
        self.reader: memoryview | None = None
        if premapped:  # as GMS's memfd backend and KvSession.peek map it
            fd = os.memfd_create("kv-pool")
            ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
            try:
                os.ftruncate(fd, self.spec.pool_bytes)
                self.memory = mmap.mmap(fd, self.spec.pool_bytes)
                flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
                view = mmap.mmap(ro, self.spec.pool_bytes, flags=flags, prot=mmap.PROT_READ)
                self.reader = memoryview(view)
            finally:
                os.close(ro)
                os.close(fd)
        self.epoch = 0
        self.engines: list[LlamaEngine] = []

    def next_engine(self) -> LlamaEngine:
        """The previous holder stops (its thread, as a death would) and the next wakes."""
        for old in self.engines:
            old.close()
        self.epoch += 1
        e = LlamaEngine(str(self.model_dir), self.args)
        e.attach_private()
        e.attach_kv_pool(memoryview(self.memory), self.epoch, self.reader)
        pool = e.kv_pool
        assert pool is not None and pool.reads_premapped is (self.reader is not None)
        if self.reader is not None:  # reads through the view, writes through the pool
            assert not pool.rk.flags.writeable and pool.k.flags.writeable
            assert pool.rk.ctypes.data != pool.k.ctypes.data
        e.wake()
        self.engines.append(e)
        return e

    def close(self) -> None:
        for e in self.engines:
            e.close()


@pytest.fixture(params=[False, True], ids=["one-mapping", "premapped"])
def pod(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[Pod]:
    p = Pod(tiny_llama_dir, premapped=request.param)
    yield p
    p.close()


async def run(
    engine: LlamaEngine, prompt: list[int], params: SamplingParams, resume: list[int] | None = None
) -> list[int]:
    async with asyncio.timeout(120):
        steps: list[Step] = [s async for s in engine.generate(prompt, params, resume or [])]
    return [s.token_id for s in steps]


def prompt_of(engine: LlamaEngine, n: int) -> list[int]:
    words = engine.encode("The shadow engine wakes when the lock is granted, and then " * 40)
    return words[:n]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 100, 300])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_the_next_engine_continues_exactly_from_the_adopted_cache(
    pod: Pod, n: int, params: SamplingParams
) -> None:
    first = pod.next_engine()
    prompt = prompt_of(first, n)
    whole = await run(first, prompt, params)
    assert len(whole) == params.max_tokens
    for k in (1, 5, 16, 17, 29):
        nxt = pod.next_engine()
        assert nxt.kv_pool is not None
        reused = nxt.kv_pool.stats.reused_blocks
        assert await run(nxt, prompt, params, whole[:k]) == whole[k:], k
        assert nxt.kv_pool.stats.reused_blocks - reused == reusable(n, k, 29), k


def reusable(n: int, k: int, filled: int) -> int:
    """Blocks a continuation after ``k`` of a prompt of ``n`` reuses, the last
    engine having filled and sealed ``n + filled`` positions (its last block in
    part): the whole blocks the continuation's ids cover, or everything if they
    cover the part too; never the last position; in the prompt, back to a
    chunk start (`chunks`, from 64)."""
    total = n + k
    trusted = n + filled if total >= n + filled else min((n + filled) // 16, total // 16) * 16
    start = min(trusted, total - 1)
    if start < n:
        start = chunks.start_before(start, PREFILL_CHUNK)
    return start // 16


async def test_prefix_blocks_are_reused_within_one_engine_and_change_nothing(pod: Pod) -> None:
    engine = pod.next_engine()
    prompt = prompt_of(engine, 100)
    a = await run(engine, prompt, GREEDY)
    b = await run(engine, prompt, GREEDY)
    assert a == b
    assert engine.kv_pool is not None and engine.kv_pool.stats.reused_blocks == 4  # 64 of 99


async def test_without_the_pool_the_engine_recomputes_and_agrees(
    pod: Pod, tiny_llama_dir: Path
) -> None:
    with_pool = pod.next_engine()
    prompt = prompt_of(with_pool, 70)
    a = await run(with_pool, prompt, GREEDY)
    plain = LlamaEngine(str(tiny_llama_dir), (*ARGS, "--kv-pool", "off"))
    assert plain.kv_pool_request() is None
    plain.attach_private()
    plain.wake()
    try:
        assert await run(plain, prompt, GREEDY) == a
    finally:
        plain.close()


async def test_a_corrupt_block_is_recomputed_never_served(pod: Pod) -> None:
    first = pod.next_engine()
    prompt = prompt_of(first, 80)
    whole = await run(first, prompt, GREEDY)
    spec = pod.spec
    keys = np.frombuffer(pod.memory, np.float32, spec.cache_bytes // 4, spec.arena_offset)
    keys = keys.reshape(spec.cache_shape)
    keys[3, 0, 0, 2 * 16 + 5, 7] += 1.0  # block 2 of slot 0, under its seal
    nxt = pod.next_engine()
    assert await run(nxt, prompt, GREEDY, whole[:10]) == whole[10:]
    assert nxt.kv_pool is not None
    assert nxt.kv_pool.stats.corrupt_blocks == 1
    assert nxt.kv_pool.stats.reused_blocks == 0  # block 2 sits in the first chunk of 64


async def test_a_corrupt_generated_block_costs_only_what_follows_it(pod: Pod) -> None:
    """The claim's checksums run beside its first step (deferred), or in it
    (the attention kernel sums them as it reads the blocks): a bad block
    among the generated positions is found after that step, whose token is
    dropped, and the ids from that block on are fed again."""
    first = pod.next_engine()
    prompt = prompt_of(first, 30)
    whole = await run(first, prompt, GREEDY)
    spec = pod.spec
    keys = np.frombuffer(pod.memory, np.float32, spec.cache_bytes // 4, spec.arena_offset)
    keys.reshape(spec.cache_shape)[1, 0, 1, 2 * 16 + 3, 0] += 1.0  # block 2: positions 32..47
    nxt = pod.next_engine()
    assert await run(nxt, prompt, GREEDY, whole[:20]) == whole[20:]
    assert nxt.kv_pool is not None
    assert nxt.kv_pool.stats.corrupt_blocks == 1
    assert nxt.kv_pool.stats.reused_blocks == 2  # blocks 0 and 1: 32 positions kept
    # Blocks 0-2, below the claim's start (49): summed by the step where the
    # kernel runs (block 3, which the start falls inside, at the claim).
    in_step = 3 if decode_kernels.kernels is not None else 0
    assert nxt.kv_pool.stats.summed_in_step == in_step


async def test_a_torn_record_costs_only_itself(pod: Pod) -> None:
    first = pod.next_engine()
    prompt = prompt_of(first, 40)
    whole = await run(first, prompt, GREEDY)
    assert first.kv_pool is not None
    last = first.kv_pool.writer.next_gen - 1
    spec = pod.spec
    at = spec.log_offset + (last % spec.log_capacity) * RECORD_SIZE
    pod.memory[at + 40 : at + RECORD_SIZE] = bytes(RECORD_SIZE - 40)  # died half-way
    nxt = pod.next_engine()
    assert nxt.kv_pool is not None
    assert nxt.kv_pool.stats.torn == 1 and nxt.kv_pool.stats.records == last - 1
    assert await run(nxt, prompt, GREEDY, whole[:20]) == whole[20:]


async def test_a_pool_made_for_another_geometry_is_not_adopted(
    pod: Pod, tiny_llama_dir: Path
) -> None:
    first = pod.next_engine()
    await run(first, prompt_of(first, 40), GREEDY)
    first.close()
    other = LlamaEngine(str(tiny_llama_dir), ("--max-num-seqs", "2", "--max-model-len", "512"))
    assert other.kv_spec is not None and other.kv_spec.digest() != pod.spec.digest()
    other.attach_private()
    other.attach_kv_pool(memoryview(bytearray(other.kv_spec.pool_bytes)), 5)
    assert other.kv_pool is not None and other.kv_pool.stats.records == 0
    # The same bytes under another spec read as an empty log too.
    mem = memoryview(pod.memory)[: other.kv_spec.pool_bytes]
    other.attach_kv_pool(mem, 6)
    assert other.kv_pool.stats.sealed_at_adoption == 0
    assert kvlog.decode_header(mem[: kvlog.HEADER_SIZE]) == (
        other.kv_spec.digest(),
        other.kv_spec.log_capacity,
    )


async def test_a_pool_sealed_in_an_older_format_is_refused_and_recomputed(
    pod: Pod, caplog: pytest.LogCaptureFixture
) -> None:
    """A seal log of format version 1 (CRC-32 checksums) under this engine's own
    spec: nothing of it is trusted, the refusal is logged with both versions,
    and the continuation is recomputed to the same tokens."""
    first = pod.next_engine()
    prompt = prompt_of(first, 80)
    whole = await run(first, prompt, GREEDY)
    first.close()
    header = bytearray(kvlog.encode_header(pod.spec)[:-4])
    struct.pack_into("<I", header, 8, 1)  # the version field, after the magic
    pod.memory[: len(header) + 4] = bytes(header) + struct.pack("<I", zlib.crc32(header))
    with caplog.at_level("WARNING", logger="understudy.engine_shim.kvpool"):
        nxt = pod.next_engine()
    assert nxt.kv_pool is not None and nxt.kv_pool.stats.sealed_at_adoption == 0
    assert "event=kv_not_adopted" in caplog.text and "format version 1" in caplog.text
    assert await run(nxt, prompt, GREEDY, whole[:10]) == whole[10:]
    assert nxt.kv_pool.stats.reused_blocks == 0
    assert kvlog.header_version(pod.memory[: kvlog.HEADER_SIZE]) == kvlog.VERSION
