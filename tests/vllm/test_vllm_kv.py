"""The CPU standby's KV cache (adapters/vllm_kv) over real torch tensors: views
of one buffer, as vLLM binds them into its layers. Released, the buffer's
pages go back to the kernel (the process's RSS drops by its size) while every
view stays valid and reads zeros; populated, they are committed again."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from understudy.engine_shim.adapters import vllm_kv

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MiB = 1 << 20


def _rss() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Rss")


def test_pages_are_the_whole_pages_inside() -> None:
    page = vllm_kv.PAGE
    assert vllm_kv.pages(0, 3 * page) == (0, 3 * page)
    assert vllm_kv.pages(1, 3 * page) == (page, 2 * page)  # both ends partial
    assert vllm_kv.pages(page - 64, page) == (page, 0)  # no whole page inside
    assert vllm_kv.pages(2 * page, page - 1) == (2 * page, 0)


def test_released_views_read_zeros_and_the_memory_goes_back() -> None:
    import torch

    buf = torch.ones(256 * MiB, dtype=torch.int8)
    # three layers' views, and one more view of the same first layer
    views = [buf[i * 64 * MiB : (i + 1) * 64 * MiB].view(torch.float32) for i in range(3)]
    views.append(buf[: 64 * MiB].view(torch.float32)[:16])
    worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=views))
    assert vllm_kv.storages(views) == [(buf.data_ptr(), 256 * MiB)]

    before = _rss()
    released = vllm_kv.release(worker)
    assert released >= 256 * MiB - 2 * vllm_kv.PAGE
    assert before - _rss() > 200 * MiB
    assert int(buf.count_nonzero()) <= 2 * vllm_kv.PAGE  # at most the partial end pages
    views[1].fill_(2.0)  # still a valid tensor: the pages come back on first touch
    assert float(views[1][-1]) == 2.0

    low = _rss()
    assert vllm_kv.populate(worker) == released
    assert _rss() - low > 100 * MiB


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
