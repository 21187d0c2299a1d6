"""The ``vllm`` engine's KV cache across real engine deaths, through the GMS KV pool.

A local pod of vLLM-CPU engines (lock server, GMS, front, a primary and a
shadow), the KV connector on (``--kv-pool on``, the default). A greedy stream
through the front, the Active engine kill -9'd in the middle of it: the next
engine adopts the pool's seal log, vLLM's scheduler asks the connector for
the continuation's prefix, the connector loads it into vLLM's blocks, and
vLLM computes only the rest. Each test asserts the stream is byte for byte
the uninterrupted one (streamed first, through the same pod), what the next
engine reused (its log), and a bound on the gap. tiny-llama's random weights
make any wrong byte of reused KV show in the text within a few tokens.

The pool's own failure cases (a torn seal-log write, GMS dying, a stale
epoch) are the same code for both engines: tests/process/test_kv_failover.py
and tests/process/gms/test_gms_kv.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from kvfailover import (
    PROMPT,
    adopted_line,
    gap_after,
    killed_stream,
    local_pod,
    reused,
    stream,
    tiny_llama_ids,
)
from localpod import LocalPod
from procs import wait_for

from understudy.engine_shim.adapters.vllm_kvmove import mover

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

GAP_BOUND_S = 15.0  # kill to the next token, on a loaded 2-core machine
START_S = 900.0  # vLLM engines importing at once on a busy 2-core machine


@pytest.fixture
def pod_factory() -> Iterator[Callable[..., LocalPod]]:
    pods: list[LocalPod] = []

    def make(*extra: str, failpoints: str = "") -> LocalPod:
        pod = local_pod("vllm", *extra, failpoints=failpoints)
        pods.append(pod)
        try:
            pod.wait_armed(START_S)
        except BaseException:
            print(pod.diagnostics())
            raise
        return pod

    yield make
    for pod in pods:
        pod.close()


def next_active(pod: LocalPod, not_pid: int) -> dict:
    def found() -> dict | None:
        act = pod.by_state("Active")
        return act[0] if act and act[0].get("pid") != not_pid else None

    return wait_for(found, 60, what="a new Active engine")


def test_two_kills_in_a_row_each_next_engine_adopts_and_the_streams_are_identical(
    pod_factory: Callable[..., LocalPod],
) -> None:
    pod = pod_factory()
    want, _ = stream(pod.serve_port, lambda _: None)
    n = len(tiny_llama_ids(PROMPT))
    epochs = []
    for round_ in range(2):
        pod.wait_armed(START_S)
        got, at, pid, times = killed_stream(pod, 40)
        assert got == want, f"round {round_}"
        new = next_active(pod, pid)
        log = pod.log(new["name"]).split("event=starting")[-1]
        epochs.append(adopted_line(log)["epoch"])
        # The continuation's prompt and the ids streamed before the kill, all
        # but what the dead engine's last step was computing (whole 16s).
        assert reused(log) and max(reused(log)) >= (n + 38) // 16 * 16, log[-3000:]
        assert gap_after(at, times) < GAP_BOUND_S
    # The third engine adopted blocks the second one sealed.
    third = adopted_line(pod.log(next_active(pod, 0)["name"]).split("event=starting")[-1])
    assert epochs[0] in third.get("epochs", ""), third


def test_a_corrupted_block_is_detected_recomputed_and_the_answer_is_identical(
    pod_factory: Callable[..., LocalPod],
) -> None:
    # Each adoption changes block 2 under its seal. The standby copies no
    # block before the kill (--kv-follow off): one it had copied before the
    # change would hold the sealed bytes, and nothing would be found.
    pod = pod_factory("--engine-arg=--kv-follow=off", failpoints="kv.block.corrupt=return")
    want, _ = stream(pod.serve_port, lambda _: None)
    got, _, pid, _ = killed_stream(pod, 40)
    assert got == want
    log = pod.log(next_active(pod, pid)["name"])
    assert re.search(r"kv_failpoint_corrupted .*block=2\b", log), log[-3000:]
    assert re.search(r"kv_corrupt_block .*block=2\b", log), log[-3000:]
    # Blocks 0 and 1 are trusted; block 2 and everything after it recomputed.
    assert re.search(r"kv_reused .*positions=32 .*corrupt=1", log), log[-3000:]
    # Found as the load copied the blocks (vllm_kvmove), after vLLM had been
    # told they were there: vLLM computed them again from a load error.
    if mover is not None:
        assert re.search(r"kv_loaded .*by=c summed=True", log), log[-3000:]
