"""The GMS client the engine shim uses: synchronous, blocking sockets.

    client = GmsClient.connect(path, Mode.RW_OR_RO, timeout=60.0, on_lost=die)
    if client.granted_mode is Granted.RW:
        a = client.allocate(n)            # mapped read-write at a.address
        a.write(weights)                  # either backend (a.view(): host only)
        client.put_metadata("layer0", {"alloc": a.id, "offset": 0, ...})
        client.commit()                   # layout hash; mappings become read-only
    else:
        client.import_all()               # every allocation mapped read-only
    client.unmap()                        # sleep: memory and session dropped,
                                          # addresses stay reserved
    client.remap(timeout=30.0)            # wake: same addresses, same layout, or
                                          # StaleMemoryLayoutError / GmsTimeoutError

Addresses survive sleep and wake: the client reserves address space per
allocation and maps the backend's memory into it (``backends``), so numpy
arrays or tensors built from ``Allocation.address`` before ``unmap`` read the
same bytes after ``remap``. Between the two, touching them faults.

Read-only is enforced: an RO session's mappings are ``PROT_READ`` (host) or
``CU_MEM_ACCESS_FLAGS_PROT_READ`` (cuda), and so are the writer's after
commit. A write segfaults rather than silently corrupting shared weights.

A lost server connection while mapped is reported once to ``on_lost`` from a
watcher thread. The watcher polls only for hang-up (POLLRDHUP/POLLHUP/
POLLERR), never for readable data, so it cannot steal a reply from a request
in flight on the same socket.

All public methods take one lock: one engine may call them from any thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from understudy.gms import messages as m
from understudy.gms.backends import ClientMapper, make_mapper
from understudy.gms.messages import GmsError, Granted, Mode
from understudy.wire import failpoints
from understudy.wire.framing import RemoteFrameError, encode
from understudy.wire.uds import OwnedFd, recv_frame, send_frame

__all__ = [
    "Allocation",
    "GmsClient",
    "GmsConnectionLost",
    "GmsError",
    "GmsRefused",
    "GmsTimeoutError",
    "StaleMemoryLayoutError",
    "query_state",
]


class GmsTimeoutError(GmsError, TimeoutError):
    """The lock (or a reply, or the server's socket) did not come in time."""


class GmsConnectionLost(GmsError, ConnectionError):
    """The server closed the connection or could not be reached."""


class GmsRefused(GmsError):
    """The server answered a request with an error (``code``)."""

    def __init__(self, code: m.ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


class StaleMemoryLayoutError(GmsError):
    """What is committed now is not what this client mapped before sleeping."""


LostCallback = Callable[[BaseException], None]
# What ``Allocation.write`` copies from (a numpy array's ``.data`` is a memoryview).
Bytes = bytes | bytearray | memoryview
R = TypeVar("R")

_RETRY_CONNECT_S = 0.05
_REPLY_SLACK_S = 2.0
_EXPORT_BATCH = 256  # beyond a hello's own timeout, for the server's answer to arrive


@dataclass(slots=True, eq=False)
class Allocation:
    """One allocation as this client sees it. ``address`` never changes."""

    id: int
    tag: str
    size: int
    requested: int
    address: int
    _client: GmsClient

    def view(self) -> memoryview:
        """The mapped bytes (host backend). Read-only unless this is the writer
        before commit. Invalid (raises) while unmapped."""
        self._client._check_view()
        buf = (ctypes.c_char * self.size).from_address(self.address)
        view = memoryview(buf).cast("B")
        return view if self._client.writable else view.toreadonly()

    def array(self, dtype: Any = "uint8", count: int = -1, offset: int = 0) -> Any:
        """A numpy array over the mapped bytes (host backend)."""
        import numpy as np

        return np.frombuffer(self.view(), dtype=dtype, count=count, offset=offset)

    def write(self, data: Bytes, offset: int = 0) -> None:
        """Copy ``data`` (any C-contiguous buffer) in at ``offset``, on either
        backend: through the mapping (host) or the driver's host-to-device copy
        (cuda). Only the writer, before commit; raises while unmapped."""
        src = memoryview(data).cast("B")
        mapper = self._client._check_mapped()
        if not self._client.writable:
            raise GmsError("allocation is read-only (committed, or an RO session)")
        self._check_span(offset, src.nbytes)
        if src.nbytes:
            mapper.write(self.address + offset, src)

    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of ``nbytes`` at ``offset``, on either backend (host: through
        the mapping; cuda: the driver's device-to-host copy). Raises while
        unmapped, as ``view`` does."""
        mapper = self._client._check_mapped()
        self._check_span(offset, nbytes)
        return mapper.read(self.address + offset, nbytes) if nbytes else b""

    def _check_span(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"{nbytes} bytes at {offset}: outside the {self.size}-byte allocation")


class _Watcher(threading.Thread):
    """Reports a hang-up of ``sock`` to ``on_lost``, once, unless stopped first."""

    def __init__(self, sock: socket.socket, on_lost: LostCallback) -> None:
        super().__init__(name="gms-watcher", daemon=True)
        self._fd = sock.fileno()
        self._on_lost = on_lost
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._stopped = threading.Event()

    def run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self._stopped.is_set():
                events = poller.poll()
                if self._stopped.is_set():
                    return
                for fd, _ in events:
                    if fd == self._fd:
                        self._stopped.set()
                        self._on_lost(GmsConnectionLost("GMS closed the connection"))
                        return
        finally:
            os.close(self._wake_r)

    def stop(self) -> None:
        """Stop without reporting; call before closing the socket."""
        if not self._stopped.is_set():
            self._stopped.set()
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)
        with contextlib.suppress(OSError):
            os.close(self._wake_w)


def _connect_socket(path: Path, deadline: float) -> socket.socket:
    """Connect, retrying while the server is not there yet, until ``deadline``."""
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise GmsTimeoutError(f"cannot reach GMS at {path}: {last or 'timed out'}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(remaining)
        try:
            sock.connect(str(path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            last = exc
        except TimeoutError as exc:
            sock.close()
            raise GmsTimeoutError(f"cannot reach GMS at {path}: {exc}") from None
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EAGAIN:
                raise GmsConnectionLost(f"cannot connect to GMS at {path}: {exc}") from None
            last = exc
        time.sleep(min(_RETRY_CONNECT_S, max(0.0, deadline - time.monotonic())))


class _Channel:
    """One connection: requests, then their replies (and fds), bounded by a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._codec = m.reply_codec()
        self.broken = False

    def request(
        self, msg: m.Request, deadline: float | None, fd: int | None = None
    ) -> tuple[m.Reply, OwnedFd | None]:
        """Send ``msg`` (with ``fd``, for the one request that carries one) and
        receive its reply."""
        self._send([msg], deadline, fd)
        return self._receive(msg, deadline)

    def export_many(
        self, ids: list[int], deadline: float | None
    ) -> list[tuple[m.Reply, OwnedFd | None]]:
        """``export_many`` in batches: one request per batch, one reply and fd per
        id. A wake maps thousands of allocations; this is one round trip per
        batch instead of one per allocation. The batch bounds the fds in flight."""
        out: list[tuple[m.Reply, OwnedFd | None]] = []
        try:
            for start in range(0, len(ids), _EXPORT_BATCH):
                batch = tuple(ids[start : start + _EXPORT_BATCH])
                msg = m.ExportMany(ids=batch)
                self._send([msg], deadline)
                for _ in batch:  # an error (unknown id) comes alone, instead of all
                    out.append(self._receive(msg, deadline))
        except BaseException:
            for _, fd in out:
                if fd is not None:
                    fd.close()
            raise
        return out

    def _timeout(self, deadline: float | None) -> None:
        self.sock.settimeout(None if deadline is None else max(0.001, deadline - time.monotonic()))

    def _io_error(self, msg: m.Request, exc: BaseException) -> GmsError:
        self.broken = True
        if isinstance(exc, TimeoutError):
            return GmsTimeoutError(f"no reply to {msg.type} in time")
        if isinstance(exc, RemoteFrameError):
            return GmsConnectionLost(f"bad frame from GMS: {exc}")
        return GmsConnectionLost(f"GMS connection lost during {msg.type}: {exc}")

    def _send(self, msgs: list[m.Request], deadline: float | None, fd: int | None = None) -> None:
        if self.broken:
            raise GmsConnectionLost("the GMS connection is no longer usable")
        data = b"".join(
            encode(m.REQUEST_ADAPTER.dump_json(msg), m.MAX_REQUEST_FRAME) for msg in msgs
        )
        try:
            self._timeout(deadline)
            send_frame(self.sock, data, fd)
        except OSError as exc:  # TimeoutError included
            raise self._io_error(msgs[0], exc) from None

    def _receive(self, msg: m.Request, deadline: float | None) -> tuple[m.Reply, OwnedFd | None]:
        try:
            self._timeout(deadline)
            body, fd = recv_frame(self.sock, m.MAX_REPLY_FRAME)
        except (RemoteFrameError, OSError) as exc:  # timeout, reset, broken pipe, EOF
            raise self._io_error(msg, exc) from None
        try:
            reply = self._codec.parse(body)
        except m.RemoteGmsError as exc:
            if fd is not None:
                fd.close()
            self.broken = True
            raise GmsConnectionLost(f"bad reply from GMS: {exc}") from None
        if isinstance(reply, m.ErrorReply):
            if fd is not None:
                fd.close()
            if reply.code is m.ErrorCode.TIMEOUT:
                raise GmsTimeoutError(reply.message)
            if reply.code is m.ErrorCode.PROTOCOL:
                self.broken = True
            raise GmsRefused(reply.code, reply.message)
        return reply, fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _expect(reply: m.Reply, kind: type[R], fd: OwnedFd | None = None) -> R:
    if not isinstance(reply, kind):
        if fd is not None:
            fd.close()
        raise GmsConnectionLost(f"unexpected reply {reply.type!r}, wanted {kind.__name__}")
    return reply


class GmsClient:
    """A session with one GMS server (one device). Use ``GmsClient.connect``."""

    def __init__(self, path: Path, on_lost: LostCallback | None = None) -> None:
        self.path = Path(path)
        self.on_lost = on_lost
        self.granted_mode: Granted | None = None
        self.layout_hash: str | None = None
        self.device: int | None = None
        self.backend: str | None = None
        self.granularity: int = 0
        self._allocs: list[Allocation] = []
        self._metadata: dict[str, dict[str, Any]] = {}
        self._mapper: ClientMapper | None = None
        self._chan: _Channel | None = None
        self._watcher: _Watcher | None = None
        self._mapped = False
        self._gone = False  # the server hung up on the session (the watcher saw it)
        self._told = False  # on_lost was called for this session's hang-up
        self._lost_exc: BaseException | None = None
        self._lost_lock = threading.Lock()  # _gone, _mapped and _told, between the watcher and us
        self._health: tuple[bool, str] = (True, "")  # the last device_health answer
        self._lock = threading.RLock()

    # --- session -----------------------------------------------------------

    @classmethod
    def connect(
        cls,
        path: str | os.PathLike[str],
        mode: Mode,
        timeout: float,
        on_lost: LostCallback | None = None,
        *,
        name: str = "",
        epoch: int | None = None,
    ) -> GmsClient:
        """Connect and wait (at most ``timeout`` seconds) for ``mode`` to be granted.
        ``epoch``: the pod lock's epoch this engine holds, if it holds one."""
        client = cls(Path(path), on_lost)
        ok = client._open(Mode(mode), timeout, name, epoch)
        client.layout_hash = ok.layout_hash
        return client

    def _open(
        self, mode: Mode, timeout: float, name: str = "", epoch: int | None = None
    ) -> m.HelloOk:
        if timeout <= 0:
            raise ValueError("timeout must be positive (every wait is bounded)")
        deadline = time.monotonic() + timeout
        sock = _connect_socket(self.path, deadline)
        chan = _Channel(sock)
        remaining = max(0.0, deadline - time.monotonic())
        hello = m.Hello(
            mode=mode, timeout_s=remaining, client=name or f"pid-{os.getpid()}", epoch=epoch
        )
        try:
            reply, fd = chan.request(hello, deadline + _REPLY_SLACK_S)
            ok = _expect(reply, m.HelloOk, fd)
        except BaseException:
            chan.close()
            raise
        if self._mapper is None or self.backend != ok.backend:
            self._mapper = make_mapper(ok.backend, ok.device)
        self._chan = chan
        self._gone = self._told = False
        self.granted_mode = ok.granted
        self.device, self.backend, self.granularity = ok.device, ok.backend, ok.granularity
        if self.on_lost is not None:
            self._watcher = _Watcher(sock, self._lost)
            self._watcher.start()
        return ok

    def _lost(self, exc: BaseException) -> None:
        with self._lost_lock:
            self._gone, self._lost_exc = True, exc
            tell = self._mapped and not self._told
            self._told = self._told or tell
        if tell and self.on_lost is not None:
            self.on_lost(exc)

    def _now_mapped(self) -> None:
        """The session maps memory from here on. A hang-up the watcher saw while
        the mapping was being made (a remap's exports arrived, then the server
        died) is reported now: otherwise the engine would serve from a session
        whose server is gone, and nobody would give its layout back."""
        with self._lost_lock:
            self._mapped = True
            tell = self._gone and not self._told
            self._told = self._told or tell
            exc = self._lost_exc
        if tell and self.on_lost is not None:
            self.on_lost(exc or GmsConnectionLost("GMS closed the connection"))

    def _request(self, msg: m.Request, kind: type[R], deadline: float | None = None) -> R:
        if self._chan is None:
            raise GmsConnectionLost("not connected (unmapped or closed)")
        reply, fd = self._chan.request(msg, deadline)
        return _expect(reply, kind, fd)

    def _export(
        self, alloc_id: int, deadline: float | None = None
    ) -> tuple[m.AllocationInfo, OwnedFd]:
        if self._chan is None:
            raise GmsConnectionLost("not connected (unmapped or closed)")
        reply, fd = self._chan.request(m.Export(id=alloc_id), deadline)
        exported = _expect(reply, m.Exported, fd)
        if fd is None:
            raise GmsConnectionLost(f"export of {alloc_id} came without an fd")
        return exported.allocation, fd

    def _export_all(self, ids: list[int], deadline: float | None) -> list[OwnedFd]:
        if self._chan is None:
            raise GmsConnectionLost("not connected (unmapped or closed)")
        replies = self._chan.export_many(ids, deadline)
        fds: list[OwnedFd] = []
        try:
            for (reply, fd), want in zip(replies, ids, strict=True):
                exported = _expect(reply, m.Exported, fd)
                if fd is None or exported.allocation.id != want:
                    raise GmsConnectionLost(f"export of {want} came back wrong")
                fds.append(fd)
        except BaseException:
            for _, fd in replies:
                if fd is not None:
                    fd.close()
            raise
        return fds

    def _drop_session(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    @property
    def writable(self) -> bool:
        return self.granted_mode is Granted.RW

    @property
    def mapped(self) -> bool:
        return self._mapped

    @property
    def connected(self) -> bool:
        """A session the server has not hung up on."""
        return self._chan is not None and not self._gone

    @property
    def allocations(self) -> list[Allocation]:
        return list(self._allocs)

    def _check_mapped(self) -> ClientMapper:
        """The mapper, while the allocations are mapped (else ``GmsError``)."""
        if not self._mapped or self._mapper is None:
            raise GmsError("allocation is not mapped (sleeping or closed)")
        return self._mapper

    def _check_view(self) -> None:
        self._check_mapped()
        if self.backend != "host":
            raise GmsError(f"{self.backend} memory has no host view; use .address")

    # --- writer ------------------------------------------------------------

    def allocate(self, size: int, tag: str = "weights") -> Allocation:
        """Allocate ``size`` bytes (RW session) and map them read-write."""
        with self._lock:
            if self.granted_mode is not Granted.RW:
                raise GmsRefused(m.ErrorCode.REFUSED, "allocate needs an RW session")
            got = self._request(m.Allocate(size=size, tag=tag), m.Allocated).allocation
            info, fd = self._export(got.id)
            assert self._mapper is not None
            with fd:
                address = self._mapper.reserve(info.size, self.granularity)
                try:
                    self._mapper.map(fd.fd, address, info.size, writable=True)
                except BaseException:
                    self._mapper.free(address, info.size)
                    raise
            alloc = Allocation(info.id, info.tag, info.size, info.requested, address, self)
            self._allocs.append(alloc)
            self._now_mapped()
            return alloc

    def put_metadata(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            if self.granted_mode is not Granted.RW:
                raise GmsRefused(m.ErrorCode.REFUSED, "put_metadata needs an RW session")
            self._request(m.PutMetadata(key=key, value=value), m.Ok)
            self._metadata[key] = dict(value)

    def commit(self) -> str:
        """Commit the layout; returns its hash. The session continues as RO and
        every mapping becomes read-only."""
        with self._lock:
            if self.granted_mode is not Granted.RW:
                raise GmsRefused(m.ErrorCode.REFUSED, "commit needs an RW session")
            digest = self._request(m.Commit(), m.Committed).layout_hash
            assert self._mapper is not None
            for a in self._allocs:
                self._mapper.protect_readonly(a.address, a.size)
            self.granted_mode = Granted.RO
            self.layout_hash = digest
            return digest

    # --- reader ------------------------------------------------------------

    def metadata(self) -> dict[str, dict[str, Any]]:
        """All metadata records (fetched when connected, else the last copy)."""
        with self._lock:
            if self._chan is not None and self.granted_mode is not None:
                items = self._request(m.ListMetadata(), m.MetadataList).items
                self._metadata = {k: dict(v) for k, v in items.items()}
            return dict(self._metadata)

    def get_metadata(self, key: str) -> dict[str, Any]:
        with self._lock:
            return dict(self._request(m.GetMetadata(key=key), m.MetadataValue).value)

    def import_all(self) -> list[Allocation]:
        """RO: map every allocation read-only and read the metadata."""
        with self._lock:
            if self.granted_mode is not Granted.RO:
                raise GmsRefused(m.ErrorCode.REFUSED, "import_all needs an RO session")
            if self._allocs:
                raise GmsError("allocations are already mapped")
            infos = self._request(m.ListAllocations(), m.Allocations).allocations
            assert self._mapper is not None
            try:
                for info in infos:
                    address = self._mapper.reserve(info.size, self.granularity)
                    alloc = Allocation(info.id, info.tag, info.size, info.requested, address, self)
                    self._allocs.append(alloc)
                self._now_mapped()
                fds = self._export_all([info.id for info in infos], None)
                for alloc, fd in zip(self._allocs, fds, strict=True):
                    with fd:
                        self._mapper.map(fd.fd, alloc.address, alloc.size, writable=False)
            except BaseException:
                self._release_all()
                raise
            self._now_mapped()
            self.metadata()
            return list(self._allocs)

    def state(self) -> m.StateReport:
        with self._lock:
            return self._request(m.GetState(), m.StateReport)

    def device_health(self) -> tuple[bool, str]:
        """(healthy, reason) of the GPU behind this session, as GMS sees it
        through NVML: an engine's health reason. Healthy with no reason where
        GMS has no NVML (no driver, the host backend on a CPU machine).

        Never waits: it is asked from the engine's event loop (its /health and
        probes), which must keep beating. While the session is busy (a
        re-adoption holds it) or gone, the last answer stands."""
        if not self._lock.acquire(blocking=False):
            return self._health
        try:
            if not self.connected:
                return self._health
            gpu = self.state().gpu
        finally:
            self._lock.release()
        if gpu is None or gpu.healthy:
            self._health = (True, "")
        else:
            self._health = (False, f"device {self.device} ({gpu.uuid}): {gpu.reason}")
        return self._health

    # --- sleep and wake ----------------------------------------------------

    def unmap(self) -> None:
        """Sleep: drop the session and every mapping the backend does not keep
        asleep (``mapper.park``: a GPU's, not host memory's); keep the
        address reservations, the allocation records and the layout hash."""
        with self._lock:
            if self.granted_mode is Granted.RW:
                raise GmsError("commit before unmap: an uncommitted layout cannot be remapped")
            assert self._mapper is not None or not self._allocs
            self._mapped = False
            self._drop_session()
            for a in self._allocs:
                assert self._mapper is not None
                self._mapper.park(a.address, a.size)
            self.granted_mode = None

    def remap(self, timeout: float, epoch: int | None = None) -> None:
        """Wake: reconnect RO within ``timeout`` and map the same layout at the
        same addresses, presenting the lock ``epoch`` the engine now holds.
        ``GmsTimeoutError`` if it cannot be granted in time,
        ``StaleMemoryLayoutError`` if the committed layout is not the one mapped
        before, ``GmsConnectionLost`` if the server goes away meanwhile."""
        with self._lock:
            if self._mapped or self._chan is not None:
                raise GmsError("remap needs an unmapped client (call unmap first)")
            if self.layout_hash is None:
                raise GmsError("nothing to remap: no committed layout was mapped")
            deadline = time.monotonic() + timeout
            ok = self._open(Mode.RO, timeout, epoch=epoch)
            try:
                if ok.layout_hash != self.layout_hash:
                    raise StaleMemoryLayoutError(
                        f"committed layout {str(ok.layout_hash)[:16]} is not the mapped "
                        f"{self.layout_hash[:16]}"
                    )
                infos = self._request(
                    m.ListAllocations(), m.Allocations, deadline + _REPLY_SLACK_S
                ).allocations
                self._check_same(infos)
                assert self._mapper is not None
                fds = self._export_all([i.id for i in infos], deadline + _REPLY_SLACK_S)
                mapped: list[Allocation] = []
                try:
                    for a, info, fd in zip(self._allocs, infos, fds, strict=True):
                        with fd:
                            self._mapper.map(fd.fd, a.address, a.size, writable=False)
                        mapped.append(a)
                        a.id = info.id
                except BaseException:
                    for fd in fds:
                        fd.close()
                    for a in mapped:
                        self._mapper.unmap(a.address, a.size)
                    raise
                failpoints.hit("gms.remap.mapped")
                self._now_mapped()
            except BaseException:
                self._drop_session()
                self.granted_mode = None
                raise

    def readopt(self, timeout: float, epoch: int | None = None) -> str:
        """GMS restarted under this mapped session: give the layout back.

        Connect to the new server (retrying until it listens, within
        ``timeout``) with mode ADOPT and this layout's hash, then re-send every
        allocation in its order, each with its memory (``mapper.export``: the
        memfd kept, or the VMM handle exported again), the metadata, and
        commit: the server commits the same layout hash, so a sleeping engine
        remaps it unchanged. If the server has that layout committed already,
        it re-attaches this session instead. The mappings never move. Returns
        ``"adopted"`` or ``"reattached"``; raises ``GmsRefused``
        (``stale_layout``) when the server holds or awaits another layout."""
        with self._lock:
            if not self._mapped or self.layout_hash is None or self._mapper is None:
                raise GmsError("nothing to give back: no committed layout is mapped")
            self._drop_session()
            deadline = time.monotonic() + timeout
            while True:
                chan = _Channel(_connect_socket(self.path, deadline))
                try:
                    how = self._give_back(chan, deadline, epoch)
                    break
                except GmsConnectionLost:
                    # The dying server's socket, still there for a moment (it
                    # closes on its way out): try again until the new one answers.
                    chan.close()
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(_RETRY_CONNECT_S)
                except BaseException:
                    chan.close()
                    raise
            self._chan = chan
            self._gone = self._told = False
            self.granted_mode = Granted.RO
            if self.on_lost is not None:
                self._watcher = _Watcher(chan.sock, self._lost)
                self._watcher.start()
            return how

    def _give_back(self, chan: _Channel, deadline: float, epoch: int | None) -> str:
        assert self._mapper is not None and self.layout_hash is not None
        until = deadline + _REPLY_SLACK_S
        hello = m.Hello(
            mode=Mode.ADOPT,
            timeout_s=max(0.0, deadline - time.monotonic()),
            client=f"pid-{os.getpid()}",
            epoch=epoch,
            layout_hash=self.layout_hash,
        )
        reply, fd = chan.request(hello, until)
        ok = _expect(reply, m.HelloOk, fd)
        if (ok.backend, ok.device) != (self.backend, self.device):
            raise GmsError(f"GMS came back as {ok.backend} device {ok.device}")
        if ok.granted is Granted.RO:  # the layout is here already: ids may differ
            infos = _expect(chan.request(m.ListAllocations(), until)[0], m.Allocations).allocations
            self._check_same(infos)
            for a, info in zip(self._allocs, infos, strict=True):
                a.id = info.id
            return "reattached"
        for a in self._allocs:
            memory = self._mapper.export(a.address)
            adopt = m.AdoptAllocation(size=a.requested, tag=a.tag)
            try:
                reply, fd = chan.request(adopt, until, memory)
            finally:
                os.close(memory)
            a.id = _expect(reply, m.Allocated, fd).allocation.id
        for key, value in self._metadata.items():
            _expect(chan.request(m.PutMetadata(key=key, value=value), until)[0], m.Ok)
        digest = _expect(chan.request(m.Commit(), until)[0], m.Committed).layout_hash
        if digest != self.layout_hash:  # the server checks it too; never seen
            raise StaleMemoryLayoutError(f"re-committed {digest[:16]}, not {self.layout_hash[:16]}")
        return "adopted"

    def _check_same(self, infos: tuple[m.AllocationInfo, ...]) -> None:
        if len(infos) != len(self._allocs):
            raise StaleMemoryLayoutError(
                f"{len(infos)} allocations committed, {len(self._allocs)} were mapped"
            )
        for a, info in zip(self._allocs, infos, strict=True):
            if (info.size, info.tag) != (a.size, a.tag):
                raise StaleMemoryLayoutError(
                    f"allocation {a.id} was {a.size} bytes tag {a.tag}, "
                    f"now {info.size} bytes tag {info.tag}"
                )

    # --- teardown ----------------------------------------------------------

    def _release_all(self) -> None:
        mapper = self._mapper
        for a in self._allocs:
            if mapper is not None:
                with contextlib.suppress(Exception):
                    if self._mapped:
                        mapper.unmap(a.address, a.size)
                    mapper.free(a.address, a.size)
        self._allocs.clear()
        self._mapped = False

    def close(self) -> None:
        """End the session (a writer that has not committed aborts) and give
        the memory and the address space back."""
        with self._lock:
            was_mapped, self._mapped = self._mapped, False
            self._drop_session()
            self._mapped = was_mapped
            self._release_all()
            self.granted_mode = None

    def __enter__(self) -> GmsClient:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def query_state(path: str | os.PathLike[str], timeout: float) -> m.StateReport:
    """One ``get_state`` without a session (``understudy gms status``, probes)."""
    deadline = time.monotonic() + timeout
    sock = _connect_socket(Path(path), deadline)
    chan = _Channel(sock)
    try:
        reply, fd = chan.request(m.GetState(), deadline)
        return _expect(reply, m.StateReport, fd)
    finally:
        chan.close()
