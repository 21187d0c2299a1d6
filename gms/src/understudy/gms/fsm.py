"""The GMS allocation lock as a sans-IO state machine.

Everything that changes GMS state lives here (as h11's ``_state.py``); the
asyncio server only feeds events and carries out the returned actions.

Two pieces of data drive it:

* ``TRANSITIONS``, the one transition table: (session phase, event kind) →
  handler and the phases the session may be in afterwards (the table shape
  every core shares, ``understudy.wire.machine``). A connection is a session
  that moves NONE → PENDING (connected) → WAITING (hello not yet grantable) →
  RW or RO; commit turns the RW session into an RO one on the same connection
  (the writer keeps its mappings, now read-only). A miss raises ``Refused``
  if a peer's request caused it (the shell answers with an error) and
  ``InvalidTransition`` otherwise (a bug in the shell); either way the state
  is unchanged.
* ``GRANT_RULES``: (lock state, requested mode) → decision. The lock state is
  derived from the live sessions (``lock_state``): EMPTY, RW, COMMITTED, RO,
  and ORPHANED.

Re-adoption. GMS keeps a record of its committed layout (the shell writes it
beside the socket). A GMS that restarts over such a record starts ORPHANED:
the layout's memory lives on in the mappings of the engine that serves from
it, and that engine gives it back (mode ADOPT: each allocation re-sent with
its fd, the metadata, commit). The commit must produce the same layout hash,
so every sleeping engine remaps it as if nothing happened. While ORPHANED,
every other hello waits, so no engine reloads the checkpoint over a layout
that is on its way back; after the adoption window (``AdoptionOver``) the
record is forgotten and the usual rules apply, which is today's path for a
GMS death that no engine can undo (nobody held the weights).

Waiters are re-evaluated in arrival order after every event that changes the
sessions or the committed flag. Every wait has a deadline (``now`` + the
hello's timeout); the shell arms a timer and feeds ``Expire`` — an expiry is
its own event, logged and counted. Time is a parameter; nothing here sleeps.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from understudy.gms import messages as m
from understudy.gms.layout import (
    AllocationRecord,
    MetadataRecord,
    align_up,
    layout_hash,
    metadata_dict,
    put_metadata,
)
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


class Decision(enum.Enum):
    GRANT_RW = "grant_rw"
    GRANT_RO = "grant_ro"  # unless a writer (mode RW) is waiting
    GRANT_ADOPT = "grant_adopt"
    WAIT = "wait"
    REFUSE = "refuse"  # ADOPT never waits: its layout is not the one coming


# (lock state, requested mode) -> decision. RW: no writer and no readers.
# RO: committed, no writer, no waiting writer. RW_OR_RO: RW only if free and
# nothing committed, else wait for RO.
GRANT_RULES: dict[tuple[LockState, Mode], Decision] = {
    (LockState.EMPTY, Mode.RW): Decision.GRANT_RW,
    (LockState.EMPTY, Mode.RO): Decision.WAIT,
    (LockState.EMPTY, Mode.RW_OR_RO): Decision.GRANT_RW,
    (LockState.RW, Mode.RW): Decision.WAIT,
    (LockState.RW, Mode.RO): Decision.WAIT,
    (LockState.RW, Mode.RW_OR_RO): Decision.WAIT,
    (LockState.COMMITTED, Mode.RW): Decision.GRANT_RW,  # replaces the layout
    (LockState.COMMITTED, Mode.RO): Decision.GRANT_RO,
    (LockState.COMMITTED, Mode.RW_OR_RO): Decision.GRANT_RO,
    (LockState.RO, Mode.RW): Decision.WAIT,
    (LockState.RO, Mode.RO): Decision.GRANT_RO,
    (LockState.RO, Mode.RW_OR_RO): Decision.GRANT_RO,
    # The adopter re-creates the layout where there is none; where it is
    # committed already it re-attaches (RO, same hash only); a writer at work
    # means a new layout is coming, not its own.
    (LockState.EMPTY, Mode.ADOPT): Decision.GRANT_ADOPT,
    (LockState.RW, Mode.ADOPT): Decision.REFUSE,
    (LockState.COMMITTED, Mode.ADOPT): Decision.GRANT_RO,
    (LockState.RO, Mode.ADOPT): Decision.GRANT_RO,
    # Orphaned: everyone waits for the adopter, within the adoption window.
    (LockState.ORPHANED, Mode.RW): Decision.WAIT,
    (LockState.ORPHANED, Mode.RO): Decision.WAIT,
    (LockState.ORPHANED, Mode.RW_OR_RO): Decision.WAIT,
    (LockState.ORPHANED, Mode.ADOPT): Decision.GRANT_ADOPT,
}


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


def decide(state: GmsState, mode: Mode) -> Decision:
    decision = GRANT_RULES[(lock_state(state), mode)]
    if decision is Decision.GRANT_RO and state.waiting_writers:
        return Decision.REFUSE if mode is Mode.ADOPT else Decision.WAIT
    return decision


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
        kv=None if state.kv is None else kv_report(state.kv),
    )


def kv_report(pool: KvPool) -> m.KvReport:
    return m.KvReport(
        bytes=pool.allocation.size,
        spec=pool.spec,
        holder_epoch=pool.holder_epoch,
        last_epoch=pool.last_epoch,
        grants=pool.grants,
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
    """Create the pool's memory first if ``created``, then export it writable and
    send it with ``kv_granted``; on a failed create feed ``CreateFailed``."""

    sid: int
    allocation: AllocationRecord
    created: bool
    previous_epoch: int | None


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

# --- handlers -----------------------------------------------------------------


def _set(state: GmsState, session: Session) -> GmsState:
    return replace(
        state, sessions=tuple(session if s.sid == session.sid else s for s in state.sessions)
    )


def _drop(state: GmsState, sid: int) -> GmsState:
    return replace(state, sessions=tuple(s for s in state.sessions if s.sid != sid))


def _cleared(state: GmsState) -> GmsState:
    return replace(state, allocations=(), metadata=(), committed=False, layout_hash=None)


_GRANTED_BY = {
    Decision.GRANT_RW: (Granted.RW, Phase.RW),
    Decision.GRANT_RO: (Granted.RO, Phase.RO),
    Decision.GRANT_ADOPT: (Granted.ADOPT, Phase.ADOPTING),
}


def _grant(state: GmsState, s: Session, decision: Decision, now: float) -> Result:
    actions: list[Action] = []
    granted, phase = _GRANTED_BY[decision]
    if granted is not Granted.RO and (state.committed or state.allocations):
        # A writer over a committed layout starts a new one.
        actions.append(ReleaseMemory(tuple(a.id for a in state.allocations)))
        actions.append(Transition("replace", s.sid, detail=state.layout_hash))
        state = _cleared(state)
    state = _set(state, replace(s, phase=phase, deadline=None))
    actions.append(Transition("grant", s.sid, mode=granted.value, waited_s=max(0.0, now - s.since)))
    actions.append(
        Reply(
            s.sid,
            m.HelloOk(
                granted=granted,
                layout_hash=state.layout_hash if granted is Granted.RO else None,
                granularity=state.info.granularity,
                backend=state.info.backend,
                device=state.info.device,
            ),
        )
    )
    return state, actions


def _reevaluate(state: GmsState, now: float) -> Result:
    """Grant every waiter that can be granted, in arrival order."""
    actions: list[Action] = []
    progress = True
    while progress:
        progress = False
        for s in state.sessions:
            if s.phase is not Phase.WAITING:
                continue
            assert s.mode is not None
            decision = decide(state, s.mode)
            if decision not in (Decision.WAIT, Decision.REFUSE):
                state, more = _grant(state, s, decision, now)
                actions.extend(more)
                progress = True
                break
    return state, actions


def _live(state: GmsState, sid: int) -> Session:
    """The session an event names. The table only routes an event here when
    its session's phase is a live one, so a miss is a bug in this module."""
    s = state.session(sid)
    if s is None:
        raise InvalidTransition(f"session {sid} is not connected")
    return s


