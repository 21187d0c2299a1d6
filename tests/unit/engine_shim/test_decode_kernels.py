"""The decode kernels (C, through ctypes): the attention against a float64
softmax attention and the products against float64 products, the properties
a failover's determinism rests on (a row's bits go by its own inputs only),
and their refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from understudy.engine_shim import kvlog, kvpool
from understudy.engine_shim.adapters import decode_kernels
from understudy.engine_shim.adapters.decode_kernels import (
    ENV,
    THREADS_ENV,
    Kernels,
    cpu_share,
    threads_wanted,
)
from understudy.engine_shim.kvpool import KvPool

F32 = npt.NDArray[np.float32]

kernel = decode_kernels.kernels
needs_kernel = pytest.mark.skipif(
    kernel is None, reason="the package was installed without its C kernels (no compiler)"
)


def test_the_kernel_is_built_where_ci_installs_the_package() -> None:
    """hack/setup builds it (a C compiler is there): a build that failed is
    skipped silently by setuptools (the extension is optional), so CI says it."""
    if not os.environ.get("CI"):
        pytest.skip("checked under CI=true, whose machine has a C compiler")
    assert kernel is not None, "adapters/_decode.c was not built: see hack/setup's log"


def _arrays(
    seed: int, kvh: int, rep: int, d: int, max_len: int, scale: float = 1.0
) -> tuple[F32, F32, F32]:
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((kvh, rep, d)) * scale / np.sqrt(d)).astype(np.float32)
    keys = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
    values = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
    return q, keys, values


def _reference(q: F32, keys: F32, values: F32, length: int) -> npt.NDArray[np.float64]:
    scores = q.astype(np.float64) @ keys[:, :length].astype(np.float64).transpose(0, 2, 1)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out: npt.NDArray[np.float64] = probs @ values[:, :length].astype(np.float64)
    return out


def _attend(k: Kernels, q: F32, keys: F32, values: F32, length: int) -> F32:
    out = np.full(q.shape, np.nan, dtype=np.float32)
    k.attend(q, keys, values, length, out)
    return out


@needs_kernel
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rep", [1, 3])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 63, 64, 65, 1000])
def test_the_kernel_computes_softmax_attention(d: int, rep: int, length: int) -> None:
    assert kernel is not None
    q, keys, values = _arrays(length, 3, rep, d, 1024)
    got = _attend(kernel, q, keys, values, length)
    np.testing.assert_allclose(got, _reference(q, keys, values, length), rtol=0, atol=2e-6)


@needs_kernel
def test_scores_far_apart_give_no_nan_and_the_softmax_s_answer() -> None:
    """Scores hundreds apart: every exponent far under -87 (the kernel's floor)."""
    assert kernel is not None
    q, keys, values = _arrays(5, 3, 3, 64, 512, scale=400.0)
    got = _attend(kernel, q, keys, values, 500)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _reference(q, keys, values, 500), rtol=0, atol=2e-6)


@needs_kernel
def test_a_rows_bits_go_by_its_own_positions_only() -> None:
    """The same row over the same positions, in a longer cache, at another
    address, with other numbers past its length: the same bits."""
    assert kernel is not None
    q, keys, values = _arrays(7, 3, 3, 64, 300)
    alone = _attend(kernel, q, keys, values, 300)
    big_k, big_v = (
        np.random.default_rng(8).standard_normal((3, 2048, 64)).astype(np.float32) for _ in range(2)
    )
    big_k[:, :300], big_v[:, :300] = keys, values
    assert np.array_equal(_attend(kernel, q.copy(), big_k, big_v, 300), alone)


