"""The GMS allocation lock over the weights' layout, as a sans-IO state machine.

Two pieces of data drive it (as h11's ``_state.py``):

* ``TRANSITIONS``, the lock's transition table: (session phase, event kind) →
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

The KV pool is the other protocol (``kv``), over the same state
(``sessions``); the two tables share no pair.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import replace

from understudy.gms import messages as m
from understudy.gms.fsm.sessions import (
    Action,
    AdoptionOver,
    AdoptMemory,
    ArmAdoptionTimer,
    ArmTimer,
    Connected,
    CreateFailed,
    CreateMemory,
    Disconnected,
    Event,
    Expire,
    GmsState,
    InvalidTransition,
    Phase,
    Received,
    Refused,
    ReleaseMemory,
    Reply,
    Result,
    SendExport,
    Session,
    Transition,
    allocation_info,
    expire,
    get_state,
    leave,
    live_session,
    lock_state,
    run,
    set_session,
    stays,
)
from understudy.gms.layout import (
    AllocationRecord,
    align_up,
    layout_hash,
    metadata_dict,
    put_metadata,
)
from understudy.gms.messages import ErrorCode, Granted, LockState, Mode
from understudy.wire.machine import Entry

__all__ = ["GRANT_RULES", "TRANSITIONS", "Decision", "InvalidTransition", "decide", "step"]


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


def decide(state: GmsState, mode: Mode) -> Decision:
    decision = GRANT_RULES[(lock_state(state), mode)]
    if decision is Decision.GRANT_RO and state.waiting_writers:
        return Decision.REFUSE if mode is Mode.ADOPT else Decision.WAIT
    return decision


# --- handlers -----------------------------------------------------------------


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
    state = set_session(state, replace(s, phase=phase, deadline=None))
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


def _connect(state: GmsState, ev: Connected, now: float) -> Result:
    new = replace(state, sessions=(*state.sessions, Session(ev.sid, Phase.PENDING)))
    return new, [Transition("connect", ev.sid)]


def _disconnect(state: GmsState, ev: Disconnected, now: float) -> Result:
    state, s, actions = leave(state, ev)
    if s.phase in (Phase.RW, Phase.ADOPTING):
        # The writer left before committing: abort, nothing stays behind. An
        # adopter that leaves takes the orphaned layout's last hope with it
        # (its mappings were the memory): forget it, the others load anew.
        ids = tuple(a.id for a in state.allocations)
        actions.append(ReleaseMemory(ids))
        event = "abort" if s.phase is Phase.RW else "adopt_aborted"
        actions.append(Transition(event, ev.sid, detail=f"released={len(ids)}"))
        state = replace(_cleared(state), orphan=None)
    state, more = _reevaluate(state, now)
    return state, actions + more


def _hello(state: GmsState, ev: Received[m.Hello], now: float) -> Result:
    s = live_session(state, ev.sid)
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
    state = set_session(
        state, replace(s, phase=Phase.WAITING, mode=mode, since=now, deadline=deadline)
    )
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
    s = live_session(state, ev.sid)
    digest = layout_hash(state.allocations, state.metadata)
    state = replace(state, committed=True, layout_hash=digest)
    state = set_session(state, replace(s, phase=Phase.RO))  # the RW session ends; reads go on
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
    s = live_session(state, ev.sid)
    digest = layout_hash(state.allocations, state.metadata)
    if digest != s.layout_hash:
        raise Refused(
            ErrorCode.STALE_LAYOUT,
            f"re-sent layout {digest[:16]} is not the announced {str(s.layout_hash)[:16]}",
        )
    state = replace(state, committed=True, layout_hash=digest, orphan=None)
    state = set_session(state, replace(s, phase=Phase.RO, mode=Mode.RO, layout_hash=None))
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


P = Phase

_GRANTED = (P.RW, P.RO)

# The lock's transition table: (phase of the event's session, event kind) ->
# handler and the phases that session may be in afterwards. For ``Received``
# events the kind is the request's message class.
TRANSITIONS: dict[tuple[Phase, type], Entry[GmsState, Action, Phase]] = {
    (P.NONE, Connected): Entry(_connect, frozenset({P.PENDING})),
    (P.NONE, AdoptionOver): stays(_adoption_over, P.NONE),  # no session: the server's
    **{
        (p, Disconnected): Entry(_disconnect, frozenset({P.NONE}))
        for p in (P.PENDING, P.WAITING, P.RW, P.ADOPTING, P.RO)
    },
    # A wait that expires goes back to PENDING; any other expiry is a stale timer.
    (P.WAITING, Expire): Entry(expire, frozenset({P.WAITING, P.PENDING})),
    **{(p, Expire): stays(expire, p) for p in (P.PENDING, P.RW, P.ADOPTING, P.RO)},
    (P.PENDING, m.Hello): Entry(_hello, frozenset({P.WAITING, P.RW, P.ADOPTING, P.RO})),
    (P.PENDING, m.GetState): stays(get_state, P.PENDING),
    (P.PENDING, m.GetLayoutHash): stays(_get_layout_hash, P.PENDING),
    (P.RW, m.Allocate): stays(_allocate, P.RW),
    (P.RW, CreateFailed): stays(_create_failed, P.RW),
    (P.RW, m.PutMetadata): stays(_put_metadata, P.RW),
    (P.RW, m.Commit): Entry(_commit, frozenset({P.RO})),  # the writer keeps reading
    (P.ADOPTING, m.AdoptAllocation): stays(_adopt_allocation, P.ADOPTING),
    (P.ADOPTING, CreateFailed): stays(_create_failed, P.ADOPTING),
    (P.ADOPTING, m.PutMetadata): stays(_put_metadata, P.ADOPTING),
    (P.ADOPTING, m.Commit): Entry(_commit_adopted, frozenset({P.RO})),
    (P.ADOPTING, m.GetLayoutHash): stays(_get_layout_hash, P.ADOPTING),
    (P.ADOPTING, m.GetState): stays(get_state, P.ADOPTING),
    **{(p, m.Export): stays(_export, p) for p in _GRANTED},
    **{(p, m.ExportMany): stays(_export_many, p) for p in _GRANTED},
    **{(p, m.ListAllocations): stays(_list_allocations, p) for p in _GRANTED},
    **{(p, m.GetMetadata): stays(_get_metadata, p) for p in _GRANTED},
    **{(p, m.ListMetadata): stays(_list_metadata, p) for p in _GRANTED},
    **{(p, m.GetLayoutHash): stays(_get_layout_hash, p) for p in _GRANTED},
    **{(p, m.GetState): stays(get_state, p) for p in _GRANTED},
}


def step(state: GmsState, event: Event, now: float) -> Result:
    """Apply one event of the lock's protocol (see ``run``)."""
    return run(TRANSITIONS, state, event, now)
