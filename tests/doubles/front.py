"""Doubles of the front's seams, for its forwarder and router in fake time.

- :class:`Client`: the client's side of one exchange (what ``downstream``'s
  connection is to an ``Exchange``): it records the bytes of the answer;
- :class:`Engine`: an engine behind the upstream seam (``Upstream`` and its
  ``Response``): it answers each request as its ``behave`` says, refuses, is
  unreachable, or dies with its requests in it;
- :class:`Router`: the routing seam (``forwarder.Routes``), with the route
  set by the test;
- :class:`Engines`: the pod's engines as the real router reaches them
  (heartbeats, kill, sockets), over :class:`Engine` doubles.

Nothing of the forwarder or the router is replaced: they run as they do in
the pod, against these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from understudy.front import downstream, fsm, upstream
from understudy.front.forwarding import NOT_ACTIVE_HEADER
from understudy.wire.serving import Beat, token_comment

Headers = list[tuple[bytes, bytes]]


class Client:
    """One client connection, as an ``Exchange`` sees it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.done = asyncio.Event()
        self.gone = False

    def write(self, data: bytes, kind: bytes = b"W") -> None:
        if self.gone:
            raise downstream.ClientGone("the client left")
        self.data += data

    def write_head(self, head: bytes, resume: dict[str, Any]) -> None:
        self.write(head)

    async def write_and_drain(self, data: bytes, token_ids: Any = None) -> None:
        self.write(data)

    def exchange_done(self, ex: downstream.Exchange) -> None:
        self.done.set()

    def request(self, doc: dict[str, Any], path: bytes = b"/v1/completions") -> downstream.Exchange:
        body = json.dumps(doc).encode()
        headers = [(b"Content-Type", b"application/json")]
        return downstream.Exchange(self, b"POST", path, headers, body, "1.1", True)  # type: ignore[arg-type]

    @property
    def status(self) -> int:
        return int(self.data.split(b" ", 2)[1]) if self.data else 0

    @property
    def body(self) -> bytes:
        """The answer's body (a chunked one joined)."""
        head, _, rest = bytes(self.data).partition(b"\r\n\r\n")
        if b"Transfer-Encoding: chunked" not in head:
            return rest
        out = b""
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            out, rest = out + rest[:n], rest[n + 2 :]
        return out