def _connect(state: GmsState, ev: Connected, now: float) -> Result:
    new = replace(state, sessions=(*state.sessions, Session(ev.sid, Phase.PENDING)))
    return new, [Transition("connect", ev.sid)]


def _disconnect(state: GmsState, ev: Disconnected, now: float) -> Result:
    s = _live(state, ev.sid)
    actions: list[Action] = [Transition("disconnect", ev.sid, detail=s.phase.value)]
    state = _drop(state, ev.sid)
    if s.phase in (Phase.RW, Phase.ADOPTING):
        # The writer left before committing: abort, nothing stays behind. An
        # adopter that leaves takes the orphaned layout's last hope with it
        # (its mappings were the memory): forget it, the others load anew.
        ids = tuple(a.id for a in state.allocations)
        actions.append(ReleaseMemory(ids))
        event = "abort" if s.phase is Phase.RW else "adopt_aborted"
        actions.append(Transition(event, ev.sid, detail=f"released={len(ids)}"))
        state = replace(_cleared(state), orphan=None)
    if s.phase is Phase.KV:
        state, more = _kv_released(state, s, now)
        actions += more
    state, more = _reevaluate(state, now)
    return state, actions + more


def _hello(state: GmsState, ev: Received[m.Hello], now: float) -> Result:
    s = _live(state, ev.sid)
    mode = ev.request.mode
    epoch = ev.request.epoch
    if epoch is not None:
        if epoch < state.newest_epoch and mode is not Mode.RO:
            raise Refused(
                ErrorCode.STALE_EPOCH,
                f"epoch {epoch} is older than {state.newest_epoch}: another engine holds "
                "the pod's lock now, so this one may not write",
            )
        state = replace(state, newest_epoch=max(state.newest_epoch, epoch))
    if mode is Mode.ADOPT:
        return _hello_adopt(state, s, ev.request, now)
    decision = decide(state, mode)
    if decision is not Decision.WAIT:
        return _grant(state, replace(s, mode=mode, since=now), decision, now)
    if ev.request.timeout_s <= 0:
        raise Refused(ErrorCode.TIMEOUT, f"{mode} not grantable now ({lock_state(state)})")
    deadline = now + ev.request.timeout_s
    state = _set(state, replace(s, phase=Phase.WAITING, mode=mode, since=now, deadline=deadline))
    return state, [
        Transition("wait", ev.sid, mode=mode.value, detail=lock_state(state).value),
        ArmTimer(ev.sid, deadline),
    ]


