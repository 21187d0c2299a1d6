"""What the two GMS protocols share: the server's state, the events, the actions.

A GMS server speaks two protocols over its connections, each with its own
transition table: the allocation lock over the weights' layout
(``weights``) and the KV pool (``kv``). Both read and write the one state
here, because they share what a server has once: its sessions (a connection
starts as a weights session and becomes the KV pool's with ``kv_acquire``),
its allocation ids (the backend's memory is keyed by them) and the newest
lock epoch any client showed (a fencing token for both). The vocabulary on
the wire is ``understudy.gms.messages``; this module is the core's own:
the events a shell feeds and the actions it carries out.

Pure: no I/O, no clock, no logging; time comes in as ``now``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from understudy.gms import messages as m
from understudy.gms.layout import AllocationRecord, MetadataRecord
from understudy.gms.messages import (
    ErrorCode,
    Granted,
    LocalGmsError,
    LockState,
    Mode,
    RemoteGmsError,
)
from understudy.wire import machine
from understudy.wire.machine import Entry


class InvalidTransition(machine.InvalidTransition, LocalGmsError):
    """The shell fed an event the session's phase cannot take (a bug here)."""


class Refused(RemoteGmsError):
    """The peer asked for something it may not have; answered with an error."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Phase(enum.Enum):
    NONE = "none"  # no such session (not connected yet, or gone); server-level events
    PENDING = "pending"  # connected, no lock asked for (or its wait expired)
    WAITING = "waiting"  # hello received, not grantable yet
    RW = "rw"
    ADOPTING = "adopting"  # re-sending a layout it still maps (after a GMS restart)
    RO = "ro"
    # The KV pool (docs/kv-pool.md): asked for, and GMS is reading the lock's
    # record; waiting for an older holder's connection to end; mapped RW.
    KV_CHECKING = "kv_checking"
    KV_WAITING = "kv_waiting"
    KV = "kv"
    KV_READING = "kv_reading"  # mapped read-only (kv_peek): a standby's view


# --- state --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerInfo:
    device: int
    tag: str
    backend: str
    granularity: int


@dataclass(frozen=True, slots=True)
class Session:
    sid: int
    phase: Phase
    mode: Mode | None = None  # requested in hello
    since: float = 0.0  # when the current wait started
    deadline: float | None = None
    layout_hash: str | None = None  # ADOPTING: the layout it re-sends
    kv: m.KvAcquire | None = None  # what a KV session asked for


@dataclass(frozen=True, slots=True)
class Orphan:
    """A layout committed before GMS restarted, awaited from its engine."""

    layout_hash: str
    deadline: float  # the end of the adoption window


@dataclass(frozen=True, slots=True)
class KvPool:
    """The device's KV pool: one allocation outside the weights' layout (not in
    its hash, not released when the weights are replaced), handed from one
    lock holder to the next."""

    allocation: AllocationRecord
    spec: str
    holder: int | None = None  # the session that maps it now
    holder_epoch: int | None = None
    last_epoch: int = 0
    grants: int = 0


@dataclass(frozen=True, slots=True)
class GmsState:
    info: ServerInfo
    sessions: tuple[Session, ...] = ()  # waiters are served in this order
    allocations: tuple[AllocationRecord, ...] = ()
    metadata: tuple[MetadataRecord, ...] = ()
    committed: bool = False
    layout_hash: str | None = None
    next_id: int = 0
    newest_epoch: int = 0  # the highest lock epoch any hello carried
    orphan: Orphan | None = None
    kv: KvPool | None = None

    def session(self, sid: int) -> Session | None:
        for s in self.sessions:
            if s.sid == sid:
                return s
        return None

    def phase(self, sid: int) -> Phase:
        s = self.session(sid)
        return Phase.NONE if s is None else s.phase

    def count(self, phase: Phase) -> int:
        return sum(1 for s in self.sessions if s.phase is phase)

    @property
    def waiting_writers(self) -> int:
        return sum(1 for s in self.sessions if s.phase is Phase.WAITING and s.mode is Mode.RW)

    @property
    def total_bytes(self) -> int:
        return sum(a.size for a in self.allocations)

    def next_deadline(self) -> float | None:
        deadlines = [s.deadline for s in self.sessions if s.deadline is not None]
        return min(deadlines) if deadlines else None


def initial_state(info: ServerInfo, orphan: Orphan | None = None) -> GmsState:
    """A fresh server; ``orphan``: the layout it committed before it restarted."""
    return GmsState(info=info, orphan=orphan)


def lock_state(state: GmsState) -> LockState:
    if any(s.phase in (Phase.RW, Phase.ADOPTING) for s in state.sessions):
        return LockState.RW
    if state.committed:
        return (
            LockState.RO
            if any(s.phase is Phase.RO for s in state.sessions)
            else LockState.COMMITTED
        )
    if state.orphan is not None:
        return LockState.ORPHANED
    return LockState.EMPTY


def report(state: GmsState) -> m.StateReport:
    return m.StateReport(
        state=lock_state(state),
        committed=state.committed,
        sessions={
            Granted.RW: state.count(Phase.RW),
            Granted.RO: state.count(Phase.RO),
            Granted.ADOPT: state.count(Phase.ADOPTING),
        },
        waiting=state.count(Phase.WAITING),
        waiting_writers=state.waiting_writers,
        allocations=len(state.allocations),
        bytes=state.total_bytes,
        layout_hash=state.layout_hash,
        device=state.info.device,
        tag=state.info.tag,
        backend=state.info.backend,
        kv=None if state.kv is None else kv_report(state.kv, state.count(Phase.KV_READING)),
    )


def kv_report(pool: KvPool, readers: int = 0) -> m.KvReport:
    return m.KvReport(
        bytes=pool.allocation.size,
        spec=pool.spec,
        holder_epoch=pool.holder_epoch,
        last_epoch=pool.last_epoch,
        grants=pool.grants,
        readers=readers,
    )


def allocation_info(a: AllocationRecord) -> m.AllocationInfo:
    return m.AllocationInfo(id=a.id, size=a.size, requested=a.requested, tag=a.tag)


# --- events -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connected:
    sid: int


@dataclass(frozen=True, slots=True)
class Disconnected:
    sid: int


RequestT_co = TypeVar("RequestT_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Received(Generic[RequestT_co]):
    """A request from session ``sid``; the table's kind is the request's class,
    so each handler is typed by the one request it takes."""

    sid: int
    request: RequestT_co


@dataclass(frozen=True, slots=True)
class Expire:
    """A wait's timer fired. Stale timers (the session was granted or left) are no-ops."""

    sid: int


