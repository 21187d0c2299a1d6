"""The lock server's asyncio shell: sockets in, events to the core, actions out.

One loop per connection: read, decode, feed the core, carry out
its actions. EOF or a reset becomes ``Disconnected``, which is how "the
connection is the lock" reaches the core. Bad input gets an error reply and
closes only that connection. The state file is written before a grant is
sent, so a crash after a grant always leaves the holder on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Self, assert_never

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from understudy.lockserver import fsm, statefile, tally
from understudy.lockserver.config import ServerConfig
from understudy.lockserver.messages import (
    Acquire,
    Error,
    ErrorCode,
    Granted,
    Holder,
    RemoteLockProtocolError,
    Status,
    StatusReply,
    Watch,
    client_codec,
    server_codec,
)
from understudy.wire import connhold, deathword, handover, priority
from understudy.wire.heartbeat import read_beat
from understudy.wire.obs import log_event, start_metrics_server
from understudy.wire.serving import SERVE_DIR, Beat, heartbeat_path
from understudy.wire.uds import bind_unix, peer_credentials, set_keepalive

log = logging.getLogger("understudy.lockserver")

EPOCH = prom.Gauge("understudy_lock_epoch", "Highest epoch granted or restored")
WAIT = prom.Histogram(
    "understudy_lock_wait_seconds",
    "Time an acquire waited before its grant",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300, 3600),
)
WAITERS = prom.Gauge("understudy_lock_waiters", "Connections waiting in acquire")
HELD = prom.Gauge("understudy_lock_held", "1 while an engine holds the lock")
WINDOW_OPEN = prom.Gauge("understudy_lock_window_open", "1 while the reconnect window is open")
REJECTS = prom.Counter("understudy_lock_rejects_total", "Requests refused", ["code"])
CONNECTIONS = prom.Gauge("understudy_lock_connections", "Open client connections")
WATCHERS = prom.Gauge("understudy_lock_watchers", "Connections watching the holder")
WRITE_FAILURES = prom.Counter(
    "understudy_lock_state_write_failures_total",
    "State file writes that failed (a full or broken volume); a failed grant is retried",
    ["record"],
)

_READ_CHUNK = 64 * 1024
# How often a window looks at its holder's heartbeat, and how old a heartbeat
# may be before its engine counts as gone (engines beat every 0.1 s).
HOLDER_CHECK_S = 0.05
HOLDER_SILENT_S = 2.0
# asyncio re-listens with its own backlog (100 by default); a burst of clients
# (every engine and probe of a pod restarting at once) must not see EAGAIN.
_BACKLOG = 4096


class TallyCollector(Collector):
    """The durable counters (``tally``) in Prometheus form: grants, handovers,
    reissues, closed windows, the handover and re-arm histograms, read from
    the server's tally at every scrape."""

    def __init__(self, server: LockServer) -> None:
        self.server = server

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        t = self.server.tally
        grants = CounterMetricFamily(
            "understudy_lock_grants",
            "Lock grants (resumed: the same holder back with its epoch); durable",
            labels=["resumed"],
        )
        grants.add_metric(["false"], t.grants)
        grants.add_metric(["true"], t.resumed_grants)
        yield grants
        yield CounterMetricFamily(
            "understudy_lock_handovers",
            "Grants of a new epoch after an earlier holder went away (failovers); durable",
            value=t.handovers,
        )
        yield CounterMetricFamily(
            "understudy_lock_reissues",
            "Resume claims honoured under a new epoch (the record was lost); durable",
            value=t.reissues,
        )
        windows = CounterMetricFamily(
            "understudy_lock_window_closed",
            "Reconnect windows closed, by reason; durable",
            labels=["reason"],
        )
        for reason in sorted({*tally.WINDOW_REASONS, *dict(t.windows_closed)}):
            windows.add_metric([reason], t.window_count(reason))
        yield windows
        yield HistogramMetricFamily(
            "understudy_lock_handover_seconds",
            "From the holder's connection closing (its process died) to the next grant "
            "being decided (sent once its record is on disk); durable",
            buckets=t.handover.cumulative(),
            sum_value=t.handover.total,
        )
        yield HistogramMetricFamily(
            "understudy_lock_rearm_seconds",
            "From a handover (the old holder's death) to the next engine queueing for the "
            "lock: a standby again, the pod armed for another death; durable",
            buckets=t.rearm.cumulative(),
            sum_value=t.rearm.total,
        )