@needs_kernel
@pytest.mark.parametrize("d", [64, 128])
def test_a_positions_score_has_the_same_bits_in_a_group_of_8_or_at_the_end(d: int) -> None:
    """The kernel sums 8 positions' scores at once and a sequence's last few
    one by one, by the same tree: a row over ``length`` positions, then the
    same row with positions past them that add nothing (scores so low that
    e^x is the kernel's floor, values 0), so that its own last positions fall
    in a group of 8: the same bits."""
    assert kernel is not None
    for length in range(1, 18):
        q, keys, values = _arrays(length, 3, 3, d, 32)
        q = np.abs(q)  # every score of the padding far below the others
        keys[:, length:], values[:, length:] = -50.0, 0.0
        padded = -(-(length + 1) // 8) * 8 + 8
        alone = _attend(kernel, q, keys, values, length)
        assert np.array_equal(_attend(kernel, q, keys, values, padded), alone), length


@needs_kernel
@pytest.mark.parametrize(
    "case",
    ["q not contiguous", "keys transposed", "no positions", "past the cache", "float64", "out"],
)
def test_arrays_not_of_the_kernels_layout_are_refused_and_nothing_is_written(case: str) -> None:
    assert kernel is not None
    q, keys, values = _arrays(9, 3, 3, 64, 128)
    out = np.zeros_like(q)
    length = 100
    if case == "q not contiguous":
        q = np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)
    elif case == "keys transposed":
        keys = np.ascontiguousarray(keys.transpose(0, 2, 1)).transpose(0, 2, 1)
    elif case == "no positions":
        length = 0
    elif case == "past the cache":
        length = 129
    elif case == "float64":
        keys = keys.astype(np.float64)  # type: ignore[assignment]
    else:
        out = np.zeros((3, 3, 32), dtype=np.float32)
    with pytest.raises(ValueError, match="not the kernel's layout"):
        kernel.attend(q, keys, values, length, out)
    assert not out.any()


# --- a row in parts, on more than one core ------------------------------------------


@pytest.fixture
def kernel_threads() -> Iterator[Callable[[int], int]]:
    """`Kernels.set_threads` (one setting per process) for a test, the number
    put back after it."""
    assert kernel is not None
    before = kernel.threads
    yield kernel.set_threads
    kernel.set_threads(before)


