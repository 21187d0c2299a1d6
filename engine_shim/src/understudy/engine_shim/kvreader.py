"""A standby's read-only view of the KV pool (docs/kv-pool.md#a-standbys-read-only-view).

At a failover the new Active reads what the dead engine left in the pool: the
claim's checksums, then the first step's attention (or vLLM's copy). Through
a mapping made at the wake, each first touch of a page is a fault: at 4,000
positions of SmolLM2, 184 MB of them, with the kernel's thread that maps
them ahead (``memadvise.warm``) beside the step on a CPU it needs.

So a sleeping engine maps the pool read-only as it is (``KvSession.peek``:
any process may; the kernel keeps it from writing) and keeps that mapping.
After its promotion it reads through it and writes through the read-write
mapping it is granted as the lock's holder: the same pages at two addresses.

Which pages it has the kernel map: those of the sealed positions, read from
the pool's seal log, each slot's from where it last stopped (a pool's page,
once the writer made it, stays the pool's). Not the whole pool: a read of a
shared-memory hole allocates it, and a pool is sized for every slot's whole
context (2.9 GB for the local drill's), of which the sequences in flight
hold little.

How soon: a prompt's positions are sealed at the end of its prefill, and a
death may come at the next step. Read once a second, a prompt of 4,000
positions sealed about 0.5 s before a kill was not in the view in 2 of 3
failovers traced on 2026-12-06: that first step took 1,800 faults, 6-7.5
ms (docs/performance.md). A whole reading of the log each time would cost
more the more often (2.4 ms for a ring of 2,112 records with 1,024 blocks
sealed). So after one whole reading at the view's making, a pass ten times
a second reads only the records appended since (`kvlog.read_from`: 5 µs
with nothing new, 3-4 µs a record). A reader that the ring has wrapped
past, or whose log was begun again, reads it whole again. What a record
says is only which pages to map, never trusted: its slot, block and count
are checked against the pool's shape before any address is made.

The view follows the pool: until there is one (the first Active makes it),
and again if GMS restarts (its pool is then another), it asks once a second;
a view that is not of the pool granted at the wake is dropped there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from understudy.engine_shim import kvadopt, kvlog, kvpool, memadvise
from understudy.engine_shim.kvlog import RECORD_SIZE, PoolSpec
from understudy.gms.client import GmsError, GmsRefused
from understudy.gms.kvclient import KvSession
from understudy.gms.messages import ErrorCode
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.engine_shim.kvreader")

EVERY_S = 1.0  # between asks while there is no pool
FOLLOW_S = 0.1  # between passes over the view
_EVERY_EPOCH = 1 << 62  # a view reads every record: none is from a newer epoch than this


class KvReader:
    """Follows the pool at ``path`` (laid out by ``spec``) on a thread of its
    own from ``start`` until ``take`` or ``close``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        spec: PoolSpec,
        name: str,
        every_s: float = EVERY_S,
        follow_s: float = FOLLOW_S,
        on_pass: Callable[[memoryview, kvlog.Index], None] | None = None,
    ) -> None:
        self._path, self._spec, self._name = path, spec, name
        self._every_s, self._follow_s = every_s, follow_s
        # Told the view and the log's index after each pass that read a record,
        # with the view mapped throughout (the engine's copies ahead of a kill).
        self._on_pass = on_pass
        self._mapped: dict[int, int] = {}  # slot -> positions whose pages the view has
        self._next_gen = 0  # of the log's next record to read; 0: read it whole
        self._index = kvlog.Index(spec)  # what the records read so far describe
        self._lock = threading.Lock()
        # Held through a pass over the view: a view is unmapped only between
        # passes (a read of an unmapped view is a SIGSEGV, not an error).
        self._pass = threading.Lock()
        self._stop = threading.Event()
        self._session: KvSession | None = None
        self._thread = threading.Thread(target=self._follow, name="kv-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def mapped(self) -> bool:
        """Whether it has a view now."""
        return self._session is not None

    def take(self, allocation_id: int) -> KvSession | None:
        """Stop following; the view, if it is of the pool with ``allocation_id``
        and its GMS session is still open (a GMS that restarted may have made
        the same id again). Else None, and the view is closed."""
        with self._lock:
            self._stop.set()
            session, self._session = self._session, None
        if session is None:
            return None
        if session.allocation_id == allocation_id and session.alive():
            return session  # a pass under way only maps pages of it: harmless
        log_event(
            log,
            "kv_view_dropped",
            logging.WARNING,
            reason=f"the view is of allocation {session.allocation_id}, "
            f"alive={session.alive()}; the pool granted is {allocation_id}",
        )
        with self._pass:
            session.close()
        return None

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            session, self._session = self._session, None
        if session is not None:
            with self._pass:
                session.close()

    def _follow(self) -> None:
        said = ""
        delay = 0.0
        while not self._stop.wait(delay):
            delay = self._every_s
            with self._lock:
                session = self._session
            if session is not None:
                if session.alive():
                    with self._pass:
                        if self._session is session:  # not taken meanwhile
                            self._map_new(session)
                    delay = self._follow_s
                    continue
                with self._lock:
                    if self._session is not session:  # taken meanwhile: the taker's now
                        continue
                    self._session = None
                log_event(log, "kv_view_lost", logging.WARNING, reason="its GMS session ended")
                session.close()
            t0 = time.monotonic()
            try:
                session = KvSession.peek(
                    self._path,
                    size=self._spec.pool_bytes,
                    spec=self._spec.digest().hex(),
                    timeout=5.0,
                    name=self._name,
                )
            except GmsError as exc:
                why = "no pool yet" if _no_pool(exc) else f"{type(exc).__name__}: {exc}"
                if why != said:  # once per reason, not once a second
                    log_event(log, "kv_view_waiting", reason=why)
                    said = why
                continue
            if session.backend != "host":  # no host view to read through
                session.close()
                log_event(log, "kv_view_off", backend=session.backend)
                return
            self._mapped, self._next_gen = {}, 0
            done = self._map_new(session)
            with self._lock:
                if self._stop.is_set():  # taken meanwhile: too late for this wake
                    session.close()
                    return
                self._session = session
            log_event(
                log,
                "kv_view_mapped",
                mib=session.size >> 20,
                present_mib=done >> 20,
                last_epoch=session.previous_epoch,
                seconds=round(time.monotonic() - t0, 4),
            )
            said = ""
            delay = self._follow_s  # a view's first pass as soon as any other's

    def _map_new(self, session: KvSession) -> int:
        """Have the kernel map the pages of the positions sealed since the last
        pass; the bytes asked for. A log read while the writer writes it may
        be torn: what it says is only which pages to map, never trusted."""
        spec, view = self._spec, session.view()
        ring = view[spec.log_offset : spec.log_offset + spec.log_capacity * RECORD_SIZE]
        new = kvlog.read_from(ring, spec.log_capacity, self._next_gen) if self._next_gen else None
        if new is not None:
            self._next_gen += len(new)
            # The index of these records alone: the shape's checks and the
            # extents' rule are the whole reading's, not a second copy.
            reach = kvpool.sealed_extents(kvlog.Index.replay(spec, new))
            for rec in new:
                self._index.apply(rec)
        else:
            try:
                adopted = kvadopt.adopt(ring, spec, _EVERY_EPOCH)
            except Exception as exc:  # a log mid-write, torn anyhow: the next pass reads it
                log_event(log, "kv_view_unread", reason=f"{type(exc).__name__}: {exc}")
                return 0
            self._next_gen = adopted.next_gen
            self._index = adopted.index
            reach = kvpool.sealed_extents(adopted.index)
        runs = {
            slot: (self._mapped.get(slot, 0), n)
            for slot, n in reach.items()
            if n > self._mapped.get(slot, 0)
        }
        done = 0
        if runs:
            k, v = kvpool.arena(view, spec)
            done = memadvise.populate(kvpool.spans(k, v, spec, runs))
            for slot, (_, n) in runs.items():
                self._mapped[slot] = n
        if self._on_pass is not None and (new is None or new):
            self._tell(view)
        return done

    def _tell(self, view: memoryview) -> None:
        assert self._on_pass is not None
        try:
            self._on_pass(view, self._index)
        except Exception as exc:  # the engine's, not the view's: the view goes on
            why = f"{type(exc).__name__}: {exc}"
            log_event(log, "kv_follow_failed", logging.WARNING, error=why)


def _no_pool(exc: GmsError) -> bool:
    return isinstance(exc, GmsRefused) and exc.code is ErrorCode.NOT_FOUND
