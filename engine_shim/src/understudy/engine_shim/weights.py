"""The engine's GMS sessions, one per device (a shell around ``gms.client``).

Roles decide modes: the primary asks RW_OR_RO on every device (RW where
nothing is committed yet, RO where it is), a shadow only RO. With more than one
device, two engines that both asked RW_OR_RO could each win the writer on a
different device and wait for the other's commit for ever; with one writer
role that cannot happen. Devices are connected in index order, all of them
before any loading starts, as vLLM's workers do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from understudy.engine_shim.adapters.base import Engine, FollowsKvPool, UsesKvPool
from understudy.engine_shim.config import EngineConfig
from understudy.engine_shim.kvreader import KvReader
from understudy.gms.client import (
    GmsClient,
    GmsConnectionLost,
    GmsError,
    GmsTimeoutError,
    query_state,
)
from understudy.gms.kvclient import KvSession
from understudy.gms.messages import Granted, LockState, Mode
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.engine_shim.weights")


class WakeError(RuntimeError):
    """The weights could not be remapped: the engine must exit and re-initialise."""


class Weights:
    def __init__(self, cfg: EngineConfig, on_lost: Callable[[str], None]) -> None:
        self.cfg = cfg
        self._on_lost = on_lost
        self.sessions: dict[int, GmsClient] = {}
        self.loaded: list[int] = []  # devices this engine wrote
        self.imported: list[int] = []  # devices it imported read-only
        self.kv: KvSession | None = None  # the KV pool, while this engine holds the lock
        self.kv_reader: KvReader | None = None  # following the pool read-only, while asleep
        self.kv_view: KvSession | None = None  # what it mapped, read through once awake

    def _lost(self, device: int) -> Callable[[BaseException], None]:
        def report(exc: BaseException) -> None:
            self._on_lost(f"GMS connection for device {device} lost: {exc}")

        return report

    def init(self, engine: Engine, deadline: float) -> None:
        mode = Mode.RW_OR_RO if self.cfg.role == "primary" else Mode.RO
        for device in self.cfg.devices:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("startup budget spent waiting for GMS")
            t0 = time.monotonic()
            session = GmsClient.connect(
                self.cfg.gms_socket(device),
                mode,
                timeout=remaining,
                on_lost=self._lost(device),
                name=self.cfg.engine_id,
            )
            self.sessions[device] = session
            log_event(
                log,
                "gms_session",
                device=device,
                asked=mode.value,
                granted=session.granted_mode,
                waited_s=round(time.monotonic() - t0, 3),
            )
        for device, session in self.sessions.items():
            t0 = time.monotonic()
            if session.granted_mode is Granted.RW:
                engine.load(device, session)
                digest = session.commit()
                self.loaded.append(device)
                log_event(
                    log,
                    "weights_loaded",
                    device=device,
                    layout=digest[:16],
                    seconds=round(time.monotonic() - t0, 3),
                )
            else:
                session.import_all()
                self.imported.append(device)
                log_event(
                    log,
                    "weights_imported",
                    device=device,
                    layout=(session.layout_hash or "")[:16],
                    seconds=round(time.monotonic() - t0, 3),
                )
        engine.attach(self.sessions)

    def sleep(self) -> None:
        for session in self.sessions.values():
            session.unmap()

    def wake(self, timeout: float, epoch: int | None = None) -> None:
        """Remap every device within ``timeout`` or raise WakeError; ``epoch`` is
        the lock's, which GMS keeps as the newest (a stale writer is refused)."""
        deadline = time.monotonic() + timeout
        for device, session in self.sessions.items():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WakeError(f"remap timeout of {timeout:g}s spent before device {device}")
            self._fail_fast(device, min(remaining, 2.0))
            try:
                session.remap(remaining, epoch)
            except GmsError as exc:
                raise WakeError(
                    f"remap of device {device} failed: {type(exc).__name__}: {exc}"
                ) from exc

    def readopt(self, timeout: float, epoch: int | None) -> list[str]:
        """GMS restarted under this engine (Active, or waking): give every lost
        session's allocations back to it (``GmsClient.readopt``) within
        ``timeout``. Returns what each device's GMS did: adopted, or reattached."""
        deadline = time.monotonic() + timeout
        done = []
        for device, session in self.sessions.items():
            if session.connected or not session.mapped:
                # This device's GMS did not die; or, in a wake, its remap has
                # not mapped yet (the wake's own remap meets the new GMS).
                continue

            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"re-adoption timeout of {timeout:g}s spent before {device}")
            how = session.readopt(remaining, epoch)
            done.append(f"{device}:{how}")
            log_event(log, "gms_readopted", device=device, how=how, layout=session.layout_hash)
        return done

    def follow_kv(self, engine: Engine) -> None:
        """Map the KV pool read-only while this engine sleeps (``KvReader``),
        for an engine that keeps its cache there."""
        want = engine.kv_pool_request() if isinstance(engine, UsesKvPool) else None
        if want is None:
            return
        path = self.cfg.gms_socket(min(self.cfg.devices))
        on_pass = engine.follow_kv_pool if isinstance(engine, FollowsKvPool) else None
        self.kv_reader = KvReader(path, want.layout, self.cfg.engine_id, on_pass=on_pass)
        self.kv_reader.start()

    def _take_view(self, session: KvSession | None) -> memoryview | None:
        """Stop following the pool; the view to read ``session``'s pool through."""
        reader, self.kv_reader = self.kv_reader, None
        if reader is None:
            return None
        if session is None:
            reader.close()
            return None
        self.kv_view = reader.take(session.allocation_id)
        return None if self.kv_view is None else self.kv_view.view()

    def acquire_kv(self, engine: Engine, timeout: float, epoch: int | None) -> None:
        """Map the KV pool for an engine that keeps its cache there, as the lock's
        holder under ``epoch``, and hand it over (docs/kv-pool.md).

        GMS refusing this epoch means the lock has moved on: that is fatal
        (WakeError). A pool still mapped by the previous holder past
        ``timeout`` is not, nor a GMS that died in this wake (its pool died
        with it; the weights go back to the next GMS meanwhile, `readopt`):
        the engine then keeps a cache of its own, as without a pool, and
        recomputes what a continuation needs.
        """
        if not isinstance(engine, UsesKvPool) or epoch is None:
            return
        want = engine.kv_pool_request()
        if want is None:
            return
        device = min(self.cfg.devices)
        t0 = time.monotonic()
        try:
            session = KvSession.acquire(
                self.cfg.gms_socket(device),
                epoch=epoch,
                size=want.size,
                spec=want.spec,
                timeout=timeout,
                name=self.cfg.engine_id,
                on_lost=self._lost(device),
            )
        except (GmsTimeoutError, GmsConnectionLost) as exc:
            self._take_view(None)
            log_event(log, "kv_pool_unavailable", logging.WARNING, epoch=epoch, reason=exc)
            return
        except GmsError as exc:
            self._take_view(None)
            raise WakeError(f"KV pool refused: {type(exc).__name__}: {exc}") from exc
        self.kv = session
        view = self._take_view(session)
        engine.attach_kv_pool(session.view(), epoch, view)
        log_event(
            log,
            "kv_pool",
            device=device,
            epoch=epoch,
            bytes=session.size,
            created=session.created,
            previous_epoch=session.previous_epoch,
            premapped=view is not None,
            seconds=round(time.monotonic() - t0, 4),
        )

    def _fail_fast(self, device: int, timeout: float) -> None:
        """A GMS that restarted while we slept has nothing committed and, with
        nobody loading, never will: say so now instead of after the whole
        remap timeout. With a writer at work, wait for it in remap."""
        try:
            state = query_state(self.cfg.gms_socket(device), timeout)
        except GmsError as exc:
            raise WakeError(f"GMS for device {device} unreachable: {exc}") from exc
        if (
            not state.committed
            and state.sessions.get(Granted.RW, 0) == 0
            and state.state is not LockState.ORPHANED  # an Active engine gives it back
        ):
            raise WakeError(
                f"GMS for device {device} has no committed weights and no writer: "
                "it restarted while this engine slept"
            )

    def close(self) -> None:
        self._take_view(None)
        for kv in (self.kv, self.kv_view):
            if kv is not None:
                kv.close()
        self.kv = self.kv_view = None
        for session in self.sessions.values():
            session.close()