def _hello_adopt(state: GmsState, s: Session, hello: m.Hello, now: float) -> Result:
    """ADOPT is granted at once or refused, never waits: the adopter serves from
    its mappings meanwhile, and a refusal tells it to give up."""
    decision = decide(state, Mode.ADOPT)
    wanted = hello.layout_hash
    if decision is Decision.REFUSE:
        raise Refused(
            ErrorCode.STALE_LAYOUT,
            f"cannot adopt {str(wanted)[:16]}: a new layout is being written ({lock_state(state)})",
        )
    have = state.layout_hash if decision is Decision.GRANT_RO else None
    if decision is Decision.GRANT_ADOPT and state.orphan is not None:
        have = state.orphan.layout_hash
    if have is not None and have != wanted:
        raise Refused(
            ErrorCode.STALE_LAYOUT,
            f"cannot adopt {str(wanted)[:16]}: this GMS has {have[:16]}",
        )
    session = replace(s, mode=Mode.ADOPT, since=now, layout_hash=wanted)
    return _grant(state, session, decision, now)


def _expire(state: GmsState, ev: Expire, now: float) -> Result:
    s = _live(state, ev.sid)
    waits = s.phase in (Phase.WAITING, Phase.KV_WAITING)
    if not waits or s.deadline is None or now < s.deadline:
        if waits and s.deadline is not None:
            return state, [ArmTimer(s.sid, s.deadline)]  # fired early: re-arm
        return state, []  # stale timer
    state = _set(state, replace(s, phase=Phase.PENDING, mode=None, deadline=None, kv=None))
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


def _allocate(state: GmsState, ev: Received[m.Allocate], now: float) -> Result:
    size = align_up(ev.request.size, state.info.granularity)
    record = AllocationRecord(state.next_id, size, ev.request.size, ev.request.tag)
    state = replace(state, allocations=(*state.allocations, record), next_id=state.next_id + 1)
    return state, [CreateMemory(ev.sid, record)]


def _adopt_allocation(state: GmsState, ev: Received[m.AdoptAllocation], now: float) -> Result:
    size = align_up(ev.request.size, state.info.granularity)
    record = AllocationRecord(state.next_id, size, ev.request.size, ev.request.tag)
    state = replace(state, allocations=(*state.allocations, record), next_id=state.next_id + 1)
    return state, [AdoptMemory(ev.sid, record)]


