"""Where the front's requests go: the routing core (``fsm``) in its asyncio shell.

A :class:`Router` owns the front's routing state and the two loops that feed
it:

- the **lock watch**: the holder and its epoch, the instant they change (a
  killed engine's lock connection closes with its process);
- the **heartbeat check**: the routed engine's heartbeat, every
  ``beat_check_s``, judged by ``fsm.judge_beat``; a hung engine is killed, so
  that its death hands the lock on.

The forwarder asks it for nothing but a route (``forwarder.Routes``, which
this class offers): the route now, a hold until there is one (bounded by the
request's deadline), a pause after an attempt that could not be served, and
the connections to a route. A second router with the same surface, over
pods instead of engines (the fleet gateway), serves the same forwarder; the
two never import each other.

Engines answer ``409`` with ``X-Understudy-Not-Active`` when a request reaches
them while not Active or under another epoch; the router then waits for the
route the lock names.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, assert_never

from understudy.front import fsm, upstream
from understudy.front.config import FrontConfig
from understudy.front.metrics import FrontMetrics
from understudy.wire import deathword, heap, heartbeat
from understudy.wire.obs import log_event
from understudy.wire.serving import Beat, heartbeat_path, serving_socket

log = logging.getLogger("understudy.front")

# After a failed connect to the route (the engine is still waking), wait for
# its socket to appear (one watcher per engine, polling every _WATCH_S, wakes
# every waiting request at once) or at most this long before trying again.
# Sixteen requests retrying their connects every few milliseconds took CPU
# from the very engine they were waiting for.
_RETRY_S = 0.05
_WATCH_S = 0.001
# After an engine died under a request: wait at most this long for the lock to
# name the next one before trying again.
_MIGRATE_RETRY_S = 0.005
# After the engine refused (draining, or another epoch): the lock will name
# another engine soon; until then, ask again only this often.
_REFUSED_RETRY_S = 0.25
# A heartbeat check that comes this much later than asked means the front was
# not scheduled either: no verdict on the engine from it.
_STALL_S = 0.25


class Engines(Protocol):
    """The pod's engines as the router reaches them (files and processes)."""

    def beat(self, engine_id: str) -> Beat | None: ...

    def kill(self, pid: int) -> None: ...

    def cpu_ticks(self, pid: int) -> int | None:
        """The CPU time the process has used, in clock ticks (None: unknown)."""
        ...

    def listening(self, engine_id: str) -> bool: ...

    def upstream(self, engine_id: str) -> upstream.Upstream: ...


