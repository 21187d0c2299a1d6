"""The GMS KV pool (docs/kv-pool.md), as a sans-IO state machine.

One pool a device, read-write to one session at a time: the pod lock's
holder, under the epoch the lock server granted it. A connection asks for it
from PENDING (``kv_acquire``) and is checked against the lock server's own
record (the shell reads it: ``ReadLock`` → ``LockChecked``); where there is
none, against the newest epoch GMS has seen. The pool passes on only when its
holder's connection ends (the process's death, in a failover), so it is never
mapped by two processes at once; a newer epoch that asks meanwhile waits for
that, within its timeout. A refusal or an expired wait leaves the connection
PENDING.

Any connection may map the pool read-only as it is (``kv_peek``: a standby,
so that its pages are mapped before its promotion); that needs no lock and
changes nothing of the pool. The kernel keeps a reader from writing (its fd
is read-only).

The pool is one allocation outside the weights' layout (not in its hash, not
released when the weights are replaced), so its table shares no pair with the
weights' lock (``weights``); both work on the one state in ``sessions``.

Pure: no I/O, no clock, no logging; time comes in as ``now``.
"""

from __future__ import annotations

from dataclasses import replace

from understudy.gms import messages as m
from understudy.gms.fsm.sessions import (
    Action,
    ArmTimer,
    CreateFailed,
    Disconnected,
    Event,
    Expire,
    GmsState,
    GrantKv,
    InvalidTransition,
    KvPool,
    LockChecked,
    LockWord,
    Phase,
    ReadLock,
    Received,
    ReleaseMemory,
    Reply,
    Result,
    Session,
    Transition,
    expire,
    get_state,
    leave,
    live_session,
    run,
    set_session,
    stays,
)
from understudy.gms.layout import AllocationRecord, align_up
from understudy.gms.messages import ErrorCode
from understudy.wire.machine import Entry

__all__ = ["TRANSITIONS", "InvalidTransition", "step"]


def _acquire(state: GmsState, ev: Received[m.KvAcquire], now: float) -> Result:
    s = live_session(state, ev.sid)
    state = set_session(state, replace(s, phase=Phase.KV_CHECKING, kv=ev.request, since=now))
    return state, [ReadLock(ev.sid)]


def _refuse(state: GmsState, s: Session, code: ErrorCode, message: str) -> Result:
    state = set_session(state, replace(s, phase=Phase.PENDING, kv=None, deadline=None))
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
    s = live_session(state, ev.sid)
    want = s.kv
    if want is None:
        raise InvalidTransition(f"session {ev.sid} checks the lock without a KV request")
    why = _not_the_holder(want, ev.word, state.newest_epoch)
    if why is not None:
        return _refuse(state, s, ErrorCode.STALE_EPOCH, why)
    state = replace(state, newest_epoch=max(state.newest_epoch, want.epoch))
    pool = state.kv
    if pool is None or pool.holder is None:
        return _grant(state, s, now)
    assert pool.holder_epoch is not None
    if want.epoch <= pool.holder_epoch:
        message = f"epoch {pool.holder_epoch} maps the KV pool; epoch {want.epoch} may not"
        return _refuse(state, s, ErrorCode.STALE_EPOCH, message)
    if want.timeout_s <= 0:
        message = f"the KV pool is still mapped by epoch {pool.holder_epoch}"
        return _refuse(state, s, ErrorCode.TIMEOUT, message)
    deadline = now + want.timeout_s
    state = set_session(state, replace(s, phase=Phase.KV_WAITING, since=now, deadline=deadline))
    return state, [
        Transition("kv_wait", s.sid, mode="KV", detail=f"held by epoch {pool.holder_epoch}"),
        ArmTimer(s.sid, deadline),
    ]