def _create_failed(state: GmsState, ev: CreateFailed, now: float) -> Result:
    if not any(a.id == ev.id for a in state.allocations):
        raise InvalidTransition(f"create failed for unknown allocation {ev.id}")
    state = replace(state, allocations=tuple(a for a in state.allocations if a.id != ev.id))
    return state, [
        Transition("create_failed", ev.sid, detail=ev.reason),
        Reply(ev.sid, m.ErrorReply(code=ErrorCode.NO_MEMORY, message=ev.reason)),
    ]


def _find(state: GmsState, alloc_id: int) -> AllocationRecord:
    # Allocations are kept in id order (ids only grow), so bisect: a remap of
    # thousands of allocations exports each one, and a linear scan made that O(N²).
    i = bisect.bisect_left(state.allocations, alloc_id, key=_alloc_id)
    if i < len(state.allocations) and state.allocations[i].id == alloc_id:
        return state.allocations[i]
    raise Refused(ErrorCode.NOT_FOUND, f"no allocation with id {alloc_id}")


def _alloc_id(a: AllocationRecord) -> int:
    return a.id


def _export(state: GmsState, ev: Received[m.Export], now: float) -> Result:
    writable = state.phase(ev.sid) is Phase.RW
    return state, [SendExport(ev.sid, _find(state, ev.request.id), writable)]


def _export_many(state: GmsState, ev: Received[m.ExportMany], now: float) -> Result:
    writable = state.phase(ev.sid) is Phase.RW
    records = [_find(state, i) for i in ev.request.ids]  # all or nothing
    return state, [SendExport(ev.sid, r, writable) for r in records]


def _list_allocations(state: GmsState, ev: Received[m.ListAllocations], now: float) -> Result:
    infos = tuple(allocation_info(a) for a in state.allocations)
    return state, [Reply(ev.sid, m.Allocations(allocations=infos))]


def _put_metadata(state: GmsState, ev: Received[m.PutMetadata], now: float) -> Result:
    req = ev.request
    state = replace(state, metadata=put_metadata(state.metadata, req.key, req.value))
    return state, [Reply(ev.sid, m.Ok())]


def _get_metadata(state: GmsState, ev: Received[m.GetMetadata], now: float) -> Result:
    key = ev.request.key
    for rec in state.metadata:
        if rec.key == key:
            value = metadata_dict((rec,))[key]
            assert isinstance(value, dict)
            return state, [Reply(ev.sid, m.MetadataValue(key=key, value=value))]
    raise Refused(ErrorCode.NOT_FOUND, f"no metadata key {key!r}")


def _list_metadata(state: GmsState, ev: Received[m.ListMetadata], now: float) -> Result:
    items = metadata_dict(state.metadata)
    return state, [Reply(ev.sid, m.MetadataList.model_validate({"items": items}))]


def _commit(state: GmsState, ev: Received[m.Commit], now: float) -> Result:
    s = _live(state, ev.sid)
    digest = layout_hash(state.allocations, state.metadata)
    state = replace(state, committed=True, layout_hash=digest)
    state = _set(state, replace(s, phase=Phase.RO))  # the RW session ends; reads go on
    actions: list[Action] = [
        Transition(
            "commit", ev.sid, detail=f"hash={digest[:16]} allocations={len(state.allocations)}"
        ),
        Reply(ev.sid, m.Committed(layout_hash=digest)),
    ]
    state, more = _reevaluate(state, now)
    return state, actions + more


def _commit_adopted(state: GmsState, ev: Received[m.Commit], now: float) -> Result:
    """The re-sent layout must be the one the adopter announced: then every
    engine that sleeps over it remaps it unchanged."""
    s = _live(state, ev.sid)
    digest = layout_hash(state.allocations, state.metadata)
    if digest != s.layout_hash:
        raise Refused(
            ErrorCode.STALE_LAYOUT,
            f"re-sent layout {digest[:16]} is not the announced {str(s.layout_hash)[:16]}",
        )
    state = replace(state, committed=True, layout_hash=digest, orphan=None)
    state = _set(state, replace(s, phase=Phase.RO, mode=Mode.RO, layout_hash=None))
    actions: list[Action] = [
        Transition(
            "adopt", ev.sid, detail=f"hash={digest[:16]} allocations={len(state.allocations)}"
        ),
        Reply(ev.sid, m.Committed(layout_hash=digest)),
    ]
    state, more = _reevaluate(state, now)
    return state, actions + more


