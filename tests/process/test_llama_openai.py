"""The llama engine behind its OpenAI routes (openai_api over the Generator), on a
real loopback HTTP server: completions and chat agree with the engine's own
tokens, and a stream continued after k tokens — what the front sends the next
engine after a failover — is byte for byte the rest of the uninterrupted one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from understudy.engine_shim.adapters import tiny_llama
from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.generation import SamplingParams
from understudy.wire.serving import parse_token_comment

pytestmark = pytest.mark.process

PROMPT = "The shadow engine wakes when the lock is granted"
IDS = {"request_id": "cmpl-test", "created": 1700000000}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaEngine]:
    model = tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"))
    e = LlamaEngine(str(model))
    e.attach_private()
    e.wake()
    yield e
    e.close()


@pytest.fixture
async def client(engine: LlamaEngine) -> AsyncIterator[TestClient[Any, Any]]:
    app = web.Application()
    app.add_routes(engine.routes())
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


async def events(client: TestClient[Any, Any], path: str, body: dict[str, Any]) -> list[bytes]:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200, await resp.text()
    raw = await resp.read()
    return [e for e in raw.split(b"\n\n") if e]


def token_ids(event: bytes) -> list[int]:
    return list(parse_token_comment(event.split(b"\n", 1)[0]) or ())


async def generated(engine: LlamaEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [s.token_id async for s in engine.generate(prompt, params)]


async def test_completion_is_the_engines_greedy_text(client, engine: LlamaEngine) -> None:
    want = await generated(engine, engine.encode(PROMPT), SamplingParams(24, temperature=0))
    resp = await client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    )
    doc = await resp.json()
    assert resp.status == 200, doc
    assert doc["choices"][0]["text"] == engine.decode(want)
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 24
    assert doc["model"] == engine.model_id
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == 2048


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 5}]
)
async def test_a_stream_continued_after_k_tokens_is_the_rest_of_the_stream(
    client, engine: LlamaEngine, chat: bool, sampling: dict[str, Any]
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 40, **sampling}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    full = await events(client, path, {**body, "understudy": IDS})
    ids = [t for e in full for t in token_ids(e)]
    assert len(ids) == 40 and full[-1] == b"data: [DONE]"
    # 40: the first engine died after the last token, before the stream's end
    for k in (1, 13, 39, 40):
        # events after the one that carried the k-th token
        seen, cut = 0, 0
        while seen < k:
            seen += len(token_ids(full[cut]))
            cut += 1
        resume = {"token_ids": ids[:k], "started": True}
        rest = await events(client, path, {**body, "understudy": {**IDS, "resume": resume}})
        assert rest == full[cut:], f"continued after {k} tokens"
    # the text the client assembles is the engine's decode of every id
    choices = [json.loads(e.split(b"data: ", 1)[1])["choices"][0] for e in full[:-1]]
    text = "".join(c["delta"].get("content", "") if chat else c["text"] for c in choices)
    assert text == engine.decode(ids)


async def test_a_stream_whose_end_token_went_out_gets_only_its_end(client) -> None:
    # The first engine streamed the model's end of sequence and died before
    # the usage chunk and [DONE]: the next engine owes only those.
    body = {"prompt": PROMPT, "max_tokens": 9, "stream_options": {"include_usage": True}}
    resume = {"token_ids": [7, 4], "started": True}  # 4: <|eot_id|>
    rest = await events(
        client, "/v1/completions", {**body, "understudy": {**IDS, "resume": resume}}
    )
    assert rest[1:] == [b"data: [DONE]"]
    usage = json.loads(rest[0].split(b"data: ", 1)[1])["usage"]
    assert usage["completion_tokens"] == 2


async def test_a_malformed_continuation_is_a_400_that_names_the_field(client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "understudy": {**IDS, "resume": {"token_ids": [7]}}}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "understudy"
    assert "'understudy.resume.started' must be a boolean" in error["message"]


async def test_requests_a_death_broke_together_start_once_all_are_in(
    client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the front resends after a death says how many it resends
    (COHORT_HEADER): the idle engine starts them in one step as soon as that
    many are in, not after a quiet time (stretched to 5 s here, which they
    must not wait); a header that is no count is no hint, never an error."""
    import asyncio
    import time

    from understudy.engine_shim import step_thread
    from understudy.wire.serving import COHORT_HEADER

    monkeypatch.setattr(step_thread, "ADMIT_QUIET_S", 5.0)
    monkeypatch.setattr(step_thread, "ADMIT_MAX_S", 30.0)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    t0 = time.monotonic()
    answers = await asyncio.gather(
        *(client.post("/v1/completions", json=body, headers={COHORT_HEADER: "2"}) for _ in "ab")
    )
    assert [r.status for r in answers] == [200, 200]
    assert time.monotonic() - t0 < 4.0
    monkeypatch.setattr(step_thread, "ADMIT_QUIET_S", 0.02)
    for bad in ("many", "-1", "1" * 40):
        resp = await client.post("/v1/completions", json=body, headers={COHORT_HEADER: bad})
        assert resp.status == 200, await resp.text()
