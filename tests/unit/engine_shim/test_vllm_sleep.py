"""The vllm adapter's sleep and wake over a stand-in for vLLM's LLMEngine
(vLLM itself runs in tests/vllm; it has no GPU here): which of vLLM's calls
each platform's standby makes, and in what order.

- CPU: the engine core stays; its prefix cache is forgotten *before* the KV
  cache's pages go back to the kernel (a prefix hit on a released block would
  read zeros); the pages really go (RSS drops); wake builds nothing and, with
  ``--kv-at-wake populate``, commits them again.
- GPU (UNVERIFIED on a GPU): vLLM's own ``sleep(level=1)`` and ``wake_up()``,
  nothing of ours on the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.vllm import VllmEngine

MiB = 1 << 20


def _rss() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Rss")


class _Storage:
    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass
class _View:
    """What vllm_kv reads of a torch tensor: its storage."""

    base: np.ndarray[Any, Any]

    def untyped_storage(self) -> _Storage:
        return _Storage(self.base)


@dataclass
class StandInEngine:
    """The calls the adapter makes on vLLM's LLMEngine, recorded."""

    kv: np.ndarray[Any, Any]
    calls: list[str] = field(default_factory=list)

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def collective_rpc(self, fn: Any) -> list[Any]:
        self.calls.append(f"rpc:{fn.__name__}")
        worker = type("W", (), {})()
        worker.model_runner = type("R", (), {"kv_caches": [_View(self.kv), _View(self.kv)]})()
        return [fn(worker)]

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep:{level}")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def has_unfinished_requests(self) -> bool:
        return False


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"))


def _engine(model: Path, *args: str, backend: str = "host") -> tuple[VllmEngine, StandInEngine]:
    e = VllmEngine(str(model), args, backend=backend)
    stand_in = StandInEngine(np.ones(64 * MiB, dtype=np.uint8))
    e._engine = stand_in
    return e, stand_in


def test_cpu_standby_forgets_the_cache_then_gives_its_pages_back(model: Path) -> None:
    e, vllm = _engine(model)
    before = _rss()
    e.sleep()
    assert vllm.calls == ["reset_prefix_cache", "rpc:release"]
    assert before - _rss() > 48 * MiB
    assert int(np.count_nonzero(vllm.kv)) < 2 * 4096  # at most the partial end pages
    e.sleep()  # asleep already: nothing more
    assert vllm.calls == ["reset_prefix_cache", "rpc:release"]
    e.wake()
    try:
        assert vllm.calls == ["reset_prefix_cache", "rpc:release"]  # lazy: nothing to do
        assert e._engine is vllm and e.health() == (True, "ok")
    finally:
        e.sleep()


def test_cpu_wake_can_commit_the_pages_first(model: Path) -> None:
    e, vllm = _engine(model, "--kv-at-wake", "populate")
    e.sleep()
    low = _rss()
    e.wake()
    try:
        assert vllm.calls == ["reset_prefix_cache", "rpc:release", "rpc:populate"]
        assert _rss() - low > 48 * MiB
    finally:
        e.sleep()


def test_gpu_standby_is_vllms_own_sleep_mode(model: Path) -> None:
    e, vllm = _engine(model, backend="cuda")
    e.sleep()
    e.wake()
    try:
        assert vllm.calls == ["sleep:1", "wake_up"]
    finally:
        e.sleep()
    assert vllm.calls == ["sleep:1", "wake_up", "sleep:1"]


def test_wake_before_the_engine_was_built_is_an_error(model: Path) -> None:
    from understudy.engine_shim.adapters.base import AdapterError

    e = VllmEngine(str(model))
    with pytest.raises(AdapterError, match="before the engine was built"):
        e.wake()


def test_a_crashing_engine_writes_no_core_unless_asked(model: Path) -> None:
    """A core file is written before the dying process's sockets close, so it
    delays the lock's release, the start of the failover."""
    import resource
    import subprocess
    import sys

    code = (
        "import resource, sys\n"
        "from understudy.engine_shim.adapters.vllm import VllmEngine\n"
        "VllmEngine(sys.argv[1], sys.argv[2:])\n"
        "print(resource.getrlimit(resource.RLIMIT_CORE)[0])\n"
    )
    limit = resource.getrlimit(resource.RLIMIT_CORE)

    def core_limit(*args: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", code, str(model), *args],
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (limit[1], limit[1])),
        )
        return int(out.stdout.strip())

    assert core_limit() == 0
    assert core_limit("--crash-reports", "on") == limit[1]