def _adoption_over(state: GmsState, ev: AdoptionOver, now: float) -> Result:
    """The window closed: forget the orphan (early timers re-arm)."""
    orphan = state.orphan
    if orphan is None:
        return state, []  # adopted meanwhile: a stale timer
    if now < orphan.deadline:
        return state, [ArmAdoptionTimer(orphan.deadline)]
    state = replace(state, orphan=None)
    actions: list[Action] = [Transition("orphan_expired", 0, detail=orphan.layout_hash[:16])]
    state, more = _reevaluate(state, now)
    return state, actions + more


def _get_layout_hash(state: GmsState, ev: Received[m.GetLayoutHash], now: float) -> Result:
    return state, [
        Reply(ev.sid, m.LayoutHash(committed=state.committed, layout_hash=state.layout_hash))
    ]


def _get_state(state: GmsState, ev: Received[m.GetState], now: float) -> Result:
    return state, [Reply(ev.sid, report(state))]


# --- the KV pool (docs/kv-pool.md) ----------------------------------------------
#
# One pool a device, read-write to one session at a time: the pod lock's
# holder, under the epoch the lock server granted it. A request is checked
# against the lock server's own record (the shell reads it: ``ReadLock`` →
# ``LockChecked``); where there is none, against the newest epoch GMS has seen.
# The pool passes on only when its holder's connection ends (the process's
# death, in a failover), so it is never mapped by two processes at once; a
# newer epoch that asks meanwhile waits for that, within its timeout.


def _kv_acquire(state: GmsState, ev: Received[m.KvAcquire], now: float) -> Result:
    s = _live(state, ev.sid)
    state = _set(state, replace(s, phase=Phase.KV_CHECKING, kv=ev.request, since=now))
    return state, [ReadLock(ev.sid)]


def _kv_refuse(state: GmsState, s: Session, code: ErrorCode, message: str) -> Result:
    state = _set(state, replace(s, phase=Phase.PENDING, kv=None, deadline=None))
    return state, [
        Transition("kv_refuse", s.sid, mode="KV", detail=f"{code.value}: {message}"),
        Reply(s.sid, m.ErrorReply(code=code, message=message)),
    ]


def _not_the_holder(want: m.KvAcquire, word: LockWord | None, newest: int) -> str | None:
    """Why ``want`` is not from the lock's holder, or None if it is."""
    if word is None:  # no record to ask: the epoch is a fencing token only
        if want.epoch < newest:
            return f"epoch {want.epoch} is older than {newest}, the newest this GMS has seen"
        return None
    if word.holder is None:
        return f"the lock's record says nobody holds the lock (epoch {word.epoch} ended)"
    if word.epoch != want.epoch or (want.client and want.client != word.holder):
        return (
            f"the lock's record says {word.holder!r} holds it under epoch {word.epoch}; "
            f"this is {want.client or 'a client'!r} under epoch {want.epoch}"
        )
    return None


def _lock_checked(state: GmsState, ev: LockChecked, now: float) -> Result:
    s = _live(state, ev.sid)
    want = s.kv
    if want is None:
        raise InvalidTransition(f"session {ev.sid} checks the lock without a KV request")
    why = _not_the_holder(want, ev.word, state.newest_epoch)
    if why is not None:
        return _kv_refuse(state, s, ErrorCode.STALE_EPOCH, why)
    state = replace(state, newest_epoch=max(state.newest_epoch, want.epoch))
    pool = state.kv
    if pool is None or pool.holder is None:
        return _kv_grant(state, s, now)
    assert pool.holder_epoch is not None
    if want.epoch <= pool.holder_epoch:
        message = f"epoch {pool.holder_epoch} maps the KV pool; epoch {want.epoch} may not"
        return _kv_refuse(state, s, ErrorCode.STALE_EPOCH, message)
    if want.timeout_s <= 0:
        message = f"the KV pool is still mapped by epoch {pool.holder_epoch}"
        return _kv_refuse(state, s, ErrorCode.TIMEOUT, message)
    deadline = now + want.timeout_s
    state = _set(state, replace(s, phase=Phase.KV_WAITING, since=now, deadline=deadline))
    return state, [
        Transition("kv_wait", s.sid, mode="KV", detail=f"held by epoch {pool.holder_epoch}"),
        ArmTimer(s.sid, deadline),
    ]


