"""The GMS server: an asyncio shell around ``fsm`` for one (device, tag).

One ``fsm.Machine`` takes every event, of both protocols (the weights' lock
and the KV pool): the core picks the table, so this shell never asks which
protocol a connection speaks.

One loop per connection: read (``recvmsg``), feed the codec, step the core,
carry out the actions. EOF or a reset becomes ``Disconnected``, which is how
a writer's death aborts its allocations.

Fds from clients: the server takes exactly one kind, the memory an engine
sends back with ``adopt_allocation`` after this server restarted under it
(re-adoption, ``fsm.weights``): one fd, riding on that request's first byte, wrapped
at once and handed to the backend, which checks what it is. Any other fd a
client sends is closed the moment it is received, and a request that needs
one and came without is refused.

The committed layout's record (``<socket>.layout``: its hash) is kept beside
the socket, in the pod's run directory, which outlives this process: a
server that restarts over it waits, within ``adopt_window_s``, for the engine
that still maps that layout to give it back, instead of letting anyone load
the checkpoint anew.

Errors: bytes that do not decode (garbage, a length over the cap, an unknown
message) get a ``protocol`` error reply and the connection is closed. A
well-formed request the session may not make (``allocate`` while RO, an
unknown id) gets an error reply (``refused``, ``not_found``) and the session
goes on: a refusal is an answer, not a broken stream. Either way the server
and the other sessions carry on.

Outgoing frames go through one queue and one writer task per connection, so
executing actions never awaits and frames to one peer never interleave. An
exported fd travels in the same ``sendmsg`` as its frame and is closed here
once sent.

The GPU behind the server (``health``, NVML, optional): polled every
``health_interval_s`` for the metrics and the log (a change of health is one
line), and at most once a second for a ``get_state``, whose report the shell
completes with it (the core knows nothing of devices).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, assert_never

from understudy.gms import fsm, metrics
from understudy.gms import messages as m
from understudy.gms.backends import ServerBackend, make_server_backend
from understudy.gms.config import ServerConfig
from understudy.gms.health import DeviceMonitor
from understudy.gms.layout import AllocationRecord
from understudy.gms.lockword import read_lock_word
from understudy.wire import deathword
from understudy.wire.framing import RemoteFrameError, encode
from understudy.wire.messages import MessageCodec
from understudy.wire.obs import log_event, start_metrics_server
from understudy.wire.serving import heartbeat_path
from understudy.wire.uds import (
    OwnedFd,
    bind_unix,
    peer_credentials,
    sock_recv_with_fd,
    sock_send_frame,
)

log = logging.getLogger("understudy.gms.server")

_MemoryAction = (
    fsm.CreateMemory | fsm.AdoptMemory | fsm.SendExport | fsm.ReleaseMemory | fsm.GrantKv
)

_RECV_SIZE = 256 * 1024
_REPORT_MAX_AGE_S = 1.0  # a get_state reuses a device report this fresh

Outgoing = tuple[bytes, int | None] | None  # None: close after what is queued


@dataclass(slots=True)
class _Conn:
    sid: int
    sock: socket.socket
    outbox: asyncio.Queue[Outgoing] = field(default_factory=asyncio.Queue)
    timer: asyncio.TimerHandle | None = None
    closing: bool = False
    fd: OwnedFd | None = None  # came with the frame being received
    adopting: OwnedFd | None = None  # the memory of the adopt_allocation being fed
    client: str = ""  # the name a kv_acquire gave (the engine's id)
    death_watch: threading.Event | None = None  # set: stop watching its death word


def record_path(socket_path: Path) -> Path:
    """Where a server keeps its committed layout's record."""
    return socket_path.with_suffix(".layout")


def read_record(path: Path) -> str | None:
    """The layout hash a previous server committed, if its record is sound."""
    try:
        doc = json.loads(path.read_text())
        digest = doc["layout_hash"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log_event(log, "layout_record_unreadable", logging.WARNING, path=path, error=exc)
        return None
    if not isinstance(digest, str) or len(digest) != 64:
        log_event(log, "layout_record_unreadable", logging.WARNING, path=path, error="no hash")
        return None
    return digest


def write_record(path: Path, digest: str | None) -> None:
    """Record ``digest`` (atomically), or remove the record (None)."""
    if digest is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"layout_hash": digest, "written_at": time.time()}))
    os.replace(tmp, path)