@needs_kernel
def test_the_workers_start_when_asked_before_any_row_needs_them() -> None:
    """`Kernels.start` (the llama model, when it is built) starts the
    library's workers, not a failover's first long row: a thread that row
    created ran on its creator's CPU. Once: asked again, none more. In a
    fresh process, which no row has touched."""
    code = (
        "import os\n"
        "from understudy.engine_shim.adapters.decode_kernels import kernels\n"
        "tasks = lambda: len(os.listdir('/proc/self/task'))\n"
        "kernels.set_threads(3)\n"
        "before = tasks()\n"
        "print(kernels.start(), tasks() - before, kernels.start(), tasks() - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["2", "2", "2", "2"]


@needs_kernel
@pytest.mark.parametrize(
    ("spin_us", "awake"),
    [(None, False), ("0", False), ("1000000", True)],
)
def test_a_worker_waits_awake_for_the_next_row_as_long_as_it_is_set(
    spin_us: str | None, awake: bool
) -> None:
    """After a row in parts its worker spins for the next one (spin_ns, 2 ms
    unless `SPIN_ENV` sets it: a step's layers post one each, their
    products apart), then sleeps: 50 ms after the last row, a process that
    stopped computing spends no more CPU, unless its workers were told to
    wait a second. In a fresh process, where the workers are this test's
    own and the environment is read."""
    env = {k: v for k, v in os.environ.items() if k != decode_kernels.SPIN_ENV}
    if spin_us is not None:
        env[decode_kernels.SPIN_ENV] = spin_us
    code = (
        "import time\n"
        "import numpy as np\n"
        "from understudy.engine_shim.adapters.decode_kernels import kernels\n"
        "kernels.set_threads(2)\n"
        "kernels.start()\n"
        "rng = np.random.default_rng(0)\n"
        "q = rng.standard_normal((3, 3, 64)).astype(np.float32)\n"
        "kv = rng.standard_normal((3, 4096, 64)).astype(np.float32)\n"
        "out = np.empty_like(q)\n"
        "for _ in range(30):\n"
        "    kernels.attend(q, kv, kv, 4000, out)\n"
        "time.sleep(0.05)\n"
        "before = time.process_time()\n"
        "time.sleep(0.3)\n"
        "print(round((time.process_time() - before) * 1000))\n"  # ms of CPU, every thread
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
        env=env,
    )  # fmt: skip
    spent = int(out.stdout)
    if awake:
        assert spent > 60, f"{spent} ms of CPU in 300 ms: the worker slept, told to wait 1 s"
    else:
        assert spent < 30, f"{spent} ms of CPU in 300 ms with no row: a worker kept spinning"


@needs_kernel
def test_the_spin_is_set_and_refused_below_zero() -> None:
    assert kernel is not None
    before = kernel.spin_us
    try:
        assert kernel.set_spin_us(0) == kernel.spin_us == 0
        assert kernel.set_spin_us(1500) == kernel.spin_us == 1500
        with pytest.raises(ValueError, match="0 or more"):
            kernel.set_spin_us(-1)
        assert kernel.spin_us == 1500
    finally:
        kernel.set_spin_us(before)


def test_the_spin_comes_from_the_environment() -> None:
    assert decode_kernels.spin_wanted({}) is None  # the library's 2 ms
    assert decode_kernels.spin_wanted({decode_kernels.SPIN_ENV: "0"}) == 0
    assert decode_kernels.spin_wanted({decode_kernels.SPIN_ENV: "250"}) == 250
    for bad in ("-1", "two", "1.5", " 3"):
        with pytest.raises(ValueError, match=f"{decode_kernels.SPIN_ENV}="):
            decode_kernels.spin_wanted({decode_kernels.SPIN_ENV: bad})


@needs_kernel
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("length", [513, 1024, 1025, 3001, 4000])
def test_a_row_in_parts_is_softmax_attention_and_its_bits_go_by_no_thread_count(
    d: int, length: int, kernel_threads: Callable[[int], int]
) -> None:
    """Past 512 positions a row goes in parts of 512, each part's softmax
    against its own maximum, rescaled at the end: the float64 softmax's
    answer, with the same bits on 1, 2 or 3 threads (which part a thread
    takes changes from call to call)."""
    assert kernel is not None
    q, keys, values = _arrays(length, 3, 3, d, 4096, scale=4.0)
    kernel_threads(1)
    alone = _attend(kernel, q, keys, values, length)
    want = _reference(q, keys, values, length)  # a sharp softmax (scale 4): outputs up to 3
    np.testing.assert_allclose(alone, want, rtol=2e-6, atol=2e-6)
    for threads in (2, 3, 2):
        kernel_threads(threads)
        for _ in range(3):
            assert np.array_equal(_attend(kernel, q, keys, values, length), alone), threads


@needs_kernel
def test_parts_far_apart_give_the_softmax_s_answer() -> None:
    """A part whose scores are hundreds under another's: its weight floors at
    e^-87 and it adds nothing, as in one softmax."""
    assert kernel is not None
    q, keys, values = _arrays(11, 3, 3, 64, 2048)
    keys[:, 700:900] = q.mean(axis=1)[:, None, :] * 400.0  # positions of one part far above
    got = _attend(kernel, q, keys, values, 2000)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _reference(q, keys, values, 2000), rtol=0, atol=2e-6)


@needs_kernel
def test_rows_from_two_threads_at_once_are_each_their_own(
    kernel_threads: Callable[[int], int],
) -> None:
    """Two Python threads in the kernel at once (ctypes lets go of the GIL):
    one has the workers, the other computes its row alone; both rows are the
    ones each computes by itself."""
    assert kernel is not None
    kernel_threads(2)
    inputs = [_arrays(seed, 3, 3, 64, 4096) for seed in (21, 22)]
    want = [_attend(kernel, q, k, v, 4000) for q, k, v in inputs]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(20):
            got = list(pool.map(lambda a: _attend(kernel, *a, 4000), inputs))  # type: ignore[arg-type]
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


