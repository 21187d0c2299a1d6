"""The vllm adapter's worker thread (adapters/vllm.Worker) over a stand-in for
vLLM's LLMEngine (vLLM itself is in tests/vllm and the process tier): tokens
reach their requests with the right finish reason, a request vLLM refuses is
that request's error only, and an engine step that raises ends the engine
through ``on_fatal`` (fail fast: a dead engine, not a sick one) and fails what was in flight."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from understudy.engine_shim.adapters.vllm import Request, Worker
from understudy.engine_shim.generation import NotServing, SamplingParams, Step


@dataclass
class _Completion:
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class _Output:
    request_id: str
    finished: bool
    outputs: list[_Completion]


@dataclass
class FakeEngine:
    """Generates ``10 + i`` at step i for each request, ``max_new`` tokens, two per step
    (vLLM's outputs may carry several tokens); ``refuse`` ids raise in add_request."""

    refuse: set[str] = field(default_factory=set)
    fail_on_step: bool = False
    live: dict[str, list[int]] = field(default_factory=dict)  # id -> [made, max]
    aborted: list[str] = field(default_factory=list)
    steps: int = 0
    added: dict[str, int] = field(default_factory=dict)  # id -> steps before it came in

    def add_request(self, rid: str, prompt: dict[str, Any], params: Any) -> None:
        if rid in self.refuse:
            raise ValueError("prompt too long for vLLM")
        self.live[rid] = [0, params]
        self.added[rid] = self.steps

    def abort_request(self, ids: list[str]) -> None:
        self.aborted += ids
        for rid in ids:
            self.live.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[_Output]:
        if self.fail_on_step:
            raise RuntimeError("EngineCore died")
        self.steps += 1
        out = []
        for rid, state in list(self.live.items()):
            made, limit = state
            ids = [10 + made + k for k in range(min(2, limit - made))]
            state[0] = made + len(ids)
            done = state[0] >= limit
            out.append(_Output(rid, done, [_Completion(ids, "length" if done else None)]))
            if done:
                del self.live[rid]
        return out


def _request(rid: str, max_new: int) -> tuple[Request, queue.Queue[Step | BaseException]]:
    got: queue.Queue[Step | BaseException] = queue.Queue()
    req = Request(rid, (1, 2, 3), SamplingParams(max_tokens=max_new), max_new, got.put)
    return req, got


def _drain(got: queue.Queue[Step | BaseException]) -> list[Step | BaseException]:
    items: list[Step | BaseException] = []
    while True:
        item = got.get(timeout=10)
        items.append(item)
        if isinstance(item, BaseException) or item.finish_reason is not None:
            return items


def _worker(engine: FakeEngine) -> tuple[Worker, list[str]]:
    fatal: list[str] = []
    w = Worker(engine, lambda req: req.max_new, fatal.append)
    w.start()
    return w, fatal


def test_tokens_and_the_finish_reason_reach_each_request() -> None:
    engine = FakeEngine()
    w, fatal = _worker(engine)
    a, got_a = _request("a", 5)
    b, got_b = _request("b", 1)
    w.submit(a)
    w.submit(b)
    steps_a, steps_b = _drain(got_a), _drain(got_b)
    assert steps_a == [Step(10), Step(11), Step(12), Step(13), Step(14, "length")]
    assert steps_b == [Step(10, "length")]
    w.stop("done")
    assert not fatal


def test_requests_arriving_together_at_an_idle_engine_enter_vllm_in_one_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failover's continuations reach the new engine a few milliseconds
    apart: the first must not be stepped alone while the others wait a step.
    (The quiet time is stretched here so that a loaded machine's scheduling
    cannot split them.)"""
    from understudy.engine_shim import step_thread

    monkeypatch.setattr(step_thread, "ADMIT_QUIET_S", 2.0)
    monkeypatch.setattr(step_thread, "ADMIT_MAX_S", 30.0)
    engine = FakeEngine()
    w, fatal = _worker(engine)
    reqs = [_request(rid, 3) for rid in "abc"]
    for req, _ in reqs:
        w.submit(req)
        time.sleep(0.005)
    for _, got in reqs:
        assert _drain(got)[-1] == Step(12, "length")
    assert engine.added == {"a": 0, "b": 0, "c": 0}
    w.stop("done")
    assert not fatal


def test_announced_requests_start_as_soon_as_all_are_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A death's resent requests say how many they are (expect): the idle
    engine starts them once that many wait, without waiting for a quiet time
    (stretched to 5 s here, which the wait must not take); fewer than
    announced, and the quiet time ends the wait as before."""
    from understudy.engine_shim import step_thread

    monkeypatch.setattr(step_thread, "ADMIT_QUIET_S", 5.0)
    monkeypatch.setattr(step_thread, "ADMIT_MAX_S", 30.0)
    engine = FakeEngine()
    w, fatal = _worker(engine)
    t0 = time.monotonic()
    reqs = [_request(rid, 3) for rid in "abc"]
    for req, _ in reqs:
        w.expect(3)
        w.submit(req)
    for _, got in reqs:
        assert _drain(got)[-1] == Step(12, "length")
    assert time.monotonic() - t0 < 4.0
    assert engine.added == {"a": 0, "b": 0, "c": 0}

    monkeypatch.setattr(step_thread, "ADMIT_QUIET_S", 0.3)
    d, got_d = _request("d", 1)
    w.expect(2)  # the other never comes (its client left)
    w.submit(d)
    assert _drain(got_d) == [Step(10, "length")]
    w.stop("done")
    assert not fatal


def test_continued_streams_step_once_before_new_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failover's cohort mixes streams continued from the dead engine with
    requests that start over: the continued ones enter vLLM first and step
    alone once (their next token is the stream's stall), the new ones come in
    before the second step."""
    from understudy.engine_shim import step_thread

    monkeypatch.setattr(step_thread, "ADMIT_QUIET_S", 5.0)
    monkeypatch.setattr(step_thread, "ADMIT_MAX_S", 30.0)
    engine = FakeEngine()
    w, fatal = _worker(engine)
    reqs = [_request(rid, 3) for rid in ("new-1", "cont-1", "new-2", "cont-2")]
    for req, _ in reqs:
        req.resumed = 7 if req.id.startswith("cont") else 0
        w.expect(len(reqs))
        w.submit(req)
    for _, got in reqs:
        assert _drain(got)[-1] == Step(12, "length")
    assert engine.added == {"cont-1": 0, "cont-2": 0, "new-1": 1, "new-2": 1}
    w.stop("done")
    assert not fatal


def test_a_refused_request_fails_alone() -> None:
    engine = FakeEngine(refuse={"bad"})
    w, fatal = _worker(engine)
    bad, got_bad = _request("bad", 3)
    good, got_good = _request("good", 3)
    w.submit(bad)
    w.submit(good)
    (err,) = _drain(got_bad)
    assert isinstance(err, ValueError) and "too long" in str(err)
    assert _drain(got_good)[-1] == Step(12, "length")
    assert w.alive and w.failure is None and not fatal
    w.stop("done")


def test_a_failing_step_ends_the_engine_at_once() -> None:
    engine = FakeEngine(fail_on_step=True)
    called = threading.Event()
    fatal: list[str] = []

    def on_fatal(why: str) -> None:
        fatal.append(why)
        called.set()

    w = Worker(engine, lambda req: req.max_new, on_fatal)
    w.start()
    req, got = _request("a", 3)
    w.submit(req)
    (err,) = _drain(got)
    assert isinstance(err, NotServing)
    assert called.wait(10)
    assert "EngineCore died" in fatal[0]
    with pytest.raises(NotServing):
        w.submit(_request("b", 1)[0])


def test_a_cancelled_request_is_aborted_in_vllm() -> None:
    engine = FakeEngine()
    w, _ = _worker(engine)
    req, got = _request("long", 10_000)
    w.submit(req)
    assert isinstance(got.get(timeout=10), Step)
    w.cancel(req)
    deadline = threading.Event()
    for _ in range(200):
        if "long" in engine.aborted:
            break
        deadline.wait(0.05)
    assert "long" in engine.aborted
    w.stop("done")


@pytest.mark.parametrize(
    ("args", "flags", "want"),
    [
        (["--dtype", "bfloat16"], ("--dtype",), True),
        (["--dtype=half"], ("--dtype",), True),
        (["--kv-cache-dtype", "fp8"], ("--dtype",), False),  # a longer flag is another flag
        (["--served-model-name", "--dtype-like"], ("--dtype",), False),
        (["--no-enforce-eager"], ("--enforce-eager", "--no-enforce-eager"), True),
        ([], ("--enforce-eager",), False),
    ],
)
def test_an_explicit_flag_is_found_by_option_not_by_substring(
    args: list[str], flags: tuple[str, ...], want: bool
) -> None:
    from understudy.engine_shim.adapters.vllm import given

    assert given(args, *flags) is want


@pytest.mark.parametrize(
    ("args", "slots"),
    [
        ([], 8),  # KV_POOL_SLOTS: the streams a failover continues without recomputing
        (["--max-num-seqs", "16"], 16),  # a slot per sequence vLLM runs at once
        (["--max-num-seqs=16", "--kv-pool-slots", "3"], 3),  # said outright
    ],
)
def test_the_pool_has_a_slot_per_sequence_in_the_batch(args: list[str], slots: int) -> None:
    from types import SimpleNamespace

    from understudy.engine_shim.adapters import tiny_llama
    from understudy.engine_shim.adapters.vllm import VllmEngine, given

    engine = VllmEngine(tiny_llama.BUILTIN, args)
    vllm_default = 128  # what vLLM's config holds when --max-num-seqs is not given
    engine._config = SimpleNamespace(
        model_config=SimpleNamespace(
            get_num_layers=lambda _: 2,
            get_num_kv_heads=lambda _: 1,
            get_head_size=lambda: 4,
            dtype="torch.float32",
        ),
        parallel_config=None,
        scheduler_config=SimpleNamespace(
            max_num_seqs=16 if given(args, "--max-num-seqs") else vllm_default
        ),
    )
    engine.max_model_len = 64
    spec = engine._kv_spec()
    assert spec is not None
    assert spec.slots == slots
