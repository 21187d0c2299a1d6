"""The thread that steps a generative engine: what the llama batcher and the
vLLM worker share.

Callers on the event loop submit requests and cancel them; one thread runs
the engine's iterations and delivers tokens through each request's
``deliver``. Stopping and failing are the same for every engine: stop after
the current iteration (a caller must not unmap weights under a running
step), and fail every request still held with `NotServing`, so no client
waits on an engine that is gone.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Final, Generic, Protocol, TypeVar

from understudy.engine_shim.generation import NotServing, Step

# An idle engine that gets a request waits for the next one before it steps:
# until none has come for ADMIT_QUIET_S, at most ADMIT_MAX_S. The front sends
# a failover's continuations together, a few ms apart (2-6 ms for 8 streams
# on SmolLM2, a local pod), and a step started on the first alone made the
# others wait a whole step (seen in drills: vLLM loaded one continuation, the
# other seven one step later, 0.1-1 s on loaded cores; the llama engine
# prefilled a new request alone, 0.2 s, while the continuations waited). A
# lone request on an idle engine pays ADMIT_QUIET_S; a busy engine never
# waits. Requests the front resends after a death say how many of them that
# death broke (`expect`): the wait ends as soon as that many are in.
ADMIT_QUIET_S: Final = 0.02
ADMIT_MAX_S: Final = 0.1


class Deliverable(Protocol):
    cancelled: bool

    @property
    def deliver(self) -> Callable[[Step | BaseException], None]: ...


R = TypeVar("R", bound=Deliverable)


def send(req: Deliverable, item: Step | BaseException) -> None:
    """Hand a token, or the reason there is none, to the request's consumer."""
    try:
        req.deliver(item)
    except RuntimeError:  # the consumer's event loop is closed
        req.cancelled = True


class StepThread(abc.ABC, Generic[R]):
    """One engine's worker thread. Subclasses give `_iteration` (one step;
    False ends the thread) and `_take_running` (the requests in the engine,
    cleared), and may extend `_failed`."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._waiting: collections.deque[R] = collections.deque()
        self._expected = 0  # requests announced to come together (expect) ...
        self._expected_until = 0.0  # ... until this monotonic time
        self._stopping = False
        self.failure: BaseException | None = None
        self.busy_since: float | None = None  # monotonic start of the current step
        self.steps = 0
        self._name = name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- the caller's side ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: R) -> None:
        with self._cond:
            if self._stopping or self.failure is not None or not self.alive:
                raise NotServing("the engine is not serving")
            self._waiting.append(req)
            self._cond.notify()

    def expect(self, n: int) -> None:
        """``n`` requests are coming together (a death's resent requests,
        ``wire.serving.COHORT_HEADER``): an idle engine starts them as soon as
        that many wait, not after ADMIT_QUIET_S of quiet. Said before the
        request is submitted (whose submit wakes the thread); it lapses with
        the gathering it was for, or after ADMIT_MAX_S."""
        with self._cond:
            now = time.monotonic()
            if now > self._expected_until:
                self._expected = 0
            self._expected = max(self._expected, n)
            self._expected_until = now + ADMIT_MAX_S

    def _gather(self) -> None:
        """Under the lock, with nothing in the engine: let the requests arriving
        together come in, so that one step takes them all (ADMIT_QUIET_S), or
        as soon as all those announced are in (`expect`)."""
        end = time.monotonic() + ADMIT_MAX_S
        seen = len(self._waiting)
        try:
            while not self._stopping and (left := end - time.monotonic()) > 0:
                announced = self._expected if time.monotonic() <= self._expected_until else 0
                if 0 < announced <= len(self._waiting):
                    return
                self._cond.wait(min(ADMIT_QUIET_S, left))
                if len(self._waiting) == seen:
                    return
                seen = len(self._waiting)
        finally:
            self._expected = 0

    @abc.abstractmethod
    def cancel(self, req: R) -> None:
        """The consumer has gone: drop the request at the next iteration."""

    async def stream(self, req: R) -> AsyncIterator[Step]:
        """Submit ``req`` and yield its tokens on the caller's event loop,
        until the one with a finish reason; cancelled if the consumer leaves."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Step | BaseException] = asyncio.Queue()

        def deliver(item: Step | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        # The protocol can only read deliver (a dataclass's callable field
        # reads as read-only to mypy); every request type sets it here.
        req.deliver = deliver  # type: ignore[misc]
        self.submit(req)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.cancel(req)

    def health(self, stuck_after: float, now: float) -> tuple[bool, str]:
        """Healthy unless the thread failed, ended, or one step outlived
        ``stuck_after`` (``now``: time.monotonic())."""
        if self.failure is not None:
            return False, f"the {self._name} thread failed: {self.failure!r}"
        if not self.alive:
            return False, f"the {self._name} thread is not running"
        since = self.busy_since
        if since is not None and now - since > stuck_after:
            return False, f"one engine step has run for more than {stuck_after:g}s"
        return True, "ok"

    def stop(self, reason: str, timeout: float) -> None:
        """Stop after the current iteration; fail what is still held.

        Raises RuntimeError if the thread is still computing after ``timeout``:
        the caller must not unmap the weights under it.
        """
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the {self._name} thread did not stop within {timeout:g}s")
        self._fail_all(NotServing(reason))

    # --- the thread ---------------------------------------------------------------

    @abc.abstractmethod
    def _iteration(self) -> bool:
        """One step of the engine; False ends the thread."""

    @abc.abstractmethod
    def _take_running(self) -> Iterable[R]:
        """Under the lock: the requests inside the engine, now forgotten."""

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            leftover = [*self._waiting, *self._take_running()]
            self._waiting.clear()
        for req in leftover:
            send(req, exc)

    def _failed(self, exc: BaseException) -> None:
        """The engine raised: every held request is told so."""
        self._fail_all(NotServing(f"the engine failed: {type(exc).__name__}: {exc}"))

    def _run(self) -> None:
        try:
            while self._iteration():
                pass
        except BaseException as exc:
            self.failure = exc
            self._failed(exc)
