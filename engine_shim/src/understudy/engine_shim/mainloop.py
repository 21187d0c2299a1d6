"""The engine's main loop, the same for both roles (the lock grant is the wake trigger):

    init_weights() → sleep() → acquire() [blocks] → wake_up() → serve_endpoint()

A linear sequence on the main thread, driving the state machine in ``fsm``;
monitors (the lock client's watcher, the GMS watchers, deadline timers) feed
events from their own threads. Any ``Exit`` action ends the process at once
with one log line naming the reason and the state (fail fast: never sit
until a probe notices).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final, assert_never

import prometheus_client as prom

from understudy.engine_shim import crash, fsm
from understudy.engine_shim.adapters.base import Engine
from understudy.engine_shim.config import EngineConfig
from understudy.engine_shim.early_status import EarlyStatus
from understudy.engine_shim.fsm import Budgets, State
from understudy.engine_shim.http import HttpHost
from understudy.engine_shim.probes import Probe, Verdict, verdict
from understudy.engine_shim.weights import Weights
from understudy.gms.client import GmsError
from understudy.lockserver import client as lock_client
from understudy.wire import deathword, failpoints, heap, priority, respawn
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.engine_shim")


# Failover phases: 1 ms to 30 s, about 25 % apart below a second, so a
# percentile agrees with a drill's measurement within a bucket.
PHASE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25,
    0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20, 30,
)  # fmt: skip
# Init (re-arm or a cold load): a second to the longest startup budget.
_INIT_BUCKETS = (0.25, 0.5, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300, 600, 1800)
# The start-up of a restarted engine runs at this nice value, SCHED_BATCH or
# SCHED_IDLE (`lowered_policy`): on a CPU the Active engine also wants, it gets
# ~10% (CFS weight 110 against 1024), not half.
STARTUP_NICE: Final = 10
# ... for this long at most; then back to the caller's priority where the
# process may raise it (run_yielding). Under a saturated CPU ~10% is too
# little for a start-up of seconds of CPU: vLLM's (~15 s of CPU on SmolLM2)
# re-armed after 100 s in a local drill of 8 clients, with the engines in
# one autogroup (so that nice weighs at all: tools.local). The first
# seconds after a failover, when the Active engine takes the streams over,
# are what the yield is for.
STARTUP_YIELD_S: Final = 5.0
# (A restarted engine also starts a second late, before its imports:
# cli.STARTUP_DEFER_S.)


def lowered_policy(status: str | None = None) -> int:
    """The scheduling policy of the work `run_yielding` runs.

    SCHED_IDLE where the process may take its threads out of it again
    (`priority.may_restore`; sched(7): leaving SCHED_IDLE needs CAP_SYS_NICE): a
    thread of the Active engine that wakes preempts an idle-policy thread at
    once, where one at SCHED_BATCH and nice 10 ran on to the end of its
    slice. vLLM-CPU's forward pass is an OpenMP team on both cores, whose
    threads wait on each other at every barrier: in a failover at 4,000
    tokens, a spare importing vLLM at nice 10 took 72-75 ms of a core
    during first steps of 131-152 ms (ftrace, 2026-12-05, night), and with
    SCHED_IDLE none of 12 first steps took over 111 ms where 3 of 6 had
    taken 190-222 (docs/performance.md). Its start-up waits for idle CPU
    only for `run_yielding`'s ``most_s``, and a standby is still ready in
    seconds. Where the priority cannot be put back, SCHED_BATCH: idle for
    the whole start-up would starve it wherever the CPUs are busy."""
    return os.SCHED_IDLE if priority.may_restore(status) else os.SCHED_BATCH


def run_yielding(
    work: Callable[[], None],
    name: str,
    nice: int = STARTUP_NICE,
    most_s: float = STARTUP_YIELD_S,
    clock: Callable[[], None] = lambda: None,
) -> None:
    """Run ``work`` on a thread of its own at a lower CPU priority, wait for
    it, and raise what it raised (a restarted engine has already waited
    ``cli.STARTUP_DEFER_S`` before this). ``most_s`` after the work began,
    or after ``clock`` returned where one is given (a spare's imports: after
    its turn, however long it waited for it), the threads still at that
    priority (the work's, and those it started) are put back at the caller's
    where the process may do so (``startup_priority_restored``; as root, or
    with CAP_SYS_NICE). With a ``clock``, the call returns once both the
    work and the clock are done.

    A thread, because Linux keeps the policy and the nice value per thread, and
    an unprivileged thread cannot take them back (sched(7): leaving SCHED_IDLE
    or lowering nice needs CAP_SYS_NICE or an RLIMIT_NICE above the default 0;
    measured as uid 65534: EPERM/EACCES). The threads that serve (the lock's
    watcher, the HTTP host, the batcher at wake) are started by the main
    thread and keep its normal priority; threads ``work`` starts inherit the
    lower one (GMS's watcher of the init session, which sleep drops).
    """
    failure: list[BaseException] = []
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    policy = lowered_policy()

    def run() -> None:
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError) as exc:  # not Linux, or refused: go on unchanged
            log_event(log, "startup_priority_unchanged", logging.WARNING, reason=exc)
        try:
            work()
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    # A thread's nice weighs only against the threads of its own autogroup
    # (or cgroup): the local runner keeps a pod's processes in one session
    # (tools.local); in Kubernetes each container is a cgroup, which nice
    # does not cross. Lowering the process's autogroup instead starved its
    # status port at load 30 (a liveness kill of the restarting engine), so
    # it is not done.
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    clock()
    thread.join(most_s)
    if thread.is_alive():
        _restore_priority(before, nice)
        thread.join()
    if failure:
        raise failure[0]


def _restore_priority(before: int, lowered: int) -> None:
    """Put this process's threads at nice ``lowered`` back at ``before`` and
    SCHED_OTHER (run_yielding's time is up), as far as permitted."""
    restored = 0
    try:
        for tid in map(int, os.listdir("/proc/self/task")):
            with contextlib.suppress(ProcessLookupError):
                if os.getpriority(os.PRIO_PROCESS, tid) == lowered:
                    os.setpriority(os.PRIO_PROCESS, tid, before)
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                    restored += 1
    except OSError as exc:  # unprivileged: the yield lasts the whole start-up
        log_event(log, "startup_priority_kept", reason=exc)
        return
    log_event(log, "startup_priority_restored", threads=restored)


class Metrics:
    def __init__(self, cfg: EngineConfig) -> None:
        self.registry = prom.CollectorRegistry()
        labels = {"engine": cfg.name, "role": cfg.role}
        self.labels = labels
        self.state = prom.Gauge(
            "understudy_engine_state",
            "1 for the engine's current state, 0 for the others",
            ["engine", "role", "state"],
            registry=self.registry,
        )
        self.transitions = prom.Counter(
            "understudy_engine_transitions_total",
            "Engine state transitions",
            ["engine", "role", "from_state", "to_state"],
            registry=self.registry,
        )
        # A histogram although each process observes it once: across the
        # restarts of one engine container it is the re-arm distribution
        # (weights="imported": mapped from GMS) or the cold-load one ("loaded").
        self.init_s = prom.Histogram(
            "understudy_engine_init_duration_seconds",
            "Init: process start to Standby, by where the weights came from",
            ["engine", "role", "weights"],
            buckets=_INIT_BUCKETS,
            registry=self.registry,
        )
        self.failover = prom.Histogram(
            "understudy_failover_duration_seconds",
            "In-pod failover phases seen by the new active engine: detect (the old holder's "
            "release to our grant), wake, serve, grant_to_active",
            ["engine", "role", "phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.epoch = prom.Gauge(
            "understudy_engine_lock_epoch",
            "Lock epoch this engine was granted",
            ["engine", "role"],
            registry=self.registry,
        )

        # Every labelled series from the start, at zero: a rate() sees the
        # first observation only as a rise from a scraped zero (an engine
        # observes each of these about once in its life).
        for phase in ("detect", "wake", "serve", "grant_to_active"):
            self.failover.labels(**labels, phase=phase)
        for source in ("imported", "loaded"):
            self.init_s.labels(**labels, weights=source)

    def set_state(self, state: State) -> None:
        for s in State:
            self.state.labels(**self.labels, state=s.value).set(1 if s is state else 0)


class Shim:
    def __init__(
        self,
        cfg: EngineConfig,
        engine: Engine,
        host: HttpHost | None = None,
        early: EarlyStatus | None = None,
        yield_until: float | None = None,
    ) -> None:
        self.cfg = cfg
        self.early = early  # the status port, answered since the process began
        # A restarted engine's start-up yields until then (monotonic; None:
        # STARTUP_YIELD_S from its beginning).
        self.yield_until = yield_until
        self.engine = engine
        self.s = fsm.initial(time.monotonic(), Budgets(cfg.startup_budget_s, cfg.wake_timeout_s))
        self.metrics = Metrics(cfg)
        self.metrics.set_state(self.s.state)
        self.host = host or HttpHost()
        self.weights = Weights(cfg, lambda why: self.report(fsm.GmsLost(why)))
        self.held: lock_client.HeldLock | None = None
        self._mutex = threading.RLock()
        self._timer: threading.Timer | None = None
        self._serving = False
        self.last_transition: dict[str, Any] | None = None
        self.walls: dict[str, float] = {"started_at": time.time()}
        self.durations: dict[str, float] = {}
        self._granted = 0.0  # monotonic time of the lock grant
        self.readoptions = 0  # times this engine gave its weights back to a new GMS

    # --------------------------------------------------------- the core --

    def feed(self, event: fsm.Event) -> list[fsm.Action]:
        """Step the machine; carry out Exit at once (from any thread)."""
        with self._mutex:
            if self.s.state is State.DEAD:
                return []  # already on the way out
            now = time.monotonic()
            old = self.s
            self.s, actions = fsm.step(self.s, event, now)
            if self.s.state is not old.state:
                self._transitioned(old, event, now)
        rest: list[fsm.Action] = []
        for action in actions:
            if isinstance(action, fsm.Exit):
                self._exit(action)
            rest.append(action)
        return rest

    def report(self, event: fsm.Event) -> None:
        """For monitors (their own threads): feed an event; what it asks for
        besides an exit (giving the weights back to a restarted GMS) runs on a
        thread of its own, so the monitor goes on watching."""
        pending = self.feed(event)
        if pending:
            threading.Thread(target=self._run, args=(pending,), name="report", daemon=True).start()

    def _run(self, pending: list[fsm.Action]) -> None:
        while pending:
            pending += self._do(pending.pop(0))

    def _transitioned(self, old: fsm.EngineState, event: fsm.Event, now: float) -> None:
        new = self.s.state
        wall = time.time()
        self.last_transition = {
            "from": old.state.value,
            "to": new.value,
            "event": type(event).__name__,
            "at": wall,
        }
        self.walls[f"{new.value.lower()}_at"] = wall
        self.metrics.set_state(new)
        self.metrics.transitions.labels(
            **self.metrics.labels, from_state=old.state.value, to_state=new.value
        ).inc()
        log_event(
            log,
            "transition",
            engine=self.cfg.engine_id,
            role=self.cfg.role,
            from_state=old.state.value,
            to_state=new.value,
            by=type(event).__name__,
            after_s=round(now - old.since, 4),
            epoch=self.s.epoch,
        )
        self._arm_deadline()

    def _arm_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        when = fsm.deadline(self.s)
        if when is None:
            return
        armed_for = self.s.state

        def fire() -> None:
            with self._mutex:
                if self.s.state is not armed_for:
                    return  # moved on in time
                event = fsm.expired(self.s, self.host.inflight)
            self.feed(event)

        self._timer = threading.Timer(max(0.0, when - time.monotonic()), fire)
        self._timer.daemon = True
        self._timer.start()

    def _exit(self, action: fsm.Exit) -> None:
        log_event(
            log,
            "exit",
            logging.ERROR if action.code else logging.INFO,
            engine=self.cfg.engine_id,
            role=self.cfg.role,
            state=action.state.value,
            code=int(action.code),
            reason=action.reason,
        )
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(int(action.code))

    # ------------------------------------------------------- the surface --

    def verdict(self, probe: Probe) -> Verdict:
        with self._mutex:
            s = self.s
        healthy, why = self.serving_health() if s.state is State.ACTIVE else (False, "")
        return verdict(probe, s.state, s.time_in_state(time.monotonic()), healthy, s.budgets, why)

    def serving_health(self) -> tuple[bool, str]:
        if not self._serving:
            return False, "serving endpoint not bound"
        ok, why = self.engine.health()
        if not ok:
            return ok, why
        # The GPU itself, as GMS sees it through NVML (a pending Xid, ECC
        # errors, a lost device); always healthy where there is no NVML.
        for session in list(self.weights.sessions.values()):
            try:
                ok, why = session.device_health()
            except GmsError:
                continue  # GMS itself gone: its monitor ends the engine
            if not ok:
                return ok, why
        return True, "ok"

    def state_view(self) -> dict[str, Any]:
        with self._mutex:
            s = self.s
        return {
            "role": self.cfg.role,
            "name": self.cfg.name,
            "engine_id": self.cfg.engine_id,
            "pid": os.getpid(),
            # in-place restarts of this container's engine before this process
            "restarts": respawn.restarts(),
            "adapter": self.engine.name,
            "state": s.state.value,
            "time_in_state_s": round(s.time_in_state(time.monotonic()), 4),
            "epoch": s.epoch,
            "readopting": s.readopting,
            "readoptions": self.readoptions,
            "last_transition": self.last_transition,
            "serving_socket": str(self.cfg.serve_socket),
            "weights": {"loaded": self.weights.loaded, "imported": self.weights.imported},
            **{k: v for k, v in self.walls.items()},
            # wall time of the lock grant (= entering Waking), as the operator reads it
            "granted_at": self.walls.get("waking_at"),
            **{f"{k}_s": round(v, 4) for k, v in self.durations.items()},
        }

    # --------------------------------------------------------- the loop --

    def run(self) -> None:
        cfg = self.cfg
        self.host.start()
        self.host.serve_status(
            "0.0.0.0",
            cfg.status_port,
            self.verdict,
            self.state_view,
            self.metrics.registry,
            sock=self.early.handover() if self.early is not None else None,
        )
        self.host.start_heartbeat(cfg.heartbeat, lambda: self.s.epoch)
        # The word the kernel marks at this process's death, before its memory
        # is torn down: the lock server, GMS (for the KV pool) and the front
        # see a killed Active at once, not at its connections' close
        # (wire.deathword). Best effort: without it the closes still do.
        try:
            deathword.arm(deathword.word_path(cfg.heartbeat))
        except OSError as exc:
            log_event(log, "death_word_off", logging.WARNING, reason=exc)
        # SIGTERM drains an Active engine and ends any other at once. A handler
        # of our own also means the signal is delivered when the engine runs
        # as a container's PID 1, where the kernel drops signals that have
        # no handler.
        signal.signal(signal.SIGTERM, lambda *_: self._terminate())
        log_event(
            log,
            "starting",
            engine=cfg.engine_id,
            role=cfg.role,
            adapter=self.engine.name,
            devices=",".join(map(str, cfg.devices)),
            status_port=cfg.status_port,
        )
        self._arm_deadline()
        t0 = time.monotonic()
        try:
            failpoints.hit("engine.init")
            if respawn.restarts() and getattr(self.engine, "start_up_yields", False):
                # Restarted behind a failover: the Active engine serves on the
                # same CPUs, and this engine's start-up (GMS import, attach,
                # warm-up: seconds of CPU) must not slow it. A first start
                # has no Active to yield to. Only adapters that say their
                # start-up may run off the main thread (vLLM's is not known to).
                left = (
                    STARTUP_YIELD_S
                    if self.yield_until is None
                    else self.yield_until - time.monotonic()
                )
                if left > 0:
                    run_yielding(self._init, "start-up", most_s=left)
                else:  # a promoted spare's imports took the whole window
                    self._init()
            else:
                self._init()
        except Exception as exc:  # any init error ends the process now
            self.feed(fsm.Fatal(f"init failed: {type(exc).__name__}: {exc}"))
        heap.freeze()  # before Standby: no full collection in a failover's path
        reset = crash.die_at_once()  # the adapter's libraries are loaded now
        if reset:
            log_event(log, "crash_handlers_reset", signals=reset)
        self.durations["init"] = time.monotonic() - t0
        source = "imported" if self.weights.imported else "loaded"
        self.metrics.init_s.labels(**self.metrics.labels, weights=source).observe(
            self.durations["init"]
        )
        pending = self.feed(fsm.InitDone())
        # Standby: this engine has proved it can start. A respawner (the
        # engine container's init, docs/pod.md) restarts it at once from now
        # on if it dies, instead of backing off.
        respawn.notify_ready()
        # While it waits for the lock: the KV pool's pages mapped ahead of a
        # failover's first reads (kvreader).
        self.weights.follow_kv(self.engine)
        while pending:
            pending += self._do(pending.pop(0))
        threading.Event().wait()  # Active: serve until the process ends

    def _init(self) -> None:
        self.weights.init(self.engine, deadline=self.s.started + self.cfg.startup_budget_s)
        self.engine.sleep()
        self.weights.sleep()

    def _do(self, action: fsm.Action) -> list[fsm.Action]:
        match action:
            case fsm.Acquire():
                return self._acquire()
            case fsm.Wake():
                return self._wake()
            case fsm.BindServing():
                return self._bind_serving()
            case fsm.Readopt(deadline=deadline):
                return self._readopt(deadline)
            case fsm.Drain(deadline=deadline):
                unfinished = self.host.drain(max(0.0, deadline - time.monotonic()))
                return self.feed(fsm.Drained(unfinished=unfinished))
            case fsm.Exit():
                return []  # carried out in feed()
            case _:
                assert_never(action)

    def _acquire(self) -> list[fsm.Action]:
        cfg = self.cfg
        try:
            self.held = lock_client.acquire(
                str(cfg.lock_socket),
                cfg.engine_id,
                None,
                on_lost=lambda why: self.report(fsm.LockLost(why)),
                on_epoch=self._reissued,
                reconnect_timeout=cfg.lock_reconnect_s,
                connect_timeout=cfg.lock_reconnect_s,
            )
        except lock_client.LockError as exc:
            return self.feed(fsm.Fatal(f"lock: {exc}"))
        self._granted = time.monotonic()
        self.metrics.epoch.labels(**self.metrics.labels).set(self.held.epoch)
        released = self.held.released_at
        if released is not None:
            # The lock server's clock and ours are the node's: the
            # previous holder's death to our grant is the detection.
            self.walls["released_at"] = released
            self.durations["detect"] = max(0.0, time.time() - released)
            self.metrics.failover.labels(**self.metrics.labels, phase="detect").observe(
                self.durations["detect"]
            )
        return self.feed(fsm.LockGranted(self.held.epoch))

    def _wake(self) -> list[fsm.Action]:
        t0 = time.monotonic()
        try:
            failpoints.hit("engine.wake")
            self.weights.wake(self.cfg.remap_timeout_s, self.s.epoch)
            self.weights.acquire_kv(self.engine, self.cfg.remap_timeout_s, self.s.epoch)
            self.engine.wake()
        except Exception as exc:  # a failed remap is fatal: restart and re-init
            return self.feed(fsm.Fatal(f"wake failed: {type(exc).__name__}: {exc}"))
        self.durations["wake"] = time.monotonic() - t0
        self.metrics.failover.labels(**self.metrics.labels, phase="wake").observe(
            self.durations["wake"]
        )
        return self.feed(fsm.WakeDone())

    def _bind_serving(self) -> list[fsm.Action]:
        cfg = self.cfg
        t0 = time.monotonic()
        try:
            self.host.bind_serving(
                cfg.serve_socket,
                self.engine.routes(),
                self.serving_health,
                lambda: self.s.epoch or 0,
            )
        except OSError as exc:
            return self.feed(fsm.Fatal(f"cannot listen on {cfg.serve_socket}: {exc}"))
        self._serving = True
        self.durations["serve"] = time.monotonic() - t0
        self.durations["grant_to_active"] = time.monotonic() - self._granted
        self.metrics.failover.labels(**self.metrics.labels, phase="serve").observe(
            self.durations["serve"]
        )
        self.metrics.failover.labels(**self.metrics.labels, phase="grant_to_active").observe(
            self.durations["grant_to_active"]
        )
        return self.feed(fsm.ServingReady())

    def _readopt(self, deadline: float) -> list[fsm.Action]:
        """GMS died under this engine, Active or waking over mapped weights:
        give its allocations back to the restarted one (serving, or the wake,
        goes on from the mappings meanwhile)."""
        t0 = time.monotonic()
        try:
            failpoints.hit("gms.readopt")
            how = self.weights.readopt(max(0.0, deadline - t0), self.s.epoch)
        except Exception as exc:  # the next GMS never came, or refused: exit
            return self.feed(fsm.ReadoptFailed(f"re-adoption failed: {type(exc).__name__}: {exc}"))
        self.readoptions += 1
        self.durations["readopt"] = time.monotonic() - t0
        log_event(
            log,
            "readopted",
            engine=self.cfg.engine_id,
            how=",".join(how),
            seconds=round(self.durations["readopt"], 4),
        )
        return self.feed(fsm.Readopted())

    def _reissued(self, epoch: int) -> None:
        """From the lock's monitor thread: our grant lives on under a new epoch."""
        self.feed(fsm.EpochReissued(epoch))
        self.metrics.epoch.labels(**self.metrics.labels).set(epoch)
        log_event(log, "epoch_reissued", engine=self.cfg.engine_id, epoch=epoch)

    def _terminate(self) -> None:
        """SIGTERM, in the signal handler: the work goes to a thread of its own
        (the main thread may be blocked in acquire, or be the one serving)."""

        threading.Thread(
            target=lambda: self._run(self.feed(fsm.Terminate())), name="terminate", daemon=True
        ).start()