def _grant(state: GmsState, s: Session, now: float) -> Result:
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
    state = set_session(state, replace(s, phase=Phase.KV, deadline=None))
    detail = f"epoch={want.epoch} created={created} previous={previous}"
    return state, [
        *actions,
        Transition("kv_grant", s.sid, mode="KV", waited_s=max(0.0, now - s.since), detail=detail),
        GrantKv(s.sid, pool.allocation, created, previous),
    ]


def _released(state: GmsState, s: Session, now: float) -> Result:
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
            state, more = _grant(state, w, now)
        else:
            message = f"epoch {waiting[0].kv.epoch if waiting[0].kv else '?'} got the KV pool"
            state, more = _refuse(state, w, ErrorCode.STALE_EPOCH, message)
        actions += more
    return state, actions


def _peek(state: GmsState, ev: Received[m.KvPeek], now: float) -> Result:
    """A read-only view of the pool as it is, if there is one of this geometry:
    a standby's, ahead of its promotion. Nothing waits for a pool to exist."""
    s = live_session(state, ev.sid)
    want, pool = ev.request, state.kv
    size = align_up(want.size, state.info.granularity)
    if pool is None or pool.allocation.size != size or pool.spec != want.spec:
        message = (
            "no KV pool yet"
            if pool is None
            else f"the KV pool is another geometry ({pool.spec}, {pool.allocation.size} bytes)"
        )
        return state, [Reply(s.sid, m.ErrorReply(code=ErrorCode.NOT_FOUND, message=message))]
    state = set_session(state, replace(s, phase=Phase.KV_READING, since=now))
    return state, [
        Transition("kv_peek", s.sid, mode="KV", detail=f"last_epoch={pool.last_epoch}"),
        GrantKv(s.sid, pool.allocation, False, pool.last_epoch, writable=False),
    ]


def _create_failed(state: GmsState, ev: CreateFailed, now: float) -> Result:
    s = live_session(state, ev.sid)
    if state.kv is None or state.kv.allocation.id != ev.id:
        raise InvalidTransition(f"create failed for {ev.id}, which is not the KV pool")
    state = replace(state, kv=None)
    return _refuse(state, s, ErrorCode.NO_MEMORY, ev.reason)


Kind = type


def _disconnect(state: GmsState, ev: Disconnected, now: float) -> Result:
    """A KV session's connection ended; the holder's end hands the pool on.
    (The weights' lock does not change, so its waiters need no second look.)"""
    state, s, actions = leave(state, ev)
    if s.phase is Phase.KV:
        state, more = _released(state, s, now)
        actions += more
    return state, actions


P = Phase

# The pool's transition table: (phase of the event's session, event kind) ->
# handler and the phases that session may be in afterwards.
TRANSITIONS: dict[tuple[Phase, type], Entry[GmsState, Action, Phase]] = {
    (P.PENDING, m.KvAcquire): Entry(_acquire, frozenset({P.KV_CHECKING})),
    (P.KV_CHECKING, LockChecked): Entry(_lock_checked, frozenset({P.KV, P.KV_WAITING, P.PENDING})),
    **{
        (p, Disconnected): Entry(_disconnect, frozenset({P.NONE}))
        for p in (P.KV_CHECKING, P.KV_WAITING, P.KV, P.KV_READING)
    },
    (P.KV_WAITING, Expire): Entry(expire, frozenset({P.KV_WAITING, P.PENDING})),
    **{(p, Expire): stays(expire, p) for p in (P.KV_CHECKING, P.KV, P.KV_READING)},
    (P.KV, CreateFailed): Entry(_create_failed, frozenset({P.PENDING})),
    **{(p, m.GetState): stays(get_state, p) for p in (P.KV, P.KV_READING)},
    (P.PENDING, m.KvPeek): Entry(_peek, frozenset({P.KV_READING, P.PENDING})),
}


def step(state: GmsState, event: Event, now: float) -> Result:
    """Apply one event of the KV pool's protocol (see ``sessions.run``)."""
    return run(TRANSITIONS, state, event, now)