def _kv_grant(state: GmsState, s: Session, now: float) -> Result:
    want = s.kv
    assert want is not None
    size = align_up(want.size, state.info.granularity)
    pool = state.kv
    actions: list[Action] = []
    created = pool is None or pool.allocation.size != size or pool.spec != want.spec
    if created:
        if pool is not None:  # another geometry: nobody maps the old one, so free it
            actions.append(ReleaseMemory((pool.allocation.id,)))
            actions.append(Transition("kv_replace", s.sid, mode="KV", detail=pool.spec))
        record = AllocationRecord(state.next_id, size, want.size, "kv")
        pool = KvPool(record, want.spec)
        state = replace(state, next_id=state.next_id + 1)
    assert pool is not None
    previous = None if created else pool.last_epoch
    pool = replace(
        pool,
        holder=s.sid,
        holder_epoch=want.epoch,
        last_epoch=want.epoch,
        grants=pool.grants + 1,
    )
    state = replace(state, kv=pool)
    state = _set(state, replace(s, phase=Phase.KV, deadline=None))
    detail = f"epoch={want.epoch} created={created} previous={previous}"
    return state, [
        *actions,
        Transition("kv_grant", s.sid, mode="KV", waited_s=max(0.0, now - s.since), detail=detail),
        GrantKv(s.sid, pool.allocation, created, previous),
    ]


def _kv_released(state: GmsState, s: Session, now: float) -> Result:
    """The holder's connection ended: the pool stays, as it is, for the next
    holder; of the sessions waiting for it the newest epoch gets it."""
    assert state.kv is not None and state.kv.holder == s.sid
    epoch = state.kv.holder_epoch
    state = replace(state, kv=replace(state.kv, holder=None, holder_epoch=None))
    actions: list[Action] = [Transition("kv_release", s.sid, mode="KV", detail=f"epoch={epoch}")]
    waiting = [w for w in state.sessions if w.phase is Phase.KV_WAITING and w.kv is not None]
    waiting.sort(key=lambda w: w.kv.epoch if w.kv else 0, reverse=True)
    for i, w in enumerate(waiting):
        if i == 0:
            state, more = _kv_grant(state, w, now)
        else:
            message = f"epoch {waiting[0].kv.epoch if waiting[0].kv else '?'} got the KV pool"
            state, more = _kv_refuse(state, w, ErrorCode.STALE_EPOCH, message)
        actions += more
    return state, actions


def _kv_create_failed(state: GmsState, ev: CreateFailed, now: float) -> Result:
    s = _live(state, ev.sid)
    if state.kv is None or state.kv.allocation.id != ev.id:
        raise InvalidTransition(f"create failed for {ev.id}, which is not the KV pool")
    state = replace(state, kv=None)
    return _kv_refuse(state, s, ErrorCode.NO_MEMORY, ev.reason)


Kind = type
P = Phase

_LIVE = (P.PENDING, P.WAITING, P.RW, P.ADOPTING, P.RO, P.KV_CHECKING, P.KV_WAITING, P.KV)
_GRANTED = (P.RW, P.RO)


def _stays(
    handler: Callable[[GmsState, Any, float], Result], p: Phase
) -> Entry[GmsState, Action, Phase]:
    """An entry whose handler leaves the session in the phase it was in."""
    return Entry(handler, frozenset({p}))


