"""The engine's side of the KV pool: ``KvSession.acquire`` maps it read-write,
``KvSession.peek`` read-only.

    kv = KvSession.acquire(path, epoch=7, size=n, spec=digest, timeout=10.0,
                           name=engine_id, on_lost=die)
    kv.view()        # the pool's bytes (host backend); kv.address on a GPU
    kv.created       # True: fresh zeroes; False: as the last holder left it
    kv.close()       # unmap and end the session: the pool passes on

A connection of its own, separate from the weights' session: the pool is
held while it is open and passes to the next lock holder when it closes, which
is when this process dies. Only the pod lock's holder, under the epoch it was
granted, is given the pool (``GmsRefused`` with ``stale_epoch`` otherwise); a
newer holder that asks while an older one still maps it waits for that one's
end, up to ``timeout`` (``GmsTimeoutError``).

``peek`` maps the pool as it is, read-only, for any process: a standby holds
that view while it sleeps and has the kernel map the pages that hold
sequences (engine_shim.kvreader), so that after its promotion its reads of
the dead engine's positions take no page faults
(docs/kv-pool.md#a-standbys-read-only-view).
``GmsRefused`` with ``not_found`` while no pool of that geometry exists.
"""

from __future__ import annotations

import ctypes
import os
import select
import time
from pathlib import Path

from understudy.gms import messages as m
from understudy.gms.backends import ClientMapper, make_mapper
from understudy.gms.client import (
    _REPLY_SLACK_S,
    GmsConnectionLost,
    GmsError,
    LostCallback,
    _Channel,
    _connect_socket,
    _expect,
    _Watcher,
)

__all__ = ["KvSession"]


class KvSession:
    """The KV pool, mapped read-write for as long as this session lasts."""

    def __init__(
        self, chan: _Channel, granted: m.KvGranted, mapper: ClientMapper, address: int
    ) -> None:
        self._chan: _Channel | None = chan
        self._mapper = mapper
        self.address = address
        self.size = granted.allocation.size
        self.requested = granted.allocation.requested
        self.created = granted.created
        self.previous_epoch = granted.previous_epoch
        self.backend = granted.backend
        self.device = granted.device
        self.writable = granted.writable
        self.allocation_id = granted.allocation.id
        self._watcher: _Watcher | None = None
        self._mapped = True

    @classmethod
    def acquire(
        cls,
        path: str | os.PathLike[str],
        *,
        epoch: int,
        size: int,
        spec: str,
        timeout: float,
        name: str = "",
        on_lost: LostCallback | None = None,
    ) -> KvSession:
        if timeout <= 0:
            raise ValueError("timeout must be positive (every wait is bounded)")
        deadline = time.monotonic() + timeout
        request = m.KvAcquire(
            epoch=epoch,
            size=size,
            spec=spec,
            timeout_s=timeout,
            client=name or f"pid-{os.getpid()}",
        )
        return cls._open(path, request, deadline, on_lost)

    @classmethod
    def peek(
        cls, path: str | os.PathLike[str], *, size: int, spec: str, timeout: float, name: str = ""
    ) -> KvSession:
        """The pool as it is, mapped read-only (no page present yet); the
        session lasts until ``close`` (or GMS's end: see ``alive``)."""
        if timeout <= 0:
            raise ValueError("timeout must be positive (every wait is bounded)")
        deadline = time.monotonic() + timeout
        request = m.KvPeek(size=size, spec=spec, client=name or f"pid-{os.getpid()}")
        return cls._open(path, request, deadline, None)

    @classmethod
    def _open(
        cls,
        path: str | os.PathLike[str],
        request: m.KvAcquire | m.KvPeek,
        deadline: float,
        on_lost: LostCallback | None,
    ) -> KvSession:
        chan = _Channel(_connect_socket(Path(path), deadline))
        try:
            reply, fd = chan.request(request, deadline + _REPLY_SLACK_S)
            granted = _expect(reply, m.KvGranted, fd)
            if fd is None:
                raise GmsConnectionLost("the KV pool came without an fd")
            mapper = make_mapper(granted.backend, granted.device)
            with fd:
                address = mapper.reserve(granted.allocation.size, granted.granularity)
                try:
                    # A view's pages are not made present here: a read of a
                    # pool's hole would allocate it (KvReader maps what is held).
                    mapper.map(
                        fd.fd, address, granted.allocation.size, granted.writable, populate=False
                    )
                except BaseException:
                    mapper.free(address, granted.allocation.size)
                    raise
        except BaseException:
            chan.close()
            raise
        session = cls(chan, granted, mapper, address)
        if on_lost is not None:
            session._watcher = _Watcher(chan.sock, on_lost)
            session._watcher.start()
        return session

    @property
    def mapped(self) -> bool:
        return self._mapped

    def view(self) -> memoryview:
        """The pool's bytes (host backend only); read-only for a ``peek``'s
        session, whose pages a write would fault on (SIGSEGV)."""
        if not self._mapped:
            raise GmsError("the KV pool is not mapped (closed)")
        if self.backend != "host":
            raise GmsError(f"{self.backend} memory has no host view; use .address")
        buf = (ctypes.c_char * self.size).from_address(self.address)
        view = memoryview(buf).cast("B")
        return view if self.writable else view.toreadonly()

    def alive(self) -> bool:
        """Whether the session's GMS still has it open: a GMS that restarted
        may have made another pool since, which this mapping is not."""
        if self._chan is None:
            return False
        poller = select.poll()
        poller.register(self._chan.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return not poller.poll(0)

    def close(self) -> None:
        """Unmap, then end the session: the pool passes on as this process left it."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._mapped:
            self._mapped = False
            self._mapper.unmap(self.address, self.size)
            self._mapper.free(self.address, self.size)
        if self._chan is not None:
            self._chan.close()
            self._chan = None
