"""The KV pool across real engine deaths: a local pod (lock server, GMS, front,
llama engines), a greedy stream through the front, and the Active engine
killed in the middle of it. Each test asserts that the stream the client got
is byte for byte the uninterrupted one (computed here, in this process, by
the same engine code), that the next engine adopted the pool (or, where it
must not, recomputed), and a bound on the gap.

The failure cases of docs/kv-pool.md, each with real processes:
- SIGKILL in the middle of a step (a kill -9 from outside while it streams);
- SIGKILL in the middle of a seal-log write (failpoint ``kv.seal.torn``);
- a block corrupted on purpose (failpoint ``kv.block.corrupt``);
- GMS itself dying: the pool is lost and the engines recompute;
- two kills in a row: the third engine adopts what the second sealed.
A stale epoch asking for the pool is refused: tests/process/gms/test_gms_kv.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable, Iterator

import pytest
from kvfailover import (
    MAX_TOKENS,
    PROMPT,
    adopted_line,
    gap_after,
    local_pod,
    reused,
    stream,
    tiny_llama_ids,
)
from localpod import LocalPod
from procs import wait_for

from understudy.engine_shim.adapters import decode_kernels, tiny_llama
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.generation import SamplingParams

pytestmark = [pytest.mark.process, pytest.mark.slow]

GAP_BOUND_S = 15.0  # kill to the next token, on a loaded 2-core machine


def greedy(prompt: str) -> list[int]:
    """The uninterrupted greedy answer to ``prompt``, by the engine's code in
    this process (its KV cache in a private pool: the same chunked prefill as
    the pod's)."""
    engine = LlamaEngine(tiny_llama.BUILTIN)
    engine.attach_private()
    assert engine.kv_spec is not None
    engine.attach_kv_pool(memoryview(bytearray(engine.kv_spec.pool_bytes)), 1)
    engine.wake()
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)

        async def run() -> list[int]:
            return [s.token_id async for s in engine.generate(engine.encode(prompt), params)]

        return asyncio.run(run())
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], str]:
    """`greedy`'s answer to PROMPT: its ids and its text."""
    ids = greedy(PROMPT)
    return ids, LlamaEngine(tiny_llama.BUILTIN).decode(ids)


@pytest.fixture
def pod_factory() -> Iterator[Callable[..., LocalPod]]:
    pods: list[LocalPod] = []

    def make(*extra: str, shadows: int = 1, failpoints: str = "") -> LocalPod:
        pod = local_pod("llama", *extra, shadows=shadows, failpoints=failpoints)
        pods.append(pod)
        pod.wait_armed(180)
        return pod

    yield make
    for pod in pods:
        pod.close()


def kill_active_at(
    pod: LocalPod, chunk: int, killed: list[tuple[int, float]]
) -> Callable[[int], None]:
    """An on_chunk that kill -9s the Active engine when chunk ``chunk`` arrives."""

    def on_chunk(n: int) -> None:
        if n == chunk:
            active = pod.armed() or pod.by_state("Active")[0]
            os.kill(active["pid"], signal.SIGKILL)
            killed.append((active["pid"], time.monotonic()))

    return on_chunk


def active_log(pod: LocalPod, not_pid: int | None = None) -> str:
    def found() -> dict | None:
        act = pod.by_state("Active")
        return act[0] if act and act[0].get("pid") != not_pid else None

    active = wait_for(found, 60, what="a new Active engine")
    return pod.log(active["name"])