# The one transition table: (phase of the event's session, event kind) ->
# handler and the phases that session may be in afterwards. For ``Received``
# events the kind is the request's message class.
TRANSITIONS: dict[tuple[Phase, Kind], Entry[GmsState, Action, Phase]] = {
    (P.NONE, Connected): Entry(_connect, frozenset({P.PENDING})),
    (P.NONE, AdoptionOver): _stays(_adoption_over, P.NONE),  # no session: the server's
    **{(p, Disconnected): Entry(_disconnect, frozenset({P.NONE})) for p in _LIVE},
    # A wait that expires goes back to PENDING; any other expiry is a stale timer.
    (P.WAITING, Expire): Entry(_expire, frozenset({P.WAITING, P.PENDING})),
    **{(p, Expire): _stays(_expire, p) for p in (P.PENDING, P.RW, P.ADOPTING, P.RO)},
    (P.PENDING, m.Hello): Entry(_hello, frozenset({P.WAITING, P.RW, P.ADOPTING, P.RO})),
    (P.PENDING, m.GetState): _stays(_get_state, P.PENDING),
    (P.PENDING, m.GetLayoutHash): _stays(_get_layout_hash, P.PENDING),
    (P.RW, m.Allocate): _stays(_allocate, P.RW),
    (P.RW, CreateFailed): _stays(_create_failed, P.RW),
    (P.RW, m.PutMetadata): _stays(_put_metadata, P.RW),
    (P.RW, m.Commit): Entry(_commit, frozenset({P.RO})),  # the writer keeps reading
    (P.ADOPTING, m.AdoptAllocation): _stays(_adopt_allocation, P.ADOPTING),
    (P.ADOPTING, CreateFailed): _stays(_create_failed, P.ADOPTING),
    (P.ADOPTING, m.PutMetadata): _stays(_put_metadata, P.ADOPTING),
    (P.ADOPTING, m.Commit): Entry(_commit_adopted, frozenset({P.RO})),
    (P.ADOPTING, m.GetLayoutHash): _stays(_get_layout_hash, P.ADOPTING),
    (P.ADOPTING, m.GetState): _stays(_get_state, P.ADOPTING),
    **{(p, m.Export): _stays(_export, p) for p in _GRANTED},
    **{(p, m.ExportMany): _stays(_export_many, p) for p in _GRANTED},
    **{(p, m.ListAllocations): _stays(_list_allocations, p) for p in _GRANTED},
    **{(p, m.GetMetadata): _stays(_get_metadata, p) for p in _GRANTED},
    **{(p, m.ListMetadata): _stays(_list_metadata, p) for p in _GRANTED},
    **{(p, m.GetLayoutHash): _stays(_get_layout_hash, p) for p in _GRANTED},
    **{(p, m.GetState): _stays(_get_state, p) for p in _GRANTED},
    # The KV pool: its own connection, from PENDING.
    (P.PENDING, m.KvAcquire): Entry(_kv_acquire, frozenset({P.KV_CHECKING})),
    (P.KV_CHECKING, LockChecked): Entry(_lock_checked, frozenset({P.KV, P.KV_WAITING, P.PENDING})),
    (P.KV_WAITING, Expire): Entry(_expire, frozenset({P.KV_WAITING, P.PENDING})),
    **{(p, Expire): _stays(_expire, p) for p in (P.KV_CHECKING, P.KV)},
    (P.KV, CreateFailed): Entry(_kv_create_failed, frozenset({P.PENDING})),
    (P.KV, m.GetState): _stays(_get_state, P.KV),
}


def kind_of(event: Event) -> Kind:
    return type(event.request) if isinstance(event, Received) else type(event)


def _session_phase(state: GmsState, event: Event) -> Phase:
    if isinstance(event, AdoptionOver):
        return Phase.NONE  # the server's own event: no session's
    return state.phase(event.sid)


def step(state: GmsState, event: Event, now: float) -> Result:
    """Apply one event. Raises ``Refused`` or ``InvalidTransition``; state then unchanged.

    A request the session's phase does not take is the peer's fault (``Refused``,
    answered with an error); any other miss is the shell's (``InvalidTransition``).
    """
    if isinstance(event, Received):
        phase = state.phase(event.sid)
        if (phase, kind_of(event)) not in TRANSITIONS:
            raise Refused(
                ErrorCode.REFUSED,
                f"{event.request.type} is not allowed in a {phase.value} session"
                + (" (RW-only operation)" if phase is Phase.RO else ""),
            )
    return machine.run_step(
        TRANSITIONS, _session_phase, state, event, now, kind_of=kind_of, error=InvalidTransition
    )


@dataclass(slots=True)
class Machine:
    """A mutable holder for shells: ``feed`` steps and keeps the new state."""

    state: GmsState

    def feed(self, event: Event, now: float) -> list[Action]:
        self.state, actions = step(self.state, event, now)
        return actions
