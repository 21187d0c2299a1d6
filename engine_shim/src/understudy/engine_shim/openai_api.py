"""The OpenAI surface of a generative engine, over ``generation.Generator``.

``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as
server-sent events ending in ``data: [DONE]``; ``stream_options.include_usage``
adds a usage chunk), ``GET /v1/models``. Shapes, usage counting and
``finish_reason`` follow vLLM's OpenAI server; errors are shaped like
OpenAI's (``{"error": {"message", "type", "param", "code"}}``).

The continuation contract with the pod's front door (built and parsed by
``understudy.wire.serving``; the front's side: ``understudy.front.continuation``):
a request may carry ``understudy: {request_id, created, resume: {token_ids,
started}}``. ``request_id`` and ``created`` fix the response's ``id`` and
``created``; ``resume`` says which tokens an earlier engine already streamed
to the client, and whether the stream's opening event went out. Every
streamed event starts with an SSE comment ``: tokens=<ids>`` naming the token
ids it carries, which the front keeps and strips. A resumed stream emits
exactly the events the uninterrupted one would have emitted after those
tokens, so the client's bytes are the same.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from understudy.engine_shim.generation import (
    Generator,
    IncrementalText,
    NotServing,
    SamplingParams,
    Step,
    finish_of,
)
from understudy.wire import failpoints
from understudy.wire.serving import (
    COHORT_HEADER,
    FIELD,
    ContinuationError,
    parse_continuation,
    token_comment,
)

NOT_ACTIVE_HEADER = "X-Understudy-Not-Active"

# Beyond this many requests being generated or waiting, new ones get 429.
MAX_PENDING = 256
MAX_BODY = 16 * 1024 * 1024
_UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "top_logprobs": None,
    "echo": False,
    "suffix": None,
    "stop": None,
    "tools": None,
    "response_format": None,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> web.Response:
        kind = {404: "invalid_request_error", 413: "invalid_request_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        if self.status == 429:
            kind = "rate_limit_exceeded"
        code: int | str = "model_not_found" if self.status == 404 else self.status
        return web.json_response(
            {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}},
            status=self.status,
        )


@dataclass(frozen=True, slots=True)
class Request:
    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    request_id: str
    created: int
    resume: tuple[int, ...]
    started: bool


# ------------------------------------------------------------ parsing ----


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise ApiError(400, f"'{key}' must be an integer in {low}..{high}", key)
    return v


def _float(body: dict[str, Any], key: str, low: float, high: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not low <= v <= high:
        raise ApiError(400, f"'{key}' must be a number in [{low}, {high}]", key)
    return float(v)


def _prompt_ids(gen: Generator, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", "prompt")
        return gen.encode(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return list(prompt)
    raise ApiError(
        400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
    )


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, "each message needs a role: system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(400, "only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise ApiError(400, "message content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def _body(gen: Generator, body: Any) -> dict[str, Any]:
    """The body as an object for this model, with no option this engine lacks."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != gen.model_id:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    for key, default in _UNSUPPORTED.items():
        if body.get(key, default) not in (default, None):
            raise ApiError(400, f"'{key}' is not supported by this engine", key)
    return body


def _max_tokens(gen: Generator, body: dict[str, Any], chat: bool, prompt: int) -> tuple[int, str]:
    """The completion's token budget (what the context leaves, unless asked
    for less) and the key it came from, for error messages."""
    room = gen.max_model_len - prompt
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {gen.max_model_len} tokens; "
            f"the prompt has {prompt}.",
            "messages" if chat else "prompt",
        )
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, key, 1, 1 << 20)
    if max_tokens is None:
        return room, key
    if max_tokens > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {gen.max_model_len} tokens. However, you "
            f"requested {prompt + max_tokens} tokens ({prompt} in the "
            f"prompt, {max_tokens} for the completion).",
            key,
        )
    return max_tokens, key


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key) or {}
    if not isinstance(value, dict):
        raise ApiError(400, f"'{key}' must be an object", key)
    return value


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    return stream, bool(_object(body, "stream_options").get("include_usage", False))


def parse(gen: Generator, body: Any, chat: bool) -> Request:
    body = _body(gen, body)
    prompt_ids = gen.encode_chat(_messages(body)) if chat else _prompt_ids(gen, body)
    max_tokens, key = _max_tokens(gen, body, chat, len(prompt_ids))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_float(body, "top_p", 1e-6, 1.0, 1.0),
        seed=_int(body, "seed", -(1 << 63), (1 << 63) - 1),
    )
    stream, include_usage = _stream(body)
    try:
        ours = parse_continuation(body.get(FIELD))
    except ContinuationError as exc:
        raise ApiError(400, str(exc), FIELD) from None
    resume = ours.resume.token_ids if ours.resume else ()
    if len(resume) > max_tokens:
        raise ApiError(400, f"more resumed tokens than the {key} of {max_tokens}", FIELD)
    prefix = "chatcmpl" if chat else "cmpl"
    return Request(
        chat=chat,
        prompt_ids=prompt_ids,
        params=params,
        stream=stream,
        include_usage=include_usage,
        request_id=ours.request_id or f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()) if ours.created is None else ours.created,
        resume=resume,
        started=ours.resume.started if ours.resume else False,
    )