def test_sigkill_mid_step_the_next_engine_adopts_and_the_stream_is_identical(
    pod_factory: Callable[..., LocalPod], reference: tuple[list[int], str]
) -> None:
    ids, text = reference
    assert len(ids) == MAX_TOKENS  # the prompt runs the whole way: no early stop
    pod = pod_factory()
    # The standby maps the pool read-only once the Active has made it (kvreader).
    (standby,) = pod.by_state("Standby")
    wait_for(lambda: "event=kv_view_mapped" in pod.log(standby["name"]), 30, what="the view")
    killed: list[tuple[int, float]] = []
    got, times = stream(pod.serve_port, kill_active_at(pod, 40, killed))
    assert got == text
    pid, at = killed[0]
    log = active_log(pod, not_pid=pid)
    assert "kv_reused" in log, log[-3000:]
    assert re.search(r"event=kv_pool .*premapped=True", log), log[-3000:]  # read through it
    assert max(reused(log)) >= len(tiny_llama_ids(PROMPT)) // 64 * 64
    assert gap_after(at, times) < GAP_BOUND_S


def test_a_stream_past_512_positions_in_parts_on_two_threads_is_one_threads_answer(
    pod_factory: Callable[..., LocalPod], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 512 positions the attention goes in parts (decode_kernels): the
    pod's engines compute them on two threads, the adopting one summing the
    checksums of its blocks in parts too, and the answer is the one this
    process computes on one thread, byte for byte, across the kill."""
    prompt = PROMPT * 12
    assert len(tiny_llama_ids(prompt)) > 2 * 512 - MAX_TOKENS  # 3 parts by the end
    native = decode_kernels.kernels
    if native is None:
        pytest.skip("the package was built without its C kernels")
    threads = native.threads
    native.set_threads(1)
    try:
        want = LlamaEngine(tiny_llama.BUILTIN).decode(greedy(prompt))
    finally:
        native.set_threads(threads)
    monkeypatch.setenv(decode_kernels.THREADS_ENV, "2")  # the runner passes it on
    pod = pod_factory()
    killed: list[tuple[int, float]] = []
    got, times = stream(pod.serve_port, kill_active_at(pod, 40, killed), prompt)
    assert got == want
    pid, at = killed[0]
    assert max(reused(active_log(pod, not_pid=pid))) > 512  # adopted, past the first part
    assert gap_after(at, times) < GAP_BOUND_S


def test_sigkill_mid_seal_log_write_leaves_a_readable_prefix(
    pod_factory: Callable[..., LocalPod], reference: tuple[list[int], str]
) -> None:
    _ids, text = reference
    n = len(tiny_llama_ids(PROMPT))
    # The prefill seals the prompt's blocks (the last in part), then every
    # step seals its sequence's last block again: die in the write of the 90th
    # step's seal. The next engine, armed alike, writes fewer records than
    # that for the rest of the stream.
    nth = -(-n // 16) + 90
    pod = pod_factory(failpoints=f"kv.seal.torn=kill@{nth}")
    first = pod.by_state("Active")[0]
    got, _ = stream(pod.serve_port, lambda _: None)
    assert got == text
    log = active_log(pod, not_pid=first["pid"])
    adopted = adopted_line(log)
    assert adopted["torn"] == "1", adopted
    assert int(adopted["records"]) == nth - 1  # every record before the torn one
    assert "kv_reused" in log


def test_a_corrupted_block_is_detected_recomputed_and_the_answer_is_identical(
    pod_factory: Callable[..., LocalPod], reference: tuple[list[int], str]
) -> None:
    _ids, text = reference
    pod = pod_factory(failpoints="kv.block.corrupt=return")  # each adoption: block 2
    killed: list[tuple[int, float]] = []
    got, _ = stream(pod.serve_port, kill_active_at(pod, 40, killed))
    assert got == text
    log = active_log(pod, not_pid=killed[0][0])
    assert re.search(r"kv_failpoint_corrupted .*block=2\b", log), log[-3000:]
    assert re.search(r"kv_corrupt_block .*block=2\b", log), log[-3000:]
    # Block 2 sits in the prompt's first chunk: the prompt is recomputed from 0.
    assert re.search(r"kv_reused .*positions=0 .*corrupt=1", log), log[-3000:]


def test_gms_dying_loses_the_pool_and_the_engines_recompute(
    pod_factory: Callable[..., LocalPod], reference: tuple[list[int], str]
) -> None:
    _ids, text = reference
    pod = pod_factory()
    gms_pid = pod.pid("gms")
    killed: list[tuple[int, float]] = []

    def on_chunk(n: int) -> None:
        if n == 30:
            os.kill(gms_pid, signal.SIGKILL)
            killed.append((gms_pid, time.monotonic()))

    got, _ = stream(pod.serve_port, on_chunk)
    assert got == text
    # Whoever serves now runs on a pool GMS created after its death: nothing
    # was adopted, the continuation recomputed.
    log = active_log(pod).split("event=starting")[-1]
    assert re.search(r"kv_pool .*created=True", log), log[-3000:]
    assert "kv_reused" not in log


def test_gms_dying_inside_a_wake_the_waking_engine_gives_the_weights_back_and_recomputes(
    pod_factory: Callable[..., LocalPod], reference: tuple[list[int], str]
) -> None:
    """The Active engine killed mid-stream, then GMS while the standby's remap
    holds the weights mapped (failpoint gms.remap.mapped holds it there): the
    standby gives them back to the restarted GMS and serves, the pool that died
    with GMS adopted by nobody; the continuation is recomputed and the stream
    is identical, and nothing is read from the checkpoint (docs/pod.md, a GMS
    that dies inside a wake)."""
    _ids, text = reference
    pod = pod_factory(failpoints="gms.remap.mapped=sleep(3)")
    names = ("engine-primary", "engine-shadow-1")
    loads = sum(pod.log(n).count("event=weights_loaded") for n in names)
    killed: list[tuple[int, float]] = []

    def on_chunk(n: int) -> None:
        if n != 20:
            return
        active = pod.armed() or pod.by_state("Active")[0]
        os.kill(active["pid"], signal.SIGKILL)
        killed.append((active["pid"], time.monotonic()))
        wait_for(lambda: pod.by_state("Waking"), 15, 0.01, what="the standby's wake")
        # Its remap's exports take milliseconds from the grant: well inside
        # the failpoint's 3 s when GMS dies.
        time.sleep(0.5)
        os.kill(pod.process("gms"), signal.SIGKILL)

    got, _ = stream(pod.serve_port, on_chunk)
    assert got == text
    log = active_log(pod, not_pid=killed[0][0]).split("event=starting")[-1]
    assert "event=readopted" in log, log[-3000:]
    assert "kv_reused" not in log
    assert sum(pod.log(n).count("event=weights_loaded") for n in names) == loads


def test_two_kills_in_a_row_the_third_engine_adopts_from_the_second(
    pod_factory: Callable[..., LocalPod], reference: tuple[list[int], str]
) -> None:
    _ids, text = reference
    pod = pod_factory(shadows=2)
    killed: list[tuple[int, float]] = []
    first_kill = kill_active_at(pod, 30, killed)

    def on_chunk(n: int) -> None:
        first_kill(n)
        if n == 90:
            active = wait_for(
                lambda: next((e for e in pod.by_state("Active") if e["pid"] != killed[0][0]), None),
                30,
                what="the second Active",
            )
            os.kill(active["pid"], signal.SIGKILL)
            killed.append((active["pid"], time.monotonic()))
            second_epoch.append(active["epoch"])

    second_epoch: list[int] = []
    got, _ = stream(pod.serve_port, on_chunk)
    assert got == text and len(killed) == 2
    third = wait_for(
        lambda: next(
            (e for e in pod.by_state("Active") if e["pid"] not in {p for p, _ in killed}), None
        ),
        60,
        what="the third Active",
    )
    adopted = adopted_line(pod.log(third["name"]))
    epochs = dict(pair.split(":") for pair in adopted["epochs"].split(","))
    assert str(second_epoch[0]) in epochs, adopted  # blocks the second engine sealed
    assert "kv_reused" in pod.log(third["name"])