@dataclass(frozen=True, slots=True)
class AdoptionOver:
    """The adoption window's timer fired (a server-level event: no session)."""


@dataclass(frozen=True, slots=True)
class CreateFailed:
    """The backend could not create an allocation the core had recorded."""

    sid: int
    id: int
    reason: str


@dataclass(frozen=True, slots=True)
class LockWord:
    """What the lock server's record says: who holds the pod's lock, under which
    epoch (``holder`` None: released, nobody holds it)."""

    holder: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class LockChecked:
    """The shell read the lock's record for a KV request (``ReadLock``).
    ``word`` None: there is no record to read (no lock server on this node, or
    its record unreadable; ``detail`` says which)."""

    sid: int
    word: LockWord | None
    detail: str = ""


Event = (
    Connected
    | Disconnected
    | Received[m.Request]
    | Expire
    | CreateFailed
    | AdoptionOver
    | LockChecked
)

# --- actions ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    sid: int
    message: (
        m.HelloOk
        | m.Allocations
        | m.MetadataValue
        | m.MetadataList
        | m.Ok
        | (m.Committed | m.LayoutHash | m.StateReport | m.ErrorReply)
    )


@dataclass(frozen=True, slots=True)
class CreateMemory:
    """Create the allocation, then reply ``Allocated``; on failure feed ``CreateFailed``."""

    sid: int
    allocation: AllocationRecord


@dataclass(frozen=True, slots=True)
class AdoptMemory:
    """Take the fd that came with the request as the allocation's memory, then
    reply ``Allocated``; on failure feed ``CreateFailed``."""

    sid: int
    allocation: AllocationRecord


@dataclass(frozen=True, slots=True)
class ArmAdoptionTimer:
    """Feed ``AdoptionOver`` at ``deadline``."""

    deadline: float


@dataclass(frozen=True, slots=True)
class SendExport:
    """Export the allocation as an fd and send it with an ``Exported`` reply."""

    sid: int
    allocation: AllocationRecord
    writable: bool  # only the writer's session gets a writable export


@dataclass(frozen=True, slots=True)
class ReleaseMemory:
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArmTimer:
    sid: int
    deadline: float


@dataclass(frozen=True, slots=True)
class Transition:
    """A state change worth a log line and a metric."""

    # connect disconnect wait grant expire abort commit replace allocate
    # adopt adopt_aborted orphan_expired
    event: str
    sid: int
    mode: str | None = None
    waited_s: float | None = None
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class ReadLock:
    """Read the lock server's record and feed ``LockChecked`` for ``sid``."""

    sid: int