@needs_kernel
def test_a_forked_child_computes_with_workers_of_its_own(
    kernel_threads: Callable[[int], int],
) -> None:
    """The parent's workers do not exist in a forked child: it starts its own
    (one more thread of its own after its first row) and computes the same
    bits (a hang here would be a child waiting on a lock a worker held at the
    fork)."""
    assert kernel is not None
    kernel_threads(2)
    q, keys, values = _arrays(31, 3, 3, 64, 4096)
    want = _attend(kernel, q, keys, values, 4000)  # the parent's workers are running
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        before = len(os.listdir("/proc/self/task"))
        same = all(np.array_equal(_attend(kernel, q, keys, values, 4000), want) for _ in range(5))
        started = len(os.listdir("/proc/self/task")) - before
        os._exit(0 if same and started == 1 else 1 if same else 2)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish its rows in 60 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0, "1: no worker started; 2: other bits"


@needs_kernel
def test_the_threads_are_set_and_clamped(kernel_threads: Callable[[int], int]) -> None:
    assert kernel is not None
    assert kernel.set_threads(3) == kernel.threads == 3
    assert kernel.set_threads(100) == 8
    with pytest.raises(ValueError, match="1 or more"):
        kernel.set_threads(0)
    assert kernel.threads == 8


def test_the_default_threads_are_the_cpu_share_up_to_two(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    for text, share in [
        ("max 100000\n", cpus),
        ("150000 100000\n", 1),  # limits.cpu 1.5: one whole core
        ("50000 100000\n", 1),  # under one core: still one thread
        (f"{100000 * (cpus + 4)} 100000\n", cpus),  # a limit past the affinity
        ("garbage\n", cpus),
    ]:
        cpu_max.write_text(text)
        assert cpu_share(cpu_max) == share, text
    assert cpu_share(tmp_path / "absent") == cpus
    assert threads_wanted({}) == min(2, cpu_share())
    assert threads_wanted({THREADS_ENV: "3"}) == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match=f"{THREADS_ENV}="):
            threads_wanted({THREADS_ENV: bad})


@needs_kernel
def test_shapes_it_does_not_take_are_left_to_numpy() -> None:
    assert kernel is not None
    assert kernel.takes(3, 3, 64) and kernel.takes(8, 4, 128)
    assert not kernel.takes(3, 3, 32)  # head_dim: 64 and 128 only
    assert not kernel.takes(1, 17, 64)  # more query heads per KV head than it holds


def test_numpy_s_form_is_chosen_by_the_environment() -> None:
    code = "from understudy.engine_shim.adapters import decode_kernels as d; print(d.kernels)"
    env = {**os.environ, ENV: "numpy"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "None"


needs_products = pytest.mark.skipif(
    kernel is None or not kernel.has_products, reason="no C kernels, or a CPU without AVX2 and FMA"
)


@needs_products
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536), (5, 256), (1001, 64)])
def test_products_are_float64_s_to_float32_s_rounding(shape: tuple[int, int]) -> None:
    assert kernel is not None
    rng = np.random.default_rng(shape[0])
    weight = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((11, shape[1])).astype(np.float32)
    got = kernel.products(x, weight)
    want = x.astype(np.float64) @ weight.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.sqrt(shape[1]))


@needs_products
def test_a_rows_products_are_the_same_bits_in_any_step() -> None:
    """A row alone, and at every place of steps of 2 to 11 rows (tiles of 4,
    2 and 1 rows), against weights of 3 rows a tile and the rows left over."""
    assert kernel is not None
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((1001, 576)).astype(np.float32)
    x = rng.standard_normal((11, 576)).astype(np.float32)
    alone = np.concatenate([kernel.products(x[i : i + 1], weight) for i in range(11)])
    for rows in range(2, 12):
        for first in range(0, 12 - rows):
            step = kernel.products(x[first : first + rows], weight)
            assert np.array_equal(step, alone[first : first + rows]), (rows, first)


