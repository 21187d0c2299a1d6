"""The vllm adapter's sleep and wake over a stand-in for vLLM's LLMEngine
(vLLM itself runs in tests/vllm; it has no GPU here): which of vLLM's calls
each platform's standby makes, and in what order.

- CPU: the engine core stays; its prefix cache is forgotten *before* the KV
  cache's pages go back to the kernel (a prefix hit on a released block would
  read zeros or a stale block); the pages really leave the process's working
  set (RSS less what the kernel may take, ``LazyFree``), freed reclaimably
  by default (``--kv-release reclaimable``) or at once; wake builds nothing and,
  with ``--kv-at-wake populate``, commits them again.
- GPU (UNVERIFIED on a GPU): vLLM's own ``sleep(level=1)`` and ``wake_up()``,
  nothing of ours on the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from memstat import smaps as _smaps
from memstat import working_set as _working_set

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.vllm import VllmEngine

MiB = 1 << 20


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

    def collective_rpc(
        self, fn: Any, timeout: float | None = None, args: tuple[Any, ...] = ()
    ) -> list[Any]:
        self.calls.append(f"rpc:{fn.__name__}{list(args) if args else ''}")
        worker = type("W", (), {})()
        worker.model_runner = type("R", (), {"kv_caches": [_View(self.kv), _View(self.kv)]})()
        return [fn(worker, *args)]

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


@pytest.mark.parametrize("release", ["reclaimable", "now"])
def test_cpu_standby_forgets_the_cache_then_gives_its_pages_back(model: Path, release: str) -> None:
    e, vllm = _engine(model, f"--kv-release={release}")
    released = f"rpc:release[{release == 'reclaimable'}]"
    before, rss = _working_set(), _smaps("Rss")
    e.sleep()
    assert vllm.calls == ["reset_prefix_cache", released]
    assert before - _working_set() > 48 * MiB
    if release == "now":  # gone at once, and read back as zeros
        assert rss - _smaps("Rss") > 48 * MiB
        assert int(np.count_nonzero(vllm.kv)) < 2 * 4096  # at most the partial end pages
    else:  # still there, for the kernel to take when it needs the memory
        assert _smaps("LazyFree") > 48 * MiB
    e.sleep()  # asleep already: nothing more
    assert vllm.calls == ["reset_prefix_cache", released]
    e.wake()
    try:
        assert vllm.calls == ["reset_prefix_cache", released]  # lazy: nothing to do
        assert e._engine is vllm and e.health() == (True, "ok")
    finally:
        e.sleep()


@pytest.mark.parametrize("release", ["reclaimable", "now"])
def test_cpu_wake_can_commit_the_pages_first(model: Path, release: str) -> None:
    e, vllm = _engine(model, "--kv-at-wake", "populate", f"--kv-release={release}")
    e.sleep()
    low = _working_set()
    e.wake()
    try:
        assert vllm.calls[-1] == "rpc:populate"
        assert _working_set() - low > 48 * MiB
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