class GmsServer:
    """``async with GmsServer(config) as server: await server.wait_closed()``."""

    def __init__(self, config: ServerConfig, backend: ServerBackend | None = None) -> None:
        self.config = config
        self.backend = backend or make_server_backend(
            config.backend, config.device, config.granularity
        )
        info = fsm.ServerInfo(
            device=config.device,
            tag=config.tag,
            backend=self.backend.name,
            granularity=self.backend.granularity,
        )
        self.machine = fsm.Machine(fsm.initial_state(info))
        self._conns: dict[int, _Conn] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._labels = {"device": str(config.device), "tag": config.tag}
        self._monitor, self._no_monitor = _open_monitor(config.device, self.backend)
        self._gpu: m.DeviceReport | None = None
        self._gpu_at = float("-inf")
        self._health_task: asyncio.Task[None] | None = None
        self._record = record_path(config.socket)
        self._recorded: str | None = None
        self._adoption_timer: asyncio.TimerHandle | None = None
        self._update_metrics()

    # --- lifecycle ---------------------------------------------------------

    def _await_orphan(self) -> None:
        """A committed layout recorded by the server before this one: wait for
        its engine to give it back, within the adoption window."""
        digest = read_record(self._record)
        if digest is None:
            return
        deadline = asyncio.get_running_loop().time() + self.config.adopt_window_s
        info = self.machine.state.info
        self.machine = fsm.Machine(fsm.initial_state(info, fsm.Orphan(digest, deadline)))
        self._recorded = digest
        self._arm_adoption(deadline)
        log_event(
            log,
            "orphaned",
            layout=digest[:16],
            window_s=self.config.adopt_window_s,
            device=self.config.device,
        )
        self._update_metrics()

    async def start(self) -> None:
        self._await_orphan()
        self._listener = bind_unix(self.config.socket)
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())
        log_event(
            log,
            "listening",
            socket=self.config.socket,
            device=self.config.device,
            tag=self.config.tag,
            backend=self.backend.name,
            granularity=self.backend.granularity,
            pid=os.getpid(),
        )
        if self._monitor is None:
            log_event(log, "nvml_unavailable", reason=self._no_monitor)
        else:
            log_event(log, "nvml", uuid=self._monitor.uuid, name=self._monitor.name)
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def close(self) -> None:
        if self._adoption_timer is not None:
            self._adoption_timer.cancel()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.config.socket.unlink()
            self._listener = None
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.backend.close()
        if self._monitor is not None:
            self._monitor.close()
        self._closed.set()
        log_event(log, "closed", socket=self.config.socket)

    async def __aenter__(self) -> GmsServer:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # --- connections -------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and friends: log, back off, go on
                log_event(log, "accept_failed", logging.WARNING, error=exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            sid = next(self._ids)
            cred = peer_credentials(sock)
            log_event(
                log,
                "accept",
                sid=sid,
                pid=cred.pid if cred else None,
                uid=cred.uid if cred else None,
                gid=cred.gid if cred else None,
            )
            conn = _Conn(sid, sock)
            self._conns[sid] = conn
            self._feed(fsm.Connected(sid))
            self._spawn(self._writer(conn))
            self._spawn(self._reader(conn))

    async def _reader(self, conn: _Conn) -> None:
        codec = m.request_codec()
        try:
            while not conn.closing:
                try:
                    data, fd = await sock_recv_with_fd(conn.sock, _RECV_SIZE)
                    requests = self._decode(conn, codec, data, fd)
                except (m.RemoteGmsError, RemoteFrameError) as exc:
                    log_event(log, "protocol_error", logging.WARNING, sid=conn.sid, error=exc)
                    self._send(conn, m.ErrorReply(code=m.ErrorCode.PROTOCOL, message=str(exc)))
                    break
                except (ConnectionError, OSError):
                    break
                if not data:
                    break
                for request, owned in requests:
                    self._receive(conn, request, owned)
        finally:
            self._ended(conn)

    def _ended(self, conn: _Conn) -> None:
        """A connection's reader is done (EOF, an error, a dead holder's word):
        what it held goes, and the core hears of it once."""
        for owned in (conn.fd, conn.adopting):
            if owned is not None:
                owned.close()
        if conn.death_watch is not None:
            conn.death_watch.set()
        conn.closing = True
        if self._conns.pop(conn.sid, None) is not None:
            if conn.timer is not None:
                conn.timer.cancel()
            self._feed(fsm.Disconnected(conn.sid))
        conn.outbox.put_nowait(None)

    def _decode(
        self,
        conn: _Conn,
        codec: MessageCodec[m.Request],
        data: bytes,
        fd: OwnedFd | None,
    ) -> list[tuple[m.Request, OwnedFd | None]]:
        """The requests completed by ``data``, each with the fd that came with
        its first byte. An fd rides on a frame's first byte, so it can only
        arrive when no frame is half-read."""
        if fd is not None:
            if codec.buffered or conn.fd is not None:
                fd.close()
                raise m.RemoteGmsError("an fd sent in the middle of a frame")
            conn.fd = fd
        out: list[tuple[m.Request, OwnedFd | None]] = []
        for request in codec.feed(data):
            owned, conn.fd = conn.fd, None
            out.append((request, owned))
        return out

    def _receive(self, conn: _Conn, request: m.Request, owned: OwnedFd | None) -> None:
        """Feed one request; an fd goes with ``adopt_allocation`` only."""
        if not isinstance(request, m.AdoptAllocation):
            if owned is not None:
                owned.close()  # never kept: a server takes no fd it did not ask for
            if isinstance(request, m.KvAcquire | m.KvPeek):
                conn.client = request.client
            self._feed(fsm.Received(conn.sid, request))
            return
        if owned is None:
            message = "adopt_allocation carries the allocation's memory: one fd, none came"
            self._send(conn, m.ErrorReply(code=m.ErrorCode.INVALID, message=message))
            return
        conn.adopting = owned
        try:
            self._feed(fsm.Received(conn.sid, request))
        finally:
            if conn.adopting is not None:  # refused: the core asked nothing of it
                conn.adopting.close()
                conn.adopting = None

    async def _writer(self, conn: _Conn) -> None:
        """Send what the core queued, in order, until the reader's ``None``.

        Only this task closes the socket, and only once the reader has ended: a
        socket closed under the reader's pending ``sock_recv`` never wakes it
        (the kernel drops a closed fd from epoll; asyncio keeps waiting), so
        the session would outlive its client (a writer's lock with it) and the
        fd number would stay dead for the next client given it. A failed send
        only shuts the socket down, which the reader sees as EOF.
        """
        failed = False
        try:
            while (item := await conn.outbox.get()) is not None:
                frame, fd = item
                try:
                    if not failed:
                        await sock_send_frame(conn.sock, frame, fd)
                except OSError as exc:
                    failed = conn.closing = True
                    log_event(log, "send_failed", logging.INFO, sid=conn.sid, error=exc)
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
                finally:
                    if fd is not None:
                        os.close(fd)
        finally:
            # Close fds still queued (the peer went away before they were sent).
            while not conn.outbox.empty():
                left = conn.outbox.get_nowait()
                if left is not None and left[1] is not None:
                    os.close(left[1])
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.sock.close()
            conn.closing = True

    def _send(self, conn: _Conn, message: m.Reply, fd: int | None = None) -> None:
        frame = encode(m.REPLY_ADAPTER.dump_json(message), m.MAX_REPLY_FRAME)
        conn.outbox.put_nowait((frame, fd))

    # --- core --------------------------------------------------------------

    def _feed(self, event: fsm.Event) -> None:
        now = asyncio.get_running_loop().time()
        before = self.machine.state
        sid = None if isinstance(event, fsm.AdoptionOver) else event.sid
        try:
            actions = self.machine.feed(event, now)
        except fsm.Refused as exc:
            assert sid is not None  # only a peer's request is refused
            actions = [fsm.Reply(sid, m.ErrorReply(code=exc.code, message=str(exc)))]
            log_event(log, "refused", sid=sid, code=exc.code.value, reason=exc)
        except fsm.InvalidTransition as exc:  # a bug here: drop that connection
            log_event(log, "invalid_transition", logging.ERROR, sid=sid, error=exc)
            conn = self._conns.get(sid) if sid is not None else None
            if conn is not None:
                conn.closing = True
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            return
        self._execute(actions)
        if self.machine.state is not before:  # reads (export, list, get) change nothing
            self._update_metrics()
            self._keep_record()

    def _keep_record(self) -> None:
        """The record follows the layout that must survive this process: the
        committed one, or the orphan still awaited."""
        st = self.machine.state
        digest = st.layout_hash if st.committed else (st.orphan.layout_hash if st.orphan else None)
        if digest == self._recorded:
            return
        try:
            write_record(self._record, digest)
        except OSError as exc:  # a full volume: the next restart cannot re-adopt
            log_event(log, "layout_record_failed", logging.ERROR, path=self._record, error=exc)
            return
        self._recorded = digest

    def _execute(self, actions: list[fsm.Action]) -> None:
        for action in actions:
            self._do(action)

    def _do(self, action: fsm.Action) -> None:
        match action:
            case fsm.Reply(sid, message):
                self._reply(sid, message)
            case fsm.ArmTimer(sid, deadline):
                self._arm(sid, deadline)
            case fsm.ArmAdoptionTimer(deadline):
                self._arm_adoption(deadline)
            case fsm.Transition():
                self._observe(action)
            case fsm.ReadLock(sid):
                word, why = read_lock_word(self.config.lock_state)
                self._feed(fsm.LockChecked(sid, word, why))
            case _:
                self._do_memory(action)

    def _do_memory(self, action: _MemoryAction) -> None:
        """The actions that touch the backend's memory."""
        match action:
            case fsm.CreateMemory(sid, record):
                self._create(sid, record)
            case fsm.AdoptMemory(sid, record):
                self._adopt(sid, record)
            case fsm.SendExport(sid, record, writable):
                self._send_export(sid, record, writable)
            case fsm.ReleaseMemory(ids):
                self._release(ids)
            case fsm.GrantKv(sid, record, created, previous, writable):
                self._grant_kv(sid, record, created, previous, writable)
            case _:
                assert_never(action)

    def _release(self, ids: tuple[int, ...]) -> None:
        for alloc_id in ids:
            self.backend.release(alloc_id)

    def _reply(self, sid: int, message: m.Reply) -> None:
        conn = self._conns.get(sid)
        if conn is None:
            return
        if isinstance(message, m.StateReport) and self._monitor is not None:
            message = message.model_copy(update={"gpu": self._device_report()})
        self._send(conn, message)

    def _created(self, sid: int, record: AllocationRecord) -> bool:
        """Create the memory the core recorded; a failure goes back to the core."""
        try:
            self.backend.create(record.id, record.size)
        except Exception as exc:
            reason = f"{self.backend.name} could not allocate {record.size}: {exc}"
            self._feed(fsm.CreateFailed(sid, record.id, reason))
            return False
        return True

    def _create(self, sid: int, record: AllocationRecord) -> None:
        if not self._created(sid, record):
            return
        log_event(log, "allocate", logging.DEBUG, sid=sid, id=record.id, size=record.size)
        conn = self._conns.get(sid)
        if conn is not None:
            self._send(conn, m.Allocated(allocation=fsm.allocation_info(record)))

    def _adopt(self, sid: int, record: AllocationRecord) -> None:
        """Take the memory that came with the request as the allocation."""
        conn = self._conns.get(sid)
        owned = conn.adopting if conn is not None else None
        if conn is None or owned is None:
            self._feed(fsm.CreateFailed(sid, record.id, "the allocation's fd is gone"))
            return
        conn.adopting = None
        try:
            self.backend.adopt(record.id, record.size, owned.detach())
        except Exception as exc:
            reason = f"{self.backend.name} could not adopt {record.size} bytes: {exc}"
            self._feed(fsm.CreateFailed(sid, record.id, reason))
            return
        log_event(log, "adopted", logging.DEBUG, sid=sid, id=record.id, size=record.size)
        self._send(conn, m.Allocated(allocation=fsm.allocation_info(record)))

    def _arm_adoption(self, deadline: float) -> None:
        if self._adoption_timer is not None:
            self._adoption_timer.cancel()
        loop = asyncio.get_running_loop()
        self._adoption_timer = loop.call_at(deadline, self._feed, fsm.AdoptionOver())

    def _grant_kv(
        self,
        sid: int,
        record: AllocationRecord,
        created: bool,
        previous: int | None,
        writable: bool,
    ) -> None:
        """Create the KV pool if it is new, then send it with ``kv_granted``:
        writable to the lock's holder, read-only to a reader (``kv_peek``)."""
        if created and not self._created(sid, record):
            return
        conn = self._conns.get(sid)
        if conn is None:
            return  # gone meanwhile: its Disconnected hands the pool on
        try:
            fd = self.backend.export(record.id, writable)
        except Exception as exc:
            self._send(conn, m.ErrorReply(code=m.ErrorCode.NO_MEMORY, message=str(exc)))
            return
        granted = m.KvGranted(
            allocation=fsm.allocation_info(record),
            created=created,
            previous_epoch=previous,
            granularity=self.backend.granularity,
            backend=self.backend.name,
            device=self.config.device,
            writable=writable,
        )
        self._send(conn, granted, fd)
        if writable:
            self._watch_kv_holder(conn)

    def _watch_kv_holder(self, conn: _Conn) -> None:
        """Hand the KV pool on the moment the kernel marks its holder's process
        dead (its death word, ``wire.deathword``, beside its heartbeat in the
        pod's run directory, where the lock record is), not when Linux closes
        the holder's connection after tearing its memory down: a killed vLLM
        engine's took 59 ms more, all of it in the next engine's wake. Host
        memory only, as the lock server's ``--grant-at-death``: a GPU's memory
        is free only once the process is gone."""
        run_dir = self.config.lock_state.parent if self.config.lock_state else None
        if self.backend.name != "host" or run_dir is None or not conn.client:
            return
        loop, stop, sid = asyncio.get_running_loop(), threading.Event(), conn.sid

        def died() -> None:  # on the watch's thread
            loop.call_soon_threadsafe(self._kv_holder_died, sid)

        path = deathword.word_path(heartbeat_path(run_dir, conn.client))
        if deathword.watch(path, died, stop) is not None:
            conn.death_watch = stop

    def _kv_holder_died(self, sid: int) -> None:
        """Its connection ends here, as at its close: the reader sees EOF and
        the core hands the pool on (``Disconnected``)."""
        conn = self._conns.get(sid)
        if conn is None or conn.closing:
            return
        log_event(log, "kv_holder_died", sid=sid, client=conn.client, signal="death_word")
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)

    def _send_export(self, sid: int, record: AllocationRecord, writable: bool) -> None:
        conn = self._conns.get(sid)
        if conn is None:
            return
        try:
            fd = self.backend.export(record.id, writable)
        except Exception as exc:
            self._send(conn, m.ErrorReply(code=m.ErrorCode.NO_MEMORY, message=str(exc)))
            return
        self._send(conn, m.Exported(allocation=fsm.allocation_info(record)), fd)

    def _arm(self, sid: int, deadline: float) -> None:
        conn = self._conns.get(sid)
        if conn is None:
            return
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = asyncio.get_running_loop().call_at(deadline, self._expire, sid)

    def _expire(self, sid: int) -> None:
        if sid in self._conns:
            self._feed(fsm.Expire(sid))

    def _observe(self, t: fsm.Transition) -> None:
        level = logging.DEBUG if t.event in ("connect", "disconnect") else logging.INFO
        log_event(
            log,
            t.event,
            level,
            sid=t.sid,
            mode=t.mode,
            waited_s=None if t.waited_s is None else round(t.waited_s, 6),
            detail=t.detail,
            state=fsm.lock_state(self.machine.state).value,
        )
        metrics.TRANSITIONS.labels(**self._labels, event=t.event).inc()
        if t.event in ("grant", "expire") and t.waited_s is not None:
            outcome = "granted" if t.event == "grant" else "expired"
            metrics.LOCK_WAIT.labels(**self._labels, mode=t.mode or "", outcome=outcome).observe(
                t.waited_s
            )

    # --- the device (NVML) ----------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            self._device_report(max_age=0.0)
            await asyncio.sleep(self.config.health_interval_s)

    def _device_report(self, max_age: float = _REPORT_MAX_AGE_S) -> m.DeviceReport | None:
        """The device now (or at most ``max_age`` ago); logs and counts changes."""
        assert self._monitor is not None
        now = asyncio.get_running_loop().time()
        if self._gpu is not None and now - self._gpu_at <= max_age:
            return self._gpu
        try:
            report, xids = self._monitor.poll()
        except Exception as exc:  # NVML broke under us: report that, keep serving
            log_event(log, "nvml_failed", logging.WARNING, error=exc)
            return self._gpu
        for xid in xids:
            log_event(log, "xid", logging.WARNING, uuid=report.uuid, xid=xid)
            metrics.DEVICE_XIDS.labels(**self._labels, xid=str(xid)).inc()
        before = self._gpu
        if before is None or before.healthy != report.healthy:
            level = logging.INFO if report.healthy else logging.ERROR
            event = "device_healthy" if report.healthy else "device_unhealthy"
            log_event(log, event, level, uuid=report.uuid, reason=report.reason or None)
        self._gpu, self._gpu_at = report, now
        metrics.DEVICE_HEALTHY.labels(**self._labels).set(1 if report.healthy else 0)
        metrics.DEVICE_MEMORY_USED.labels(**self._labels).set(report.memory_used)
        metrics.DEVICE_MEMORY_TOTAL.labels(**self._labels).set(report.memory_total)
        return report

    def _update_metrics(self) -> None:
        st = self.machine.state
        metrics.ALLOCATED_BYTES.labels(**self._labels).set(st.total_bytes)
        metrics.ALLOCATIONS.labels(**self._labels).set(len(st.allocations))
        metrics.SESSIONS.labels(**self._labels, mode="RW").set(st.count(fsm.Phase.RW))
        metrics.SESSIONS.labels(**self._labels, mode="RO").set(st.count(fsm.Phase.RO))
        metrics.WAITING.labels(**self._labels).set(st.count(fsm.Phase.WAITING))
        metrics.WAITING_WRITERS.labels(**self._labels).set(st.waiting_writers)
        metrics.COMMITTED.labels(**self._labels).set(1 if st.committed else 0)
        kv = st.kv
        metrics.KV_POOL_BYTES.labels(**self._labels).set(0 if kv is None else kv.allocation.size)
        holder = 0 if kv is None or kv.holder_epoch is None else kv.holder_epoch
        metrics.KV_POOL_EPOCH.labels(**self._labels).set(holder)
        metrics.KV_POOL_READERS.labels(**self._labels).set(st.count(fsm.Phase.KV_READING))


def _open_monitor(device: int, backend: ServerBackend) -> tuple[DeviceMonitor | None, str]:
    """NVML for this device if there is any; never fatal."""
    try:
        return DeviceMonitor.open(device, getattr(backend, "uuid", None))
    except Exception as exc:
        return None, f"NVML failed: {exc}"


async def run(config: ServerConfig) -> int:
    """Serve until SIGTERM or SIGINT; the CLI's ``server`` command."""
    if config.metrics_port is not None and not metrics.multiprocess_enabled():
        start_metrics_server(config.metrics_port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with GmsServer(config):
        await stop.wait()
    return 0
