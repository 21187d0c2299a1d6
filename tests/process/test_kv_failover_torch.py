"""The ``torch`` engine's KV cache across real engine deaths, through the GMS KV pool.

The llama engine's pool (tests/process/test_kv_failover.py) with torch
computing: a local pod of torch engines on the CPU (lock server, GMS, front,
a primary and a shadow; the engines under the vLLM venv's python, which has
torch), a greedy stream through the front and the Active engine kill -9'd in
the middle of it. The stream is byte for byte the uninterrupted one (streamed
first, through the same pod: the reference needs torch, which this python
lacks), and the next engine adopted the prompt's blocks that the dead one
sealed: the 79-token prompt of the llama engine's tests, then one of 1,016.
The pool's own failure cases are the same code for both engines and are
tested there.
"""

from __future__ import annotations

from collections.abc import Iterator

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

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]

GAP_BOUND_S = 15.0  # kill to the next token, on a loaded 2-core machine
START_S = 300.0
LONG = "Each engine seals its blocks, and the next one adopts them after a kill. " * 35


@pytest.fixture
def pod() -> Iterator[LocalPod]:
    p = local_pod("torch")
    try:
        p.wait_armed(START_S)
    except BaseException:
        print(p.diagnostics())
        p.close()
        raise
    yield p
    p.close()


def next_active_log(pod: LocalPod, not_pid: int) -> str:
    def found() -> dict | None:
        act = pod.by_state("Active")
        return act[0] if act and act[0].get("pid") != not_pid else None

    active = wait_for(found, 60, what="a new Active engine")
    return pod.log(active["name"]).split("event=starting")[-1]


@pytest.mark.parametrize("prompt", [PROMPT, LONG], ids=["79", "1016"])
def test_sigkill_mid_stream_the_next_engine_adopts_and_the_stream_is_identical(
    pod: LocalPod, prompt: str
) -> None:
    n = len(tiny_llama_ids(prompt))
    want, _ = stream(pod.serve_port, lambda _: None, prompt)
    pod.wait_armed(START_S)
    got, at, pid, times = killed_stream(pod, 40, prompt)
    assert got == want
    log = next_active_log(pod, pid)
    assert adopted_line(log)["sealed"] != "0", log[-3000:]
    # The prompt and the ids streamed before the kill, but what the dead
    # engine's last step was computing (whole blocks of 16).
    assert reused(log) and max(reused(log)) >= (n + 38) // 16 * 16, log[-3000:]
    gap = gap_after(at, times)
    print(f"prompt of {n} tokens: {max(reused(log))} positions reused; kill -> token {gap:.2f} s")
    assert gap < GAP_BOUND_S