class LockServer:
    """``async with LockServer(config) as server: await server.serve_forever()``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state = fsm.LockState()
        self._codec_out = server_codec()
        self._writers: dict[int, tuple[asyncio.StreamWriter, bool]] = {}  # conn -> (w, is_tcp)
        self._ids = itertools.count(1)
        self._servers: list[asyncio.Server] = []
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchers: set[int] = set()
        self._published: Holder | None = None
        self._released_at: float | None = None  # loop time the last holder went away
        self._holder_check: asyncio.TimerHandle | None = None
        self.tally = tally.Tally()
        # A handover's start (loop time) until the next engine queues up (re-arm).
        self._rearm_from: float | None = None
        self._granted_wall: float | None = None  # the holder's grant, for rewrites
        self._collector = TallyCollector(self)
        self._state_file = statefile.StateFile(config.state_file)
        self._listener: socket.socket | None = None  # the pod's serving socket, kept
        # The holder's death word's watch, by connection (wire.deathword): set
        # to stop it; and the connections it closed, with their engine ids.
        self._death_watch: dict[int, threading.Event] = {}
        self._died: dict[int, str] = {}
        # Whether a dead holder's teardown may wait for idle CPU (`_torn_down`):
        # the process's capabilities do not change, so read them once.
        self._idle_teardown_kept = (
            None if priority.may_restore() else "no CAP_SYS_NICE to put it back"
        )

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        self._loop = asyncio.get_running_loop()
        self._restore()
        sock = bind_unix(self.config.socket_path, mode=0o660, backlog=_BACKLOG)
        self._servers.append(
            await asyncio.start_unix_server(
                lambda r, w: self._spawn(self._connection(r, w, is_tcp=False)),
                sock=sock,
                backlog=_BACKLOG,
            )
        )
        log_event(log, "listening", transport="unix", path=str(self.config.socket_path))
        if self.config.tcp is not None:
            host, port = self.config.tcp
            self._servers.append(
                await asyncio.start_server(
                    lambda r, w: self._spawn(self._connection(r, w, is_tcp=True)),
                    host,
                    port,
                    backlog=_BACKLOG,
                )
            )
            log_event(log, "listening", transport="tcp", address=f"{host}:{port}")
        prom.REGISTRY.register(self._collector)
        start_metrics_server(self.config.metrics_port)
        if self.config.serving is not None:
            self._spawn(self._keep_serving_socket(*self.config.serving))
            # and a copy of each client connection the front accepts, so that
            # the front's death closes none of them (connhold)
            run_dir = self.config.socket_path.parent
            keeper = connhold.Keeper(run_dir / connhold.CONNS_SOCKET, log, self.config.conns_hold_s)
            self._spawn(keeper.serve_forever())
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(KeyError):
            prom.REGISTRY.unregister(self._collector)
        if self._timer is not None:
            self._timer.cancel()
        if self._holder_check is not None:
            self._holder_check.cancel()
        for server in self._servers:
            server.close()
        for writer, _ in list(self._writers.values()):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.config.socket_path.unlink()
        if self._listener is not None:
            self._listener.close()  # our copy: the front keeps its own

    async def serve_forever(self) -> None:
        await asyncio.gather(*(s.serve_forever() for s in self._servers))

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _restore(self) -> None:
        path = self.config.state_file
        path.parent.mkdir(parents=True, exist_ok=True)
        result = self._state_file.read()
        wall = time.time()
        self._report_damage(result, wall)
        if result.counters is not None:
            self.tally = result.counters
        elif result.counters_detail:
            log_event(
                log, "counters_unreadable", logging.WARNING, path=str(path),
                detail=result.counters_detail, consequence="failover counters restart at zero",
            )  # fmt: skip
        self._feed(
            fsm.Restored(
                record=result.record,
                corrupt=result.corrupt,
                window_s=self.config.reconnect_window_s,
                epoch_floor=int(wall * 1_000_000),
                sees_claimants=self.config.tcp is None,
            )
        )
        log_event(
            log,
            "restored",
            phase=self.state.phase.value,
            epoch=self.state.epoch,
            holder=result.record.holder if result.record else None,
        )

    def _report_damage(self, result: statefile.ReadResult, wall: float) -> None:
        """Keep damaged copies aside and say what they cost; write a copy that
        was damaged whole again, so the next damage is survived too."""
        for copy_path, why in result.damaged:
            kept = statefile.keep_copy(copy_path, wall)
            log_event(
                log, "state_copy_damaged", logging.ERROR, path=str(copy_path), detail=why,
                copy=str(kept) if kept else None,
                consequence="no whole copy left" if result.corrupt
                else "restored from the other copy, which is written whole again",
            )  # fmt: skip
        if result.corrupt:
            log_event(
                log, "state_file_corrupt", logging.ERROR, path=str(self.config.state_file),
                detail=result.detail,
                consequence="unknown holder assumed; acquires wait until it claims its grant "
                "or no engine in the pod holds an epoch",
            )  # fmt: skip
            return
        try:
            self._state_file.repair(result)
        except OSError as exc:
            log_event(log, "state_repair_failed", logging.ERROR, error=str(exc))

    async def _keep_serving_socket(self, host: str, port: int) -> None:
        """Hold the pod's serving socket and hand it to every front that asks.

        Bound here when the port is free (a new pod). A restarted lock server
        whose front holds the port takes the front's socket instead (it
        cannot bind it again, and a second socket would split the queue)."""
        run_dir = self.config.socket_path.parent
        said = False
        while self._listener is None:
            try:
                sock, _, source = await asyncio.to_thread(
                    handover.obtain, [run_dir / handover.FRONT_SOCKET], host, port
                )
            except (OSError, handover.HandoverError) as exc:
                if not said:  # the front may be starting: ask again, say it once
                    log_event(
                        log, "serving_socket_unavailable", logging.WARNING, port=port,
                        error=str(exc), consequence="asking again every 0.2 s",
                    )  # fmt: skip
                    said = True
                await asyncio.sleep(0.2)
                continue
            self._listener = sock
            log_event(log, "serving_socket_kept", port=port, source=source)
        await handover.offer_forever(
            run_dir / handover.KEEPER_SOCKET, lambda: self._listener, self._offer, log
        )

    def _offer(self) -> handover.Offer:
        s = self.state
        settled = s.holder is not None and s.pending is None
        assert self.config.serving is not None
        return handover.Offer(
            port=self.config.serving[1],
            keeper="lockserver",
            pid=os.getpid(),
            holder=s.holder.engine_id if settled and s.holder else None,
            epoch=s.epoch,
        )

    # ----------------------------------------------------------- the core

    def _feed(self, event: fsm.Event) -> None:
        had, now = self.state.holder, self._now()
        self.state, actions = fsm.step(self.state, event, now)
        if had is not None and (self.state.holder is None or self.state.holder.conn != had.conn):
            self._released_at = now  # the handover clock starts at the holder's EOF
        for action in actions:
            self._execute(action)
        WAITERS.set(len(self.state.waiters))
        HELD.set(1 if self.state.holder else 0)
        WINDOW_OPEN.set(1 if self.state.window else 0)
        EPOCH.set(self.state.epoch)
        self._publish()

    def _holder(self) -> Holder:
        s = self.state
        return Holder(
            holder=s.holder.engine_id if s.holder else None,
            epoch=s.epoch,
            window_open=s.window is not None,
        )

    def _publish(self) -> None:
        """Tell every watcher about a new holder, epoch or window."""
        now = self._holder()
        if now == self._published:
            return
        self._published = now
        for conn in list(self._watchers):
            self._send(conn, now)

    def _execute(self, action: fsm.Action) -> None:
        match action:
            case fsm.Persist():
                self._persist(action)
            case fsm.Clear():
                self._clear(action)
            case fsm.ArmRetry():
                self._arm_retry(action)
            case fsm.Grant():
                self._grant(action)
            case fsm.Reject(conn=conn, code=code, message=message):
                self._reject(conn, code, message)
            case fsm.WindowOpened():
                self._window_opened(action)
            case fsm.WindowClosed():
                self._window_closed(action)
            case _:
                assert_never(action)

    def _persist(self, action: fsm.Persist) -> None:
        # The grant's counts go to disk with the grant itself: kept only if
        # the write succeeds (a failed write undoes the grant).
        staged, wall = self._counted_grant(), time.time()
        try:
            self._state_file.write(action.engine_id, action.epoch, wall, staged)
        except OSError as exc:
            WRITE_FAILURES.labels(record="grant").inc()
            self._feed(fsm.PersistFailed(f"{exc.strerror or exc} ({exc.errno})"))
            return
        if staged.handovers > self.tally.handovers:
            released = self._released_at
            self._rearm_from = released if released is not None else self._now()
        self.tally, self._granted_wall = staged, wall
        self._feed(fsm.Persisted())

    def _clear(self, action: fsm.Clear) -> None:
        try:
            self._state_file.write(None, action.epoch, time.time(), self.tally)
        except OSError as exc:
            # The file still names the last holder: a restart would wait a
            # reconnect window for it. Slower, never unsafe.
            WRITE_FAILURES.labels(record="release").inc()
            log_event(
                log, "state_write_failed", logging.ERROR, record="release",
                epoch=action.epoch, error=str(exc),
            )  # fmt: skip
        log_event(log, "released", epoch=action.epoch)

    def _arm_retry(self, action: fsm.ArmRetry) -> None:
        log_event(
            log, "grant_deferred", logging.ERROR, reason=action.reason,
            retry_in_ms=round((action.deadline - self._now()) * 1000),
            consequence="the grant waits until the state file can be written",
        )  # fmt: skip
        assert self._loop is not None
        self._loop.call_at(action.deadline, lambda: self._feed(fsm.RetryGrant()))

    def _grant(self, action: fsm.Grant) -> None:
        # The grant first (the record is already on disk): the log line and
        # metrics are off the handover's critical path.
        released = None
        if self._released_at is not None and not action.resumed:
            released = time.time() - (self._now() - self._released_at)
        self._send(
            action.conn,
            Granted(
                engine_id=action.engine_id,
                epoch=action.epoch,
                resumed=action.resumed,
                reissued=action.reissued,
                released_at=released,
            ),
        )
        self._released_at = None
        self._watch_death(action.conn, action.engine_id)
        WAIT.observe(action.waited_s)
        log_event(
            log,
            "granted",
            engine_id=action.engine_id,
            epoch=action.epoch,
            resumed=action.resumed,
            waited_ms=round(action.waited_s * 1000, 3),
            conn=action.conn,
        )

    def _watch_death(self, conn: int, engine_id: str) -> None:
        """Close the holder's connection the moment the kernel marks its
        process dead (its death word), not when Linux closes the connection
        after tearing the process's memory down: the next engine's grant
        waits on that close; that teardown then waits for idle CPU. Only
        with ``grant_at_death`` (a pod whose next engine needs none of the
        dead one's memory freed first). A holder over TCP is in another
        pod: its word is not ours to see."""
        entry = self._writers.get(conn)
        if not self.config.grant_at_death or entry is None or entry[1]:
            return
        loop, stop = self._loop, threading.Event()
        assert loop is not None
        path = deathword.word_path(heartbeat_path(self.config.socket_path.parent, engine_id))

        def died() -> None:  # on the watch's thread
            loop.call_soon_threadsafe(self._holder_died, conn, engine_id)

        if deathword.watch(path, died, stop) is not None:
            self._death_watch[conn] = stop

    def _holder_died(self, conn: int, engine_id: str) -> None:
        entry = self._writers.get(conn)
        if entry is None:
            return  # its connection closed first
        log_event(log, "holder_died", engine_id=engine_id, conn=conn, signal="death_word")
        self._died[conn] = engine_id
        entry[0].transport.abort()  # the connection's loop sees EOF: Disconnected

    def _unwatch(self, conn: int) -> str | None:
        """Stop watching a closed connection's death word; why it closed if
        the word closed it."""
        stop = self._death_watch.pop(conn, None)
        if stop is not None:
            stop.set()
        return "process_died" if conn in self._died else None

    def _torn_down(self, conn: int) -> None:
        """After a closed connection's Disconnected (the next engine's grant
        sent): if the death word closed it, the dead holder's teardown waits
        for idle CPU (wire.priority) for `priority.TEARDOWN_IDLE_S`, off the
        cores the next engine wakes on. Its pid is in its heartbeat."""
        engine_id = self._died.pop(conn, None)
        if engine_id is None:
            return
        beat = read_beat(heartbeat_path(self.config.socket_path.parent, engine_id))
        if beat is None:
            return
        # Only where it can be put back: idle for the whole teardown could
        # hold the dead engine's memory, and its restart, for seconds.
        reason = self._idle_teardown_kept
        try:
            tids = [] if reason is not None else priority.idle_teardown(beat.pid)
        except OSError as exc:  # another user's: it tears down as before
            reason = str(exc)
        if reason is not None:
            log_event(
                log, "teardown_priority_kept", engine_id=engine_id, pid=beat.pid, reason=reason
            )
            return
        log_event(log, "teardown_idle", engine_id=engine_id, pid=beat.pid, threads=len(tids))
        if tids and self._loop is not None:
            self._loop.call_later(
                priority.TEARDOWN_IDLE_S, self._teardown_restored, engine_id, beat.pid, tids
            )

    def _teardown_restored(self, engine_id: str, pid: int, tids: list[int]) -> None:
        """The first steps are through: what is left of the teardown (under
        a saturated CPU, most of it) finishes at its own priority, and the
        respawner, which restarts the engine once it is reaped, waits no
        longer."""
        try:
            threads = priority.restore(pid, tids)
        except OSError as exc:
            log_event(log, "teardown_priority_kept", engine_id=engine_id, pid=pid, reason=str(exc))
            return
        if threads:
            log_event(log, "teardown_restored", engine_id=engine_id, pid=pid, threads=threads)

    def _window_opened(self, action: fsm.WindowOpened) -> None:
        log_event(
            log,
            "window_opened",
            logging.WARNING,
            holder=action.holder or "<unknown>",
            epoch=action.epoch,
            seconds=round(action.deadline - self._now(), 3),
            corrupt=action.corrupt,
        )
        self._arm_timer(action.deadline)

    def _window_closed(self, action: fsm.WindowClosed) -> None:
        # Written with the grant or release that always follows it.
        self.tally = tally.window_closed(self.tally, action.reason)
        log_event(log, "window_closed", reason=action.reason)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _counted_grant(self) -> tally.Tally:
        """The tally once the pending grant is sent."""
        pending = self.state.pending
        if pending is None:
            return self.tally
        handover = not pending.resumed and pending.last_holder_before is not None
        seconds = None
        if handover and self._released_at is not None:
            seconds = self._now() - self._released_at
        return tally.granted(
            self.tally,
            resumed=pending.resumed,
            reissued=pending.reissued,
            handover=handover,
            handover_s=seconds,
        )

    def _check_rearm(self, conn: int) -> None:
        """After a handover, the first engine to queue for the lock is a
        standby again: the pod is re-armed. Its time goes to disk at once (the
        record is rewritten as it was, with the counts), so it is durable too."""
        s = self.state
        if self._rearm_from is None or s.holder is None or s.pending is not None:
            return
        if not any(w.conn == conn for w in s.waiters):
            return
        seconds = self._now() - self._rearm_from
        self._rearm_from = None
        self.tally = tally.rearmed(self.tally, seconds)
        log_event(log, "rearmed", seconds=round(seconds, 3), epoch=s.epoch)
        try:
            self._state_file.write(
                s.holder.engine_id,
                s.epoch,
                self._granted_wall or time.time(),
                self.tally,
            )
        except OSError as exc:
            WRITE_FAILURES.labels(record="counters").inc()
            log_event(
                log, "state_write_failed", logging.ERROR, record="counters", error=str(exc),
                consequence="the re-arm is counted until this server restarts",
            )  # fmt: skip

    def _arm_timer(self, deadline: float) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_at(deadline, self._on_timer)
        if self._holder_check is None:
            self._holder_check = self._loop.call_later(HOLDER_CHECK_S, self._check_holder)

    def _check_holder(self) -> None:
        """While a window waits for its holder, look at the heartbeats
        (engines in the pod write one next to our socket): for a persisted
        holder, a pid that no longer runs, or a record that stopped moving,
        means it will never come back; for an unknown holder, so does no
        engine of the pod holding an epoch."""
        self._holder_check = None
        w = self.state.window
        if w is None:
            return
        run_dir = self.config.socket_path.parent
        if w.holder is not None:
            reason = _gone(read_beat(heartbeat_path(run_dir, w.holder)))
        elif self.config.tcp is None:
            reason = _no_claimant(run_dir)
        else:
            return  # engines elsewhere: their heartbeats are not ours to see
        if reason is not None:
            log_event(log, "holder_gone", logging.WARNING, holder=w.holder, reason=reason)
            self._feed(fsm.HolderGone(w.holder, reason))
            return
        assert self._loop is not None
        self._holder_check = self._loop.call_later(HOLDER_CHECK_S, self._check_holder)

    def _on_timer(self) -> None:
        self._timer = None
        deadline = fsm.next_deadline(self.state)
        if deadline is None:
            return  # the window closed meanwhile
        if self._now() < deadline:
            # The loop's timers may fire up to its clock's resolution early
            # (libuv's: a millisecond); the core refuses an early expiry.
            self._arm_timer(deadline)
            return
        self._feed(fsm.WindowExpired())

    # -------------------------------------------------------- connections

    def _send(self, conn: int, message: Granted | StatusReply | Holder | Error) -> None:
        entry = self._writers.get(conn)
        if entry is None:
            return  # already gone; its Disconnected is on its way to the core
        writer, _ = entry
        if writer.is_closing():
            return
        writer.write(self._codec_out.encode(message))

    def _reject(self, conn: int, code: str, message: str) -> None:
        REJECTS.labels(code=code).inc()
        log_event(log, "rejected", logging.WARNING, conn=conn, code=code, reason=message)
        self._send(conn, Error(code=_error_code(code), message=message))

    def _authorized(self, is_tcp: bool, token: str | None) -> bool:
        if not is_tcp:
            return True  # Unix sockets are guarded by the file mode (0660)
        expected = self.config.token or ""
        return token is not None and hmac.compare_digest(token.encode(), expected.encode())

    async def _connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, is_tcp: bool
    ) -> None:
        conn = next(self._ids)
        sock: socket.socket | None = writer.get_extra_info("socket")
        if is_tcp and sock is not None:
            set_keepalive(sock)
            peer = str(writer.get_extra_info("peername"))
        else:
            cred = peer_credentials(sock) if sock is not None else None
            peer = str(cred) if cred else "unknown"
        log_event(log, "connected", logging.DEBUG, conn=conn, peer=peer, tcp=is_tcp)
        self._writers[conn] = (writer, is_tcp)
        CONNECTIONS.inc()
        codec = client_codec()
        reason = "eof"
        try:
            self._feed(fsm.Connected(conn))
            while True:
                data = await reader.read(_READ_CHUNK)
                if not data:
                    break
                try:
                    messages = codec.feed(data)
                except RemoteLockProtocolError as exc:
                    reason = "protocol_error"
                    self._reject(conn, "bad_request", str(exc))
                    break
                for message in messages:
                    if not self._authorized(is_tcp, message.token):
                        reason = "unauthorized"
                        self._reject(conn, "unauthorized", "missing or wrong token")
                        break
                    self._handle(conn, message)
                else:
                    continue
                break
        except (ConnectionError, TimeoutError) as exc:
            reason = type(exc).__name__
        finally:
            reason = self._unwatch(conn) or reason
            self._writers.pop(conn, None)
            self._watchers.discard(conn)
            WATCHERS.set(len(self._watchers))
            CONNECTIONS.dec()
            held = self.state.holder is not None and self.state.holder.conn == conn
            self._feed(fsm.Disconnected(conn))
            log_event(
                log,
                "disconnected",
                logging.INFO if held else logging.DEBUG,
                conn=conn,
                peer=peer,
                reason=reason,
                was_holder=held,
            )
            self._torn_down(conn)
            with contextlib.suppress(Exception):
                await writer.drain()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _handle(self, conn: int, message: Acquire | Status | Watch) -> None:
        match message:
            case Acquire(engine_id=engine_id, resume_epoch=resume_epoch):
                log_event(
                    log,
                    "acquire",
                    logging.DEBUG,
                    conn=conn,
                    engine_id=engine_id,
                    resume_epoch=resume_epoch,
                )
                self._feed(fsm.AcquireRequested(conn, engine_id, resume_epoch))
                self._check_rearm(conn)
            case Status():
                # Snapshot and StatusReply carry the same fields by design: the
                # core decides what status says, the message is its wire form.
                snap = fsm.snapshot(self.state, self._now())
                self._send(conn, StatusReply(**dataclasses.asdict(snap)))
            case Watch():
                self._watchers.add(conn)
                WATCHERS.set(len(self._watchers))
                self._send(conn, self._holder())
            case _:
                assert_never(message)


def _gone(beat: Beat | None) -> str | None:
    """Why the engine that wrote ``beat`` is gone, or None if it may live."""
    if beat is None:
        return None  # no heartbeat (yet): nothing proves it gone
    try:
        os.kill(beat.pid, 0)
    except ProcessLookupError:
        return f"its process {beat.pid} is gone"
    except PermissionError:
        pass  # alive, someone else's
    silent = time.monotonic() - beat.monotonic
    if silent > HOLDER_SILENT_S:
        return f"its heartbeat stopped {silent:.1f}s ago"
    return None


def _no_claimant(run_dir: Path) -> str | None:
    """Why no engine in the pod can hold the lock, or None if one may: an
    engine that was granted an epoch writes it into its heartbeat."""
    beats = sorted((run_dir / SERVE_DIR).glob("*.beat"))
    for path in beats:
        beat = read_beat(path)
        if beat is not None and beat.epoch > 0 and _gone(beat) is None:
            return None
    return f"none of the pod's {len(beats)} engine heartbeats holds an epoch"


def _error_code(code: str) -> ErrorCode:
    match code:
        case "bad_request" | "unauthorized" | "superseded" | "busy":
            return code
    return "internal"


async def run(config: ServerConfig) -> None:
    async with LockServer(config) as server:
        await server.serve_forever()
