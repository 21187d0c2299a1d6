"""The CPU standby's KV cache (adapters/vllm_kv) over real torch tensors: views
of one buffer, as vLLM binds them into its layers. Released at once, the
buffer's pages go back to the kernel (the process's RSS drops by its size)
while every view stays valid and reads zeros; released reclaimably, they
leave the working set and stay until the kernel takes them or the engine
writes them; populated, they are committed again."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from memstat import smaps as _smaps

from understudy.engine_shim import memadvise
from understudy.engine_shim.adapters import vllm_kv

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MiB = 1 << 20


def test_pages_are_the_whole_pages_inside() -> None:
    page = memadvise.PAGE
    assert memadvise.pages(0, 3 * page) == (0, 3 * page)
    assert memadvise.pages(1, 3 * page) == (page, 2 * page)  # both ends partial
    assert memadvise.pages(page - 64, page) == (page, 0)  # no whole page inside
    assert memadvise.pages(2 * page, page - 1) == (2 * page, 0)


def test_released_views_read_zeros_and_the_memory_goes_back() -> None:
    import torch

    buf = torch.ones(256 * MiB, dtype=torch.int8)
    # three layers' views, and one more view of the same first layer
    views = [buf[i * 64 * MiB : (i + 1) * 64 * MiB].view(torch.float32) for i in range(3)]
    views.append(buf[: 64 * MiB].view(torch.float32)[:16])
    worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=views))
    assert vllm_kv.storages(views) == [(buf.data_ptr(), 256 * MiB)]

    before = _smaps("Rss")
    released = vllm_kv.release(worker, reclaimable=False)
    assert released >= 256 * MiB - 2 * memadvise.PAGE
    assert before - _smaps("Rss") > 200 * MiB
    assert int(buf.count_nonzero()) <= 2 * memadvise.PAGE  # at most the partial end pages
    views[1].fill_(2.0)  # still a valid tensor: the pages come back on first touch
    assert float(views[1][-1]) == 2.0

    low = _smaps("Rss")
    assert vllm_kv.populate(worker) == released
    assert _smaps("Rss") - low > 100 * MiB


def test_reclaimable_pages_leave_the_working_set_and_come_back_when_written() -> None:
    """``MADV_FREE``: the pages stay mapped and present (a wake finds them
    with no fault unless the kernel needed them), they no longer count as
    the process's own (``LazyFree``: kubelet's working set leaves them out),
    and a write makes a page the engine's again."""
    import torch

    buf = torch.ones(256 * MiB, dtype=torch.int8)
    views = [buf[i * 64 * MiB : (i + 1) * 64 * MiB].view(torch.float32) for i in range(4)]
    worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=views))
    lazy, rss = _smaps("LazyFree"), _smaps("Rss")
    released = vllm_kv.release(worker, reclaimable=True)
    assert released >= 256 * MiB - 2 * memadvise.PAGE
    assert _smaps("LazyFree") - lazy > 200 * MiB
    assert rss - _smaps("Rss") < 16 * MiB  # nothing unmapped
    views[1].fill_(2.0)  # written: the kernel may no longer take these 64 MiB
    assert float(views[1][-1]) == 2.0
    assert 120 * MiB < _smaps("LazyFree") - lazy < 200 * MiB
    vllm_kv.populate(worker)  # committed again: none left for the kernel to take
    assert _smaps("LazyFree") - lazy < 16 * MiB


def test_a_runner_without_a_kv_cache_is_an_error() -> None:
    worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=[]))
    with pytest.raises(RuntimeError, match="no KV cache"):
        vllm_kv.release(worker)


MAPS = """\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
7f0000000000-7f0000600000 rw-p 00000000 00:00 0
7f0000600000-7f0000800000 ---p 00000000 00:00 0
7f0000800000-7f0000a00000 rw-s 00000000 00:05 1234    /memfd:gms (deleted)
7f0000a00000-7f0000a01000 rw-p 00000000 00:00 0
7f0001000000-7f0001400000 rw-p 00000000 00:00 0       [heap]
7f0002000000-7f0002400000 rw-p 00001000 08:02 99      /usr/lib/libfoo.so
7ffc00000000-7ffc00400000 rw-p 00000000 00:00 0       [stack]
"""


def test_only_large_private_anonymous_memory_is_collapsed() -> None:
    assert vllm_kv.anonymous_regions(MAPS) == [
        (0x7F0000000000, 0x7F0000600000),  # anonymous: torch's tensors, repacked weights
        (0x7F0001000000, 0x7F0001400000),  # the heap
    ]  # not code, reservations, shared memory (GMS), file data, a page, the stack


def test_collapse_skips_what_it_is_told_to() -> None:
    assert vllm_kv._minus(0, 100, [(10, 20), (50, 10)]) == [(0, 10), (30, 50), (60, 100)]
    assert vllm_kv._minus(0, 100, [(0, 100)]) == []
    assert vllm_kv._minus(0, 100, [(200, 10)]) == [(0, 100)]


def test_block_spans_are_each_layers_runs_of_blocks() -> None:
    import torch

    caches = [torch.zeros(10, 3, 16, 128) for _ in range(2)]  # [blocks, heads, size, 2 * dim]
    per = 3 * 16 * 128 * 4
    spans = vllm_kv.block_spans(caches, [7, 2, 1, 3, 2])
    assert spans == [
        (c.data_ptr() + lo * per, n * per) for c in caches for lo, n in ((1, 3), (7, 1))
    ]
    assert vllm_kv.block_spans(caches, []) == []


def test_the_next_free_blocks_are_the_ones_a_new_request_gets(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the wake backs ahead of a continuation (adapters/vllm.py,
    attach_kv_pool) is read from vLLM's internals: the blocks it names must
    be the ones vLLM then gives, on a fresh queue and on one that finished
    requests have reordered."""
    from vllm import SamplingParams
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from understudy.engine_shim.adapters.vllm import VLLM_ENV_DEFAULTS

    for key, value in VLLM_ENV_DEFAULTS.items():  # the engine core in this process
        monkeypatch.setenv(key, value)
    args = EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=512, seed=0, enforce_eager=True
    )
    engine = LLMEngine.from_engine_args(args)
    try:
        scheduler = engine.engine_core.engine_core.scheduler
        manager = scheduler.kv_cache_manager
        size = int(engine.vllm_config.cache_config.block_size)
        for n, first in ((40, 1), (3 * size + 5, 2), (20, 3)):
            want = vllm_kv.next_free_blocks(engine, -(-n // size))
            assert len(want) == -(-n // size)
            rid = f"r{first}"
            prompt = {"prompt_token_ids": [first] + [7 + i % 90 for i in range(n - 1)]}
            engine.add_request(rid, prompt, SamplingParams(max_tokens=3, temperature=0))
            engine.step()
            (inner,) = (r for r in scheduler.requests if r.startswith(rid))  # vLLM adds a suffix
            assert list(manager.get_block_ids(inner)[0][: len(want)]) == want
            while engine.has_unfinished_requests():
                engine.step()
        assert vllm_kv.next_free_blocks(object(), 3) == []  # not vLLM's engine: nothing
    finally:
        engine.engine_core.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()