@needs_products
def test_products_refuse_what_they_do_not_take() -> None:
    assert kernel is not None
    weight = np.ones((8, 64), dtype=np.float32)
    assert kernel.takes_products([weight])
    assert not kernel.takes_products([np.ones((8, 60), dtype=np.float32)])  # not 8 floats wide
    assert not kernel.takes_products([weight[:, ::2]])  # not contiguous
    assert not kernel.takes_products([weight.astype(np.float64)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="products"):
        kernel.products(np.ones((2, 32), dtype=np.float32), weight)


# --- a claim's checksums, summed by the attention as it reads the blocks ---------


def _pool(d: int, max_len: int = 96) -> KvPool:
    spec = kvlog.PoolSpec(
        "m", layers=3, kv_heads=2, head_dim=d, dtype="float32", slots=2, max_len=max_len
    )
    pool = KvPool(memoryview(bytearray(spec.pool_bytes)), spec, 1)
    rng = np.random.default_rng(d)
    pool.k[...] = rng.standard_normal(pool.k.shape, dtype=np.float32)
    pool.v[...] = rng.standard_normal(pool.v.shape, dtype=np.float32)
    return pool


@needs_kernel
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("length", [16, 47, 64, 65, 96, 1100])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_attention_sums_the_pools_block_checksums_as_it_reads_them(
    d: int, length: int, threads: int, kernel_threads: Callable[[int], int]
) -> None:
    """A step's row over every layer, given the pool's `block_sums`: each
    whole block's sum is the pool's own checksum of it (kvlog's
    block_checksum), and the row's output is what it is without sums. Over
    1,100 positions (three parts) on two threads too, each adding its parts'
    blocks."""
    assert kernel is not None
    kernel_threads(threads)
    pool, slot = _pool(d, max_len=max(96, length)), 1
    blocks = length // 16
    checking = kvpool.Checking(slot, blocks * 16, length, 0, 16, Future())
    summed = pool.block_sums(checking)
    q = np.random.default_rng(3).standard_normal((2, 2, d)).astype(np.float32) / 8
    for layer in range(pool.spec.layers):
        out = np.empty_like(q)
        kernel.attend(q, pool.rk[layer, slot], pool.rv[layer, slot], length, out, summed, layer)
        plain = _attend(kernel, q, pool.rk[layer, slot], pool.rv[layer, slot], length)
        assert np.array_equal(out, plain)
    assert summed.total.tolist() == [pool.checksum(slot, b, 16) for b in range(blocks)]
    # one word changed: its block's sum differs, and only its block's
    pool.v[2, slot, 1, 16 * (blocks - 1) + 3].view(np.uint32)[5] ^= 1
    again = pool.block_sums(checking)
    for layer in range(pool.spec.layers):
        kernel.attend(q, pool.rk[layer, slot], pool.rv[layer, slot], length, out, again, layer)
    assert again.total.tolist()[:-1] == summed.total.tolist()[:-1]
    assert again.total[-1] != summed.total[-1]
    assert again.total[-1] == pool.checksum(slot, blocks - 1, 16)


@needs_kernel
def test_block_sums_past_the_length_or_of_other_shapes_are_refused() -> None:
    assert kernel is not None
    pool = _pool(64)
    q = np.zeros((2, 2, 64), dtype=np.float32)
    out = np.full_like(q, np.nan)
    past = pool.block_sums(kvpool.Checking(0, 48, 48, 0, 16, Future()))
    with pytest.raises(ValueError, match="past 40 positions"):
        kernel.attend(q, pool.rk[0, 0], pool.rv[0, 0], 40, out, past, 0)
    other = pool.block_sums(kvpool.Checking(0, 32, 48, 0, 16, Future()))
    with pytest.raises(ValueError, match="not for 2 heads of 128"):
        bad = np.zeros((2, 2, 128), dtype=np.float32)
        keys = np.zeros((2, 96, 128), dtype=np.float32)
        kernel.attend(bad, keys, keys, 40, np.empty_like(bad), other, 0)
    with pytest.raises(ValueError, match="at layer 3"):
        kernel.attend(q, pool.rk[0, 0], pool.rv[0, 0], 40, out, other, 3)
    assert np.isnan(out).all() and not other.total.any()
