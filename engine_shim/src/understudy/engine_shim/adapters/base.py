"""The Engine Protocol: what an engine must do for the shim.

The shim owns the GMS sessions (one per device), the lock and the state
machine; an engine only moves weights and serves:

- ``load(device, session)``: as the writer, allocate GMS memory, write the
  weights, describe them in metadata (the shim commits);
- ``attach(sessions)``: build the model over the mapped weights — the same
  call for the writer and for readers that imported them;
- ``sleep()``: drop working memory (KV cache); the shim then puts the weights
  to sleep (GMS: a GPU's mapping dropped, host memory's kept read-only);
- ``wake()``: the shim has the weights mapped again at the same addresses;
  allocate working memory again and get ready to serve;
- ``routes()``: the serving endpoint's handlers (bound only when Active);
- ``health()``: whether the serving side works.

Working memory is allocated by the engine itself, never through GMS (GPU
memory cannot be force-freed while a process holds a handle to it), so the
process's death frees it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aiohttp import web

from understudy.engine_shim.kvlog import Index, PoolSpec
from understudy.gms.client import GmsClient


class Engine(Protocol):
    name: str

    def load(self, device: int, session: GmsClient) -> None: ...

    def attach(self, sessions: Mapping[int, GmsClient]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def routes(self) -> list[web.RouteDef]: ...

    def health(self) -> tuple[bool, str]: ...

    def close(self) -> None: ...


@runtime_checkable
class FailsFast(Protocol):
    """An engine that can die on its own (an engine core inside the process):
    it reports that through ``on_fatal`` and the shim ends the process."""

    def set_on_fatal(self, on_fatal: Callable[[str], None]) -> None: ...


@dataclass(frozen=True, slots=True)
class KvPoolRequest:
    """The KV pool an engine wants from GMS: its size and what it holds (an
    engine with another ``spec`` gets a fresh pool, never this one's bytes)."""

    layout: PoolSpec

    @property
    def size(self) -> int:
        return self.layout.pool_bytes

    @property
    def spec(self) -> str:
        return self.layout.digest().hex()

    @classmethod
    def of(cls, spec: PoolSpec | None) -> KvPoolRequest | None:
        """The request for a pool laid out by ``spec`` (None: no pool)."""
        return None if spec is None else cls(spec)


@runtime_checkable
class UsesKvPool(Protocol):
    """An engine whose KV cache lives in GMS's KV pool (docs/kv-pool.md).

    When the engine wakes as the lock's holder, the shim asks GMS for the pool
    under the lock's epoch, maps it read-write, hands it over with
    ``attach_kv_pool`` and then calls ``wake``: the engine adopts what the
    previous holder sealed in it. A standby never writes to the pool; it may
    map it read-only while it sleeps (``KvSession.peek``), and then gets that
    view as ``reader``, for its reads. The read-write mapping ends with the
    process, which is what hands the pool on.
    """

    def kv_pool_request(self) -> KvPoolRequest | None:
        """None: this engine keeps its cache to itself (the pool is off)."""
        ...

    def attach_kv_pool(
        self, memory: memoryview, epoch: int, reader: memoryview | None = None
    ) -> None: ...


@runtime_checkable
class FollowsKvPool(Protocol):
    """A `UsesKvPool` engine that works ahead of a kill while it sleeps: after
    each pass of the shim's read-only view of the pool (`kvreader`) that
    read a record, it is told the view and what the log says now (the view
    stays mapped through the call, on the reader's thread)."""

    def follow_kv_pool(self, view: memoryview, index: Index) -> None: ...


class AdapterError(RuntimeError):
    """The engine cannot do what it was asked (bad model, bad weights)."""