@dataclass(frozen=True, slots=True)
class GrantKv:
    """Create the pool's memory first if ``created``, then export it (read-only
    unless ``writable``) and send it with ``kv_granted``; on a failed create
    feed ``CreateFailed``."""

    sid: int
    allocation: AllocationRecord
    created: bool
    previous_epoch: int | None
    writable: bool = True


Action = (
    Reply
    | CreateMemory
    | AdoptMemory
    | SendExport
    | ReleaseMemory
    | ArmTimer
    | ArmAdoptionTimer
    | Transition
    | ReadLock
    | GrantKv
)
Result = tuple[GmsState, list[Action]]


# --- what both tables' handlers use -------------------------------------------


def set_session(state: GmsState, session: Session) -> GmsState:
    return replace(
        state, sessions=tuple(session if s.sid == session.sid else s for s in state.sessions)
    )


def live_session(state: GmsState, sid: int) -> Session:
    """The session an event names. A table only routes an event to a handler
    when its session's phase is a live one, so a miss is a bug in the core."""
    s = state.session(sid)
    if s is None:
        raise InvalidTransition(f"session {sid} is not connected")
    return s


def leave(state: GmsState, ev: Disconnected) -> tuple[GmsState, Session, list[Action]]:
    """The session's connection ended: it is gone; what it held is the caller's."""
    s = live_session(state, ev.sid)
    state = replace(state, sessions=tuple(x for x in state.sessions if x.sid != ev.sid))
    return state, s, [Transition("disconnect", ev.sid, detail=s.phase.value)]


def expire(state: GmsState, ev: Expire, now: float) -> Result:
    """A wait's timer, in either protocol: at its deadline the wait ends with a
    timeout; earlier it re-arms; where nothing waits it is a stale timer."""
    s = live_session(state, ev.sid)
    waits = s.phase in (Phase.WAITING, Phase.KV_WAITING)
    if not waits or s.deadline is None or now < s.deadline:
        if waits and s.deadline is not None:
            return state, [ArmTimer(s.sid, s.deadline)]  # fired early: re-arm
        return state, []  # stale timer
    state = set_session(state, replace(s, phase=Phase.PENDING, mode=None, deadline=None, kv=None))
    waited = now - s.since
    mode = s.mode.value if s.mode else ("KV" if s.kv else None)
    return state, [
        Transition("expire", s.sid, mode=mode, waited_s=waited, detail=lock_state(state).value),
        Reply(
            s.sid,
            m.ErrorReply(
                code=ErrorCode.TIMEOUT,
                message=f"{mode} not granted within {waited:.3f}s (state {lock_state(state)})",
            ),
        ),
    ]


def get_state(state: GmsState, ev: Received[m.GetState], now: float) -> Result:
    return state, [Reply(ev.sid, report(state))]


# --- the table shape and its step ---------------------------------------------

Kind = type
Table = Mapping[tuple[Phase, Kind], Entry[GmsState, Action, Phase]]


def stays(
    handler: Callable[[GmsState, Any, float], Result], p: Phase
) -> Entry[GmsState, Action, Phase]:
    """An entry whose handler leaves the session in the phase it was in."""
    return Entry(handler, frozenset({p}))


def kind_of(event: Event) -> Kind:
    """A table's event kind: a request's message class, else the event's class."""
    return type(event.request) if isinstance(event, Received) else type(event)


def session_phase(state: GmsState, event: Event) -> Phase:
    if isinstance(event, AdoptionOver):
        return Phase.NONE  # the server's own event: no session's
    return state.phase(event.sid)


def takes(table: Table, state: GmsState, event: Event) -> bool:
    """Whether ``table`` has an entry for ``event`` in its session's phase."""
    return (session_phase(state, event), kind_of(event)) in table


def run(table: Table, state: GmsState, event: Event, now: float) -> Result:
    """One step over ``table``. Raises ``Refused`` or ``InvalidTransition``; the
    state is then unchanged.

    A request the session's phase does not take is the peer's fault (``Refused``,
    answered with an error); any other miss is the shell's (``InvalidTransition``).
    """
    if isinstance(event, Received) and not takes(table, state, event):
        phase = state.phase(event.sid)
        raise Refused(
            ErrorCode.REFUSED,
            f"{event.request.type} is not allowed in a {phase.value} session"
            + (" (RW-only operation)" if phase is Phase.RO else ""),
        )
    return machine.run_step(
        table, session_phase, state, event, now, kind_of=kind_of, error=InvalidTransition
    )