def _cohort(value: str | None, most: int) -> int:
    """How many requests the front says come together with this one
    (``COHORT_HEADER``); 0 where it says nothing usable (a hint, never an
    error), at most the requests this engine takes at once."""
    if value is None or not value.isdigit() or len(value) > 6:
        return 0
    return min(int(value), most)


def _poison(gen: Generator, req: Request) -> None:
    """Failpoint ``engine.poison``: a request whose prompt holds the armed
    marker kills the engine that starts it (its continuation, the next one)."""
    marker = failpoints.value("engine.poison")
    if marker and marker in gen.decode(req.prompt_ids):
        failpoints.crash()


# ------------------------------------------------------------- shaping ----


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def _chunk(req: Request, gen: Generator, choice: dict[str, Any] | None, **extra: Any) -> bytes:
    doc: dict[str, Any] = {
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": req.created,
        "model": gen.model_id,
        "choices": [choice] if choice is not None else [],
        **extra,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _event(token_ids: Sequence[int], data: bytes) -> bytes:
    return token_comment(token_ids) + b"\ndata: " + data + b"\n\n"


def _choice(req: Request, text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "index": 0,
        "text": text or "",
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }


class OpenAIServer:
    """The routes of one generative engine."""

    def __init__(self, gen: Generator, max_pending: int = MAX_PENDING) -> None:
        self.gen = gen
        self.max_pending = max_pending
        self.pending = 0

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
        ]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.gen.model_id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "understudy",
                        "max_model_len": self.gen.max_model_len,
                    }
                ],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(413, f"request body larger than {MAX_BODY} bytes") from None
            except (ValueError, RecursionError):  # nested too deep is not JSON to us
                raise ApiError(400, "the request body is not JSON") from None
            req = parse(self.gen, body, chat)
            if self.pending >= self.max_pending:
                raise ApiError(
                    429, f"{self.max_pending} requests are in progress already; retry later"
                )
        except ApiError as exc:
            return exc.response()
        self.pending += 1
        try:
            _poison(self.gen, req)
            cohort = _cohort(request.headers.get(COHORT_HEADER), self.max_pending)
            if cohort:
                self.gen.expect(cohort)
            # An earlier engine died after streaming the generation's last token
            # but before its end: the end (usage, [DONE]) is all that is owed.
            over = finish_of(req.resume, req.params, self.gen.eos_ids) if req.resume else None
            if over is not None:
                chained: AsyncIterator[Step] = _no_steps()
            else:
                # The first step before any byte of the answer: a request the
                # generator refuses gets a status, never a broken stream.
                try:
                    steps = self.gen.generate(req.prompt_ids, req.params, req.resume)
                    first = await anext(aiter(steps))
                except ValueError as exc:
                    return ApiError(400, str(exc)).response()
                except NotServing as exc:
                    return web.Response(
                        status=409, text=f"{exc}\n", headers={NOT_ACTIVE_HEADER: str(exc)}
                    )
                chained = _chain(first, steps)
            if req.stream:
                return await self._stream(request, req, chained)
            return await self._whole(req, chained, over)
        finally:
            self.pending -= 1

    async def _whole(
        self, req: Request, steps: AsyncIterator[Step], finish: str | None = None
    ) -> web.Response:
        ids = list(req.resume)
        async for step in steps:
            ids.append(step.token_id)
            finish = step.finish_reason
        text = self.gen.decode(ids)
        choice: dict[str, Any]
        if req.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        return web.json_response(
            {
                "id": req.request_id,
                "object": "chat.completion" if req.chat else "text_completion",
                "created": req.created,
                "model": self.gen.model_id,
                "choices": [choice],
                "usage": _usage(len(req.prompt_ids), len(ids)),
            }
        )

    async def _stream(
        self, request: web.Request, req: Request, steps: AsyncIterator[Step]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        ids = list(req.resume)
        # Replaying the resumed ids puts the text where the first engine left it.
        text = IncrementalText(self.gen.decode, ids)
        try:
            if req.chat and not req.started:
                await resp.write(_event((), _chunk(req, self.gen, _choice(req, None, None, True))))
            async for step in steps:
                ids.append(step.token_id)
                delta = text.push(step.token_id, final=step.finish_reason is not None)
                choice = _choice(req, delta, step.finish_reason, first=False)
                await resp.write(_event((step.token_id,), _chunk(req, self.gen, choice)))
            if req.include_usage:
                usage = _usage(len(req.prompt_ids), len(ids))
                await resp.write(_event((), _chunk(req, self.gen, None, usage=usage)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            # The client (the front) went away: stop generating for it.
            closer = getattr(steps, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
        return resp


async def _no_steps() -> AsyncIterator[Step]:
    return
    yield  # an async generator that yields nothing


async def _chain(first: Step, rest: AsyncIterator[Step]) -> AsyncIterator[Step]:
    try:
        yield first
        if first.finish_reason is None:
            async for step in rest:
                yield step
    finally:
        # Closing the chain (the client left) must stop the generation too.
        closer = getattr(rest, "aclose", None)
        if closer is not None:
            await closer()


def routes(gen: Generator, max_pending: int = MAX_PENDING) -> list[web.RouteDef]:
    """The OpenAI routes of ``gen`` (what a generative adapter's ``routes()`` returns)."""
    return OpenAIServer(gen, max_pending).routes()