class Answer:
    """An engine's answer in progress, as the forwarder reads it (``upstream.Response``)."""

    def __init__(self, reused: bool = False) -> None:
        self.status = 0
        self.headers: Headers = []
        self._chunks: deque[bytes] = deque()
        self._done = False
        self._error: upstream.UpstreamError | None = None
        self._changed = asyncio.Event()
        self._on_complete: Callable[[], None] | None = None
        self._reused = reused

    # the engine's side

    def begin(self, status: int, headers: Headers | None = None) -> None:
        self.status, self.headers = status, headers or []
        self._wake()

    def send(self, data: bytes) -> None:
        self._chunks.append(data)
        self._wake()

    def end(self) -> None:
        self._done = True
        self._ended()

    def cut(self) -> None:
        """The engine's connection closed (its process died)."""
        if self._done or self._error is not None:
            return
        if not self.status and self._reused:
            self._error = upstream.Stale("closed before any answer")
        else:
            self._error = upstream.Broken("connection closed")
        self._ended()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _ended(self) -> None:
        self._wake()
        callback, self._on_complete = self._on_complete, None
        if callback is not None:
            callback()

    # the forwarder's side

    @property
    def complete(self) -> bool:
        return self._done

    def on_complete(self, callback: Callable[[], None]) -> None:
        if self._done or self._error is not None:
            callback()
        else:
            self._on_complete = callback

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        await self._changed.wait()

    async def head(self) -> Answer:
        while not self.status:
            await self._wait()
        return self

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            while self._chunks:
                yield self._chunks.popleft()
            if self._done:
                return
            await self._wait()

    async def read(self) -> bytes:
        while not self._done:
            await self._wait()
        return self.body()

    def body(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    def close(self) -> None:
        if not self._done and self._error is None:
            self._error = upstream.Broken("given up")
            self._ended()


Behave = Callable[["Engine", Answer, dict[str, Any]], Awaitable[None]]


async def answers(engine: Engine, answer: Answer, doc: dict[str, Any]) -> None:
    """Answer at once: 200 and the engine's name."""
    answer.begin(200, [(b"Content-Type", b"application/json")])
    answer.send(json.dumps({"engine": engine.name}).encode())
    answer.end()


def after(seconds: float, then: Behave = answers) -> Behave:
    async def behave(engine: Engine, answer: Answer, doc: dict[str, Any]) -> None:
        await asyncio.sleep(seconds)
        await then(engine, answer, doc)

    return behave


async def hangs(engine: Engine, answer: Answer, doc: dict[str, Any]) -> None:
    """Never answer (the engine hung: only its death ends the request)."""
    await asyncio.Event().wait()


async def refuses(engine: Engine, answer: Answer, doc: dict[str, Any]) -> None:
    answer.begin(409, [(NOT_ACTIVE_HEADER, b"draining")])
    answer.end()


def streams(tokens: int, every: float, first: int = 0) -> Behave:
    """An event stream of ``tokens`` tokens, one each ``every`` seconds,
    continuing after the ones the request says were already sent."""

    async def behave(engine: Engine, answer: Answer, doc: dict[str, Any]) -> None:
        resume = doc.get("understudy", {}).get("resume")
        start = len(resume["token_ids"]) if resume else 0
        answer.begin(200, [(b"Content-Type", b"text/event-stream")])
        for i in range(start, tokens):
            await asyncio.sleep(every)
            event = {"engine": engine.name, "text": f"t{i}"}
            answer.send(
                token_comment([first + i]) + b"\ndata: " + json.dumps(event).encode() + b"\n\n"
            )
        answer.send(token_comment([]) + b"\ndata: [DONE]\n\n")
        answer.end()

    return behave


class Engine:
    """An engine behind the upstream seam."""

    def __init__(self, name: str, behave: Behave = answers, pid: int = 0) -> None:
        self.name = name
        self.behave = behave
        self.pid = pid
        self.listening = True
        self.alive = True
        self.hung_at: float | None = None  # its heartbeat stops here
        # ... and its CPU time too, unless it still works (starved of its loop)
        self.works_while_silent = False
        self.received: list[dict[str, Any]] = []
        self.headers: list[Headers] = []  # of each request received, in order
        self.idle = 0  # kept-alive connections the fast path may take
        self._answers: list[tuple[Answer, asyncio.Task[None]]] = []
        self.upstream = _Pool(self)

    def take(self, doc: dict[str, Any], reused: bool, headers: Headers = ()) -> Answer:
        answer = Answer(reused)
        if not self.alive:
            answer.cut()
            return answer
        self.received.append(doc)
        self.headers.append(list(headers))
        task = asyncio.create_task(self.behave(self, answer, doc))
        self._answers.append((answer, task))
        return answer

    def die(self, word: bool = False) -> None:
        """Its process ends: every answer in progress is cut; with its death
        ``word`` seen first, as the real router's watch does, the pool
        counts them (``upstream.Upstream.broke_together``)."""
        if word:
            self.upstream.broke_together = sum(not a.complete for a, _ in self._answers)
        self.alive = self.listening = False
        for answer, task in self._answers:
            task.cancel()
            answer.cut()

    async def close(self) -> None:
        for _, task in self._answers:
            task.cancel()
        await asyncio.gather(*(t for _, t in self._answers), return_exceptions=True)


class _Pool:
    """``upstream.Upstream`` over an :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.broke_together = 0  # no death word here: the real pool's, unset

    def send_idle(self, method: bytes, target: bytes, headers: Headers, body: bytes) -> Any:
        if not self.engine.idle:
            return None
        self.engine.idle -= 1
        return self.engine.take(json.loads(body), reused=True, headers=headers)

    async def send(self, method: bytes, target: bytes, headers: Headers, body: bytes) -> Any:
        await asyncio.sleep(0)
        if not self.engine.listening:
            raise upstream.Unreachable(f"{self.engine.name} does not listen")
        return self.engine.take(json.loads(body), reused=False, headers=headers)

    async def request(self, method: bytes, target: bytes, headers: Headers, body: bytes) -> Any:
        r = await self.send(method, target, headers, body)
        return await r.head()

    def drop_idle(self) -> None:
        self.engine.idle = 0

    def close(self) -> None:
        self.drop_idle()


class Router:
    """The routing seam with the route in the test's hands."""

    def __init__(self, engines: dict[str, Engine], patience: float = 0.05) -> None:
        self.engines = engines
        self.route: fsm.Route | None = None
        self.patience = patience
        self.served_by: list[str] = []
        self.retries: list[tuple[str, fsm.Outcome]] = []
        self._changed = asyncio.Event()

    def set(self, engine: str | None, epoch: int = 1) -> None:
        self.route = fsm.Route(engine, epoch) if engine is not None else None
        self._changed.set()
        self._changed = asyncio.Event()

    def upstream(self, route: fsm.Route) -> Any:
        return self.engines[route.engine_id].upstream

    async def _changed_within(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await self._changed.wait()

    async def hold(self, deadline: float) -> fsm.Route | None:
        loop = asyncio.get_running_loop()
        while self.route is None and loop.time() < deadline:
            await self._changed_within(deadline - loop.time())
        return self.route

    async def retry_after(self, route: fsm.Route, outcome: fsm.Outcome, deadline: float) -> None:
        self.retries.append((route.engine_id, outcome))
        if self.route == route:
            loop = asyncio.get_running_loop()
            await self._changed_within(min(self.patience, deadline - loop.time()))

    def served(self, route: fsm.Route) -> None:
        self.served_by.append(route.engine_id)


class Engines:
    """The pod's engines as ``router.Router`` reaches them, over doubles; a
    hung engine's heartbeat stops at ``hung_at``, and ``on_kill`` stands for
    what its death sets off (the lock passing on)."""

    def __init__(self, engines: dict[str, Engine], clock: Callable[[], float]) -> None:
        self.engines = engines
        self.clock = clock
        self.killed: list[str] = []
        self.on_kill: Callable[[Engine], None] = lambda engine: None

    def beat(self, engine_id: str) -> Beat | None:
        e = self.engines[engine_id]
        if not e.alive:
            return None
        return Beat(e.pid, 1, e.hung_at if e.hung_at is not None else self.clock())

    def cpu_ticks(self, pid: int) -> int | None:
        """One tick per 10 ms of the clock while the engine works."""
        e = next((e for e in self.engines.values() if e.pid == pid and e.alive), None)
        if e is None:
            return None
        now = self.clock()
        stopped = e.hung_at is not None and not e.works_while_silent
        return int((min(now, e.hung_at) if stopped and e.hung_at is not None else now) * 100)

    def kill(self, pid: int) -> None:
        engine = next(e for e in self.engines.values() if e.pid == pid)
        self.killed.append(engine.name)
        engine.die()
        self.on_kill(engine)

    def listening(self, engine_id: str) -> bool:
        return self.engines[engine_id].listening

    def upstream(self, engine_id: str) -> Any:
        return self.engines[engine_id].upstream