class PodEngines:
    """Engines of this pod: their heartbeats and serving sockets in the run dir."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def beat(self, engine_id: str) -> Beat | None:
        return heartbeat.read_beat(heartbeat_path(self.run_dir, engine_id))

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def cpu_ticks(self, pid: int) -> int | None:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return None
        # utime and stime, the 14th and 15th fields; the name (2nd) may hold
        # spaces and parentheses, so count from the last ")".
        fields = stat[stat.rfind(b")") + 2 :].split()
        try:
            return int(fields[11]) + int(fields[12])
        except (IndexError, ValueError):
            return None

    def listening(self, engine_id: str) -> bool:
        return serving_socket(self.run_dir, engine_id).exists()

    def upstream(self, engine_id: str) -> upstream.Upstream:
        """Connections to the engine, all closed the moment the kernel marks
        its process dead (its death word, wire.deathword): a killed engine's
        sockets close only after Linux has torn its memory down (~0.1 s for
        a vLLM engine here), and its streams move on at their close."""
        up = upstream.Upstream(str(serving_socket(self.run_dir, engine_id)))
        loop = asyncio.get_running_loop()

        def died() -> None:  # on the watch's thread, which ends with it
            loop.call_soon_threadsafe(_died, engine_id, up)

        word = deathword.word_path(heartbeat_path(self.run_dir, engine_id))
        deathword.watch(word, died, threading.Event())
        return up


def _died(engine_id: str, up: upstream.Upstream) -> None:
    if up.closed:
        return  # judged dead already, or dropped: nothing of it left to break
    busy = up.busy
    up.broke_together = up.abort()
    log_event(
        log, "engine_died", engine=engine_id, busy=busy, broke=up.broke_together,
        signal="death_word",
    )  # fmt: skip


class Router:
    """The front's routing state, the loops that feed it, and the waits on it."""

    def __init__(
        self,
        cfg: FrontConfig,
        metrics: FrontMetrics,
        engines: Engines | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.state = fsm.FrontState()
        self.held = 0  # requests waiting for a route now
        self.watchdog = fsm.Watchdog(
            cfg.hang_after_s, cfg.beat_check_s, _STALL_S, cfg.working_hang_after_s
        )
        self._engines = engines or PodEngines(cfg.run_dir)
        # The heartbeats' clock: the engines write CLOCK_MONOTONIC.
        self._clock = clock
        self._changed = asyncio.Event()
        self._upstreams: dict[str, upstream.Upstream] = {}
        # The routed engine's recent (time, CPU ticks): a silent engine that
        # still works is starved, not hung (fsm.Watchdog.working_hang_after_s).
        self._cpu: deque[tuple[float, int]] = deque()
        self._cpu_pid = 0
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop = asyncio.get_running_loop()

    @property
    def route(self) -> fsm.Route | None:
        return self.state.route

    # ----------------------------------------------------------- the core --

    def feed(self, event: fsm.Event) -> None:
        self.state, actions = fsm.step(self.state, event, self._loop.time())
        for action in actions:
            self._execute(action)

    def _execute(self, action: fsm.Action) -> None:
        m = self.metrics
        match action:
            case fsm.RouteTo(route=route, handover=handover):
                if handover and self.state.lost_at is not None:
                    m.detection.observe(max(0.0, self._loop.time() - self.state.lost_at))
                    m.failovers.inc()
                m.routing.set(1)
                m.epoch.set(route.epoch)
                log_event(
                    log, "route", engine=route.engine_id, epoch=route.epoch, failover=handover
                )
                self._wake()
            case fsm.Unroute(reason=reason):
                m.routing.set(0)
                log_event(log, "unrouted", logging.WARNING, reason=reason)
                self._wake()
            case fsm.Kill(engine_id=engine_id, reason=reason):
                self._kill(engine_id, reason)
            case fsm.IgnoredStale(holder=holder, epoch=epoch, newest=newest):
                m.stale.inc()
                log_event(
                    log, "stale_epoch_ignored", logging.WARNING,
                    holder=holder, epoch=epoch, newest=newest,
                )  # fmt: skip
            case fsm.GapEnded(seconds=seconds):
                m.gap.observe(seconds)
                log_event(log, "gap_ended", gap_ms=round(seconds * 1000, 2))
            case _:
                assert_never(action)

    def _wake(self) -> None:
        """Wake every request waiting for a route change."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _kill(self, engine_id: str, reason: str) -> None:
        beat = self._engines.beat(engine_id)
        self.metrics.hung.inc()
        if beat is None:
            log_event(log, "hung_engine_unknown_pid", logging.ERROR, engine=engine_id)
            return
        log_event(
            log, "killing_hung_engine", logging.WARNING,
            engine=engine_id, pid=beat.pid, reason=reason,
        )  # fmt: skip
        self._engines.kill(beat.pid)

    # ------------------------------------------------------------- loops --

    def start(self) -> None:
        """Start the lock watch and the heartbeat check."""
        self._tasks = [
            asyncio.create_task(self._watch_lock(), name="lock-watch"),
            asyncio.create_task(self.check_beats(), name="heartbeats"),
        ]

    async def _watch_lock(self) -> None:
        # The lock's protocol (pydantic) is imported only now, off the loop:
        # the front already accepts, and routes by the keeper's offer.
        await asyncio.to_thread(importlib.import_module, "understudy.lockserver")
        from understudy.lockserver import Address, LockError, watch

        heap.freeze()  # start-up is over: what it imported stays
        address = Address.parse(self.cfg.lock_socket)
        while True:
            try:
                async for h in watch(address):
                    self.metrics.lock_watch_up.set(1)
                    self.feed(fsm.HolderSeen(h.holder, h.epoch))
            except LockError as exc:
                # The lock server restarts: keep routing where we route (the
                # engine still lives), and listen again.
                self.metrics.lock_watch_up.set(0)
                log_event(log, "lock_watch_lost", logging.WARNING, reason=str(exc))
                await asyncio.sleep(0.05)

    async def check_beats(self) -> None:
        """Judge the routed engine's heartbeat every ``beat_check_s``, for ever."""
        w = self.watchdog
        last = self._clock()
        spared = False  # this silence was already logged as a working engine's
        while True:
            await asyncio.sleep(w.check_s)
            now = self._clock()
            due, last = last + w.check_s, now
            route = self.state.route
            beat = self._engines.beat(route.engine_id) if route is not None else None
            working = self._working(beat.pid if beat is not None else 0, now)
            at = beat.monotonic if beat is not None else None
            judged = fsm.judge_beat(w, due, now, at, working=working)
            silent = judged.silent_s > w.hang_after_s
            if silent and working and judged.beat is fsm.Beat.ALIVE and not spared and route:
                log_event(
                    log, "silent_engine_working", logging.WARNING,
                    engine=route.engine_id, silent_ms=round(judged.silent_s * 1000),
                )  # fmt: skip
            spared = silent
            if judged.beat is fsm.Beat.STALLED:
                # The whole machine stalled (CPU starvation, a VM pause): a
                # silent engine now proves nothing. Judge again on the next,
                # punctual check.
                log_event(
                    log, "beat_check_skipped", logging.WARNING, late_ms=round(judged.late_s * 1000)
                )
            elif judged.beat is fsm.Beat.HUNG and route is not None:
                self.feed(fsm.Hung(route.engine_id, judged.silent_s))

    def _working(self, pid: int, now: float) -> bool:
        """Sample the routed engine's CPU time; whether it used any lately."""
        if pid != self._cpu_pid:
            self._cpu.clear()
            self._cpu_pid = pid
        if pid and (ticks := self._engines.cpu_ticks(pid)) is not None:
            self._cpu.append((now, ticks))
            # keep one sample at least a window old: the base to compare with
            while len(self._cpu) > 2 and self._cpu[1][0] <= now - fsm.CPU_WINDOW_S:
                self._cpu.popleft()
        return fsm.cpu_progressed(self._cpu, now)

    # ------------------------------------------------------------ engines --

    def upstream(self, route: fsm.Route) -> upstream.Upstream:
        up = self._upstreams.get(route.engine_id)
        if up is None:
            up = self._engines.upstream(route.engine_id)
            # Connections to engines that are gone are only dead weight.
            for old in [k for k in self._upstreams if k != route.engine_id]:
                self._upstreams.pop(old).close()
            self._upstreams[route.engine_id] = up
        return up

    async def _route(self, deadline: float) -> fsm.Route | None:
        """The route to use now, waiting for one until ``deadline``."""
        while self.state.route is None:
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return None
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()
        return self.state.route

    async def hold(self, deadline: float) -> fsm.Route | None:
        """The route now, or after holding the request until one exists (or the
        deadline); counted as held while it waits, whatever ends the wait."""
        if self.state.route is not None:
            return self.state.route
        since = self._loop.time()
        self.held += 1
        self.metrics.held_total.inc()
        try:
            route = await self._route(deadline)
        finally:  # a client that hangs up while held is no longer held
            self.held -= 1
        if route is not None:
            self.metrics.hold.observe(self._loop.time() - since)
        return route

    async def retry_after(self, route: fsm.Route, outcome: fsm.Outcome, deadline: float) -> None:
        if outcome is fsm.Outcome.BROKEN:
            patience = _MIGRATE_RETRY_S
        elif outcome is fsm.Outcome.NOT_ACTIVE:
            patience = _REFUSED_RETRY_S
        else:  # not listening yet: wake when it does
            patience = _RETRY_S
            self._watch_socket(route, deadline)
        await self._await_change(route, deadline, patience)

    def served(self, route: fsm.Route) -> None:
        self.feed(fsm.Served(route.engine_id))

    async def _await_change(self, route: fsm.Route, deadline: float, patience: float) -> None:
        """Wait up to ``patience`` for the lock to name another route."""
        if self.state.route != route:
            return
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, min(patience, deadline - self._loop.time()))):
                await changed.wait()

    def _watch_socket(self, route: fsm.Route, deadline: float) -> None:
        """Wake the waiting requests the moment the waking engine's socket
        appears (one watcher per engine, however many requests wait)."""
        task = self._watchers.get(route.engine_id)
        if task is None or task.done():
            self._watchers = {k: t for k, t in self._watchers.items() if not t.done()}
            self._watchers[route.engine_id] = asyncio.create_task(
                self._socket_appears(route, deadline), name=f"listen-{route.engine_id}"
            )

    async def _socket_appears(self, route: fsm.Route, deadline: float) -> None:
        if self._engines.listening(route.engine_id):
            return  # there already and still refusing: the waiters' own retry covers it
        while self.state.route == route and self._loop.time() < deadline:
            await asyncio.sleep(_WATCH_S)
            if self._engines.listening(route.engine_id):
                self._wake()
                return

    # ------------------------------------------------------------ surface --

    def ready(self) -> tuple[bool, str]:
        if fsm.ready(self.state, self._loop.time(), self.cfg.hold_s):
            return True, "serving" if self.state.route else "failover under way"
        return False, "no active engine"

    def view(self) -> dict[str, object]:
        s = self.state
        return {
            "phase": s.phase.value,
            "route": {"engine_id": s.route.engine_id, "epoch": s.route.epoch} if s.route else None,
            "newest_epoch": s.newest_epoch,
            "condemned": s.condemned,
        }

    async def close(self) -> None:
        tasks = [*self._tasks, *self._watchers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for up in self._upstreams.values():
            up.close()
