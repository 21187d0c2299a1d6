"""The lock server's decision core: who holds the pod's lock, and who waits.

Sans-IO: ``step(state, event, now) -> (state, actions)``, the shape every core
shares (``understudy.wire.machine``). The shell feeds connection events and
timer expiries with the loop's time and carries out the actions (reply,
persist, clear). Everything that changes the lock's state is in this file, and
``TRANSITIONS`` is the one table of which events each phase accepts, the
handler for each, and which phases it may lead to.

Semantics:
- the connection is the lock: no release message, a holder's disconnect frees it;
- every new grant gets an epoch (fencing token) higher than any before, also
  across restarts (the epoch is persisted, and a corrupt state file restarts
  the count above any counter-based epoch);
- on restart with a persisted holder a reconnect window opens; only that holder
  can be granted during it (with its old epoch); afterwards the lock is free.
  The window ends early when the holder is seen gone (its heartbeat);
- on restart without a record (no state file, or no whole copy of it) the
  holder is unknown: the first engine that claims a grant is re-granted under
  a new epoch, and everyone else waits until no engine in the pod holds an
  epoch any more (when the shell can see every engine's heartbeat), or out
  the window (when it cannot: clients over TCP);
- a holder that lost its connection may ask for its grant back
  (``resume_epoch``); that succeeds only if nobody was granted since.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import assert_never

from understudy.wire import machine
from understudy.wire.machine import Entry

# ---------------------------------------------------------------- state ----


class Phase(enum.Enum):
    INIT = "init"  # before the state file was read
    FREE = "free"
    HELD = "held"
    WINDOW = "window"  # restarted with a persisted holder; waiting for it


@dataclass(frozen=True, slots=True)
class Holder:
    conn: int
    engine_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Waiter:
    conn: int
    engine_id: str
    resume_epoch: int | None
    since: float


@dataclass(frozen=True, slots=True)
class Window:
    holder: str | None  # None: the state file was unreadable, holder unknown
    epoch: int
    deadline: float


@dataclass(frozen=True, slots=True)
class LockState:
    phase: Phase = Phase.INIT
    epoch: int = 0  # the highest epoch ever granted (or restored)
    holder: Holder | None = None
    waiters: tuple[Waiter, ...] = ()
    window: Window | None = None
    last_holder: str | None = None  # engine id of the most recent holder
    # Restarted without a readable record (missing or damaged file): the
    # server cannot check a resume claim against what it issued, so the first
    # engine that claims one is re-granted under a fresh epoch (see _claim).
    history_unknown: bool = False
    # The grant being written to the state file, to undo if the write fails.
    pending: Pending | None = None


@dataclass(frozen=True, slots=True)
class Pending:
    waiter: Waiter
    epoch_before: int
    last_holder_before: str | None
    resumed: bool  # the waiter keeps the epoch it claimed
    reissued: bool  # the waiter's claim, honoured under a new epoch


# --------------------------------------------------------------- events ----


@dataclass(frozen=True, slots=True)
class PersistedRecord:
    holder: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class Restored:
    """The shell read the state file: a record, nothing (``None``), or garbage."""

    record: PersistedRecord | None
    corrupt: bool
    window_s: float
    # Epoch to restart from when the file is corrupt: the shell passes wall
    # time in microseconds (about 1.8e15, still exact in a JSON double), which
    # exceeds any counter-based epoch and any epoch granted after an earlier
    # corruption unless grants outpaced one per microsecond.
    epoch_floor: int = 0
    # The shell sees the heartbeat of every engine that could hold the lock
    # (all clients are in the pod, none over TCP), so it can report
    # HolderGone for an unknown holder too: then an unknown holder's window
    # need not be guessed short or waited out long.
    sees_claimants: bool = False


@dataclass(frozen=True, slots=True)
class Connected:
    conn: int


@dataclass(frozen=True, slots=True)
class AcquireRequested:
    conn: int
    engine_id: str
    resume_epoch: int | None = None


@dataclass(frozen=True, slots=True)
class Disconnected:
    conn: int


@dataclass(frozen=True, slots=True)
class WindowExpired:
    """The window's deadline passed. The shell feeds it from its timer, and
    only once the deadline is due (a timer that fires early is armed again):
    fed before the deadline, it is refused (``InvalidTransition``)."""


@dataclass(frozen=True, slots=True)
class HolderGone:
    """During a reconnect window, the shell saw the holder it waits for gone:
    the persisted holder (``engine_id``), whose heartbeat names a pid that no
    longer runs or stopped moving, or, for an unknown holder (``None``), every
    engine in the pod that holds an epoch. It will never reclaim, so waiting
    out the window only delays the failover."""

    engine_id: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class Persisted:
    """The state file holds the pending grant: it may be sent."""


@dataclass(frozen=True, slots=True)
class PersistFailed:
    """Writing the pending grant failed (a full or broken volume): undo it."""

    reason: str


@dataclass(frozen=True, slots=True)
class RetryGrant:
    """The shell's retry timer after a failed write fired."""


Event = (
    Restored
    | Connected
    | AcquireRequested
    | Disconnected
    | WindowExpired
    | HolderGone
    | Persisted
    | PersistFailed
    | RetryGrant
)

# -------------------------------------------------------------- actions ----


@dataclass(frozen=True, slots=True)
class Grant:
    conn: int
    engine_id: str
    epoch: int
    resumed: bool
    waited_s: float
    # A resume honoured under a new epoch: the server had lost its record.
    reissued: bool = False


@dataclass(frozen=True, slots=True)
class Persist:
    """Write ``{holder, epoch, granted_at}``, then feed Persisted (or
    PersistFailed); the grant is sent only after the write."""

    engine_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Clear:
    """Write ``{holder: null, epoch}``: nobody holds the lock."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Reject:
    conn: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class WindowOpened:
    holder: str | None
    epoch: int
    deadline: float
    corrupt: bool


@dataclass(frozen=True, slots=True)
class WindowClosed:
    reason: str  # "reclaimed" | "expired" | "holder_gone"


@dataclass(frozen=True, slots=True)
class ArmRetry:
    """Feed RetryGrant at ``deadline`` (a write failed; try the grant again)."""

    deadline: float
    reason: str


Action = Grant | Persist | Clear | Reject | WindowOpened | WindowClosed | ArmRetry

# Epochs stay exact in the JSON state file (a double holds integers up to 2**53).
MAX_EPOCH = 2**53 - 1
RETRY_S = 0.1
NO_RECORD_WINDOW_S = 1.0


class InvalidTransition(machine.InvalidTransition):
    """An event the current phase does not accept (a bug in the shell)."""


# ------------------------------------------------------------- handlers ----

Result = tuple[LockState, list[Action]]


def _restored(s: LockState, e: Restored, now: float) -> Result:
    if e.corrupt or e.record is None:
        # No record: a new pod, a volume that lost it, or both copies damaged.
        # Epochs restart above anything granted before (the floor), and a
        # holder that comes back is re-granted rather than refused. The
        # window gives it the first turn; it lasts until no engine in the pod
        # holds an epoch (HolderGone(None): a new pod's engines hold none, so
        # it costs a new pod nothing) when the shell can tell, else a guess:
        # the whole window for a damaged record (a holder surely existed), a
        # short one for none (most often a new pod, whose engines take longer
        # than that to load their weights and ask).
        epoch = max(e.epoch_floor, s.epoch)
        seconds = e.window_s
        if not e.corrupt and not e.sees_claimants:
            seconds = min(e.window_s, NO_RECORD_WINDOW_S)
        w = Window(holder=None, epoch=epoch, deadline=now + seconds)
        return (
            replace(s, phase=Phase.WINDOW, epoch=epoch, window=w, history_unknown=True),
            [WindowOpened(None, epoch, w.deadline, corrupt=e.corrupt)],
        )
    if e.record.holder is None:
        return replace(s, phase=Phase.FREE, epoch=e.record.epoch), []
    w = Window(holder=e.record.holder, epoch=e.record.epoch, deadline=now + e.window_s)
    return (
        replace(s, phase=Phase.WINDOW, epoch=e.record.epoch, window=w, last_holder=w.holder),
        [WindowOpened(w.holder, w.epoch, w.deadline, corrupt=False)],
    )


def _noop(s: LockState, e: Event, now: float) -> Result:
    return s, []


def _known(s: LockState, conn: int) -> str | None:
    if s.holder is not None and s.holder.conn == conn:
        return "holds the lock"
    if any(w.conn == conn for w in s.waiters):
        return "is already waiting"
    return None


def _claim(s: LockState, engine_id: str, resume: int | None) -> Reject | str | None:
    """Judge a resume claim: None (a plain acquire), "resume" (keep its epoch),
    "reissue" (a new epoch: the server lost its record), or a Reject."""
    if resume is None:
        return None
    if s.history_unknown:
        return "reissue"
    if resume == s.epoch and engine_id == s.last_holder:
        return "resume"
    if resume < s.epoch:
        return Reject(-1, "superseded", _superseded(resume, s.epoch))
    # An epoch this server never issued to this engine: keeping it would let a
    # client choose its own fencing token.
    return Reject(
        -1,
        "bad_request",
        f"epoch {resume} was not issued to {engine_id} (the last grant was epoch {s.epoch}"
        f" to {s.last_holder or 'nobody'}); acquire without resume_epoch",
    )


def _grant(s: LockState, w: Waiter, now: float) -> Result:
    """Make ``w`` the holder once its record is written: a resume keeps its
    epoch, anything else gets a new one. The grant goes out on Persisted."""
    claim = _claim(s, w.engine_id, w.resume_epoch)
    resumed = claim == "resume"
    epoch = s.epoch if resumed else s.epoch + 1
    if epoch > MAX_EPOCH:
        rest = tuple(x for x in s.waiters if x.conn != w.conn)
        return replace(s, waiters=rest), [Reject(w.conn, "internal", "epochs exhausted")]
    rest = tuple(x for x in s.waiters if x.conn != w.conn)
    new = replace(
        s,
        phase=Phase.HELD,
        epoch=epoch,
        holder=Holder(w.conn, w.engine_id, epoch),
        waiters=rest,
        window=None,
        last_holder=w.engine_id,
        history_unknown=False,
        pending=Pending(w, s.epoch, s.last_holder, resumed, claim == "reissue"),
    )
    return new, [Persist(w.engine_id, epoch)]


def _holder_gone(s: LockState, e: HolderGone, now: float) -> Result:
    assert s.window is not None  # WINDOW always has one
    if e.engine_id != s.window.holder:
        raise InvalidTransition(
            f"HolderGone for {e.engine_id}, but the window waits for {s.window.holder}",
            s.phase,
            HolderGone,
        )
    new, actions = _release(s, now)
    return new, [WindowClosed("holder_gone"), *actions]


def _persisted(s: LockState, e: Persisted, now: float) -> Result:
    assert s.holder is not None and s.pending is not None
    p, h = s.pending, s.holder
    waited = max(0.0, now - p.waiter.since)
    actions: list[Action] = [Grant(h.conn, h.engine_id, h.epoch, p.resumed, waited, p.reissued)]
    # Resumes of an older grant can never succeed any more: tell them now
    # rather than let them wait for a lock that is no longer theirs.
    keep: list[Waiter] = []
    for x in s.waiters:
        if x.resume_epoch is not None and x.resume_epoch < h.epoch:
            actions.append(Reject(x.conn, "superseded", _superseded(x.resume_epoch, h.epoch)))
        else:
            keep.append(x)
    return replace(s, waiters=tuple(keep), pending=None), actions


def _persist_failed(s: LockState, e: PersistFailed, now: float) -> Result:
    """Undo the grant: nothing was sent, so nobody holds the lock; the waiter
    keeps its place at the head of the queue and the grant is tried again."""
    assert s.pending is not None
    p = s.pending
    new = replace(
        s,
        phase=Phase.FREE,
        holder=None,
        epoch=p.epoch_before,
        last_holder=p.last_holder_before,
        waiters=(p.waiter, *s.waiters),
        pending=None,
    )
    return new, [ArmRetry(now + RETRY_S, e.reason)]


def _retry(s: LockState, e: RetryGrant, now: float) -> Result:
    if not s.waiters:
        return s, []
    return _release(s, now)


def _superseded(theirs: int, ours: int) -> str:
    return f"epoch {theirs} was superseded by epoch {ours}; the lock is lost"


def _next_waiter(s: LockState) -> Waiter | None:
    """FIFO, except that the last holder resuming its current grant goes first
    (its old connection died half-open and nobody was granted since)."""
    for w in s.waiters:
        if w.resume_epoch == s.epoch and w.engine_id == s.last_holder:
            return w
    return s.waiters[0] if s.waiters else None


def _release(s: LockState, now: float) -> Result:
    """The lock just became free (holder gone or window over): promote or clear."""
    s = replace(s, phase=Phase.FREE, holder=None, window=None)
    refused: list[Action] = []
    while (nxt := _next_waiter(s)) is not None:
        claim = _claim(s, nxt.engine_id, nxt.resume_epoch)
        if not isinstance(claim, Reject):
            new, actions = _grant(s, nxt, now)
            return new, [*refused, *actions]
        # Its claim went stale while it waited: tell it, and promote the next.
        refused.append(replace(claim, conn=nxt.conn))
        s = replace(s, waiters=tuple(w for w in s.waiters if w.conn != nxt.conn))
    return replace(s, phase=Phase.FREE), [*refused, Clear(s.epoch)]


def _refused(e: AcquireRequested, claim: Reject | str | None) -> Reject | None:
    if isinstance(claim, Reject):
        return replace(claim, conn=e.conn)
    return None


def _acquire_free(s: LockState, e: AcquireRequested, now: float) -> Result:
    if (why := _known(s, e.conn)) is not None:
        return s, [Reject(e.conn, "bad_request", f"this connection {why}")]
    if (no := _refused(e, _claim(s, e.engine_id, e.resume_epoch))) is not None:
        return s, [no]
    w = Waiter(e.conn, e.engine_id, e.resume_epoch, now)
    if s.waiters:  # a grant is being retried after a failed write: queue up
        return replace(s, waiters=(*s.waiters, w)), []
    return _grant(replace(s, waiters=(w,)), w, now)


def _acquire_held(s: LockState, e: AcquireRequested, now: float) -> Result:
    if (why := _known(s, e.conn)) is not None:
        return s, [Reject(e.conn, "bad_request", f"this connection {why}")]
    if (no := _refused(e, _claim(s, e.engine_id, e.resume_epoch))) is not None:
        return s, [no]
    w = Waiter(e.conn, e.engine_id, e.resume_epoch, now)
    return replace(s, waiters=(*s.waiters, w)), []


def _acquire_window(s: LockState, e: AcquireRequested, now: float) -> Result:
    assert s.window is not None
    if (why := _known(s, e.conn)) is not None:
        return s, [Reject(e.conn, "bad_request", f"this connection {why}")]
    w = Waiter(e.conn, e.engine_id, e.resume_epoch, now)
    claim = _claim(s, e.engine_id, e.resume_epoch)
    if s.window.holder is not None and e.engine_id == s.window.holder:
        if e.resume_epoch is not None and e.resume_epoch != s.window.epoch:
            return s, [replace(claim, conn=e.conn)] if isinstance(claim, Reject) else [
                Reject(e.conn, "superseded", _superseded(e.resume_epoch, s.window.epoch))
            ]
        # The persisted holder is back: same grant, same epoch, no failover.
        w = replace(w, resume_epoch=s.window.epoch)
        new, actions = _grant(replace(s, waiters=(*s.waiters, w)), w, now)
        return new, [WindowClosed("reclaimed"), *actions]
    if (no := _refused(e, claim)) is not None:
        return s, [no]
    if claim == "reissue":
        # The record was lost: the first engine that says it held the lock is
        # the one that did (only one can have), and keeps serving under a new
        # epoch instead of the pod losing its healthy Active engine.
        new, actions = _grant(replace(s, waiters=(*s.waiters, w)), w, now)
        return new, [WindowClosed("reclaimed"), *actions]
    return replace(s, waiters=(*s.waiters, w)), []


def _drop_waiter(s: LockState, conn: int) -> LockState:
    return replace(s, waiters=tuple(w for w in s.waiters if w.conn != conn))


def _disconnect_held(s: LockState, e: Disconnected, now: float) -> Result:
    if s.holder is not None and s.holder.conn == e.conn:
        return _release(s, now)
    return _drop_waiter(s, e.conn), []


def _disconnect_other(s: LockState, e: Disconnected, now: float) -> Result:
    return _drop_waiter(s, e.conn), []


def _window_timer(s: LockState, e: WindowExpired, now: float) -> Result:
    assert s.window is not None  # WINDOW always has one
    if now < s.window.deadline:
        raise InvalidTransition(
            f"WindowExpired {s.window.deadline - now:.6f}s before the deadline",
            s.phase,
            WindowExpired,
        )
    new, actions = _release(s, now)
    return new, [WindowClosed("expired"), *actions]


# --------------------------------------------------------------- table -----

P = Phase

# (phase, event type) -> (handler, phases it may lead to). A miss is an
# InvalidTransition: the shell fed an event this phase cannot take. A window
# ends in HELD when someone waits for the lock (the first waiter is granted),
# in FREE when nobody does. Timer events and holder reports that arrive after
# the window closed are stale, and change nothing.
TRANSITIONS: dict[tuple[Phase, type], Entry[LockState, Action, Phase]] = {
    (P.INIT, Restored): Entry(_restored, frozenset({P.FREE, P.WINDOW})),
    (P.INIT, Connected): Entry(_noop, frozenset({P.INIT})),
    (P.FREE, Connected): Entry(_noop, frozenset({P.FREE})),
    (P.FREE, AcquireRequested): Entry(_acquire_free, frozenset({P.FREE, P.HELD})),
    (P.FREE, Disconnected): Entry(_disconnect_other, frozenset({P.FREE})),
    (P.FREE, WindowExpired): Entry(_noop, frozenset({P.FREE})),
    (P.HELD, Connected): Entry(_noop, frozenset({P.HELD})),
    (P.HELD, AcquireRequested): Entry(_acquire_held, frozenset({P.HELD})),
    (P.HELD, Disconnected): Entry(_disconnect_held, frozenset({P.HELD, P.FREE})),
    (P.HELD, WindowExpired): Entry(_noop, frozenset({P.HELD})),
    (P.WINDOW, Connected): Entry(_noop, frozenset({P.WINDOW})),
    (P.WINDOW, AcquireRequested): Entry(_acquire_window, frozenset({P.WINDOW, P.HELD})),
    (P.WINDOW, Disconnected): Entry(_disconnect_other, frozenset({P.WINDOW})),
    (P.WINDOW, WindowExpired): Entry(_window_timer, frozenset({P.HELD, P.FREE})),
    (P.WINDOW, HolderGone): Entry(_holder_gone, frozenset({P.HELD, P.FREE})),
    (P.FREE, HolderGone): Entry(_noop, frozenset({P.FREE})),
    (P.HELD, HolderGone): Entry(_noop, frozenset({P.HELD})),
    (P.HELD, Persisted): Entry(_persisted, frozenset({P.HELD})),
    (P.HELD, PersistFailed): Entry(_persist_failed, frozenset({P.FREE})),
    (P.FREE, RetryGrant): Entry(_retry, frozenset({P.FREE, P.HELD})),
    (P.HELD, RetryGrant): Entry(_noop, frozenset({P.HELD})),
    (P.WINDOW, RetryGrant): Entry(_noop, frozenset({P.WINDOW})),
}


def _phase(state: LockState, event: Event) -> Phase:
    return state.phase


def step(state: LockState, event: Event, now: float) -> Result:
    """Apply one event at ``now``. Raises InvalidTransition (state unchanged) on a miss."""
    return machine.run_step(TRANSITIONS, _phase, state, event, now, error=InvalidTransition)


def next_deadline(state: LockState) -> float | None:
    """When the shell must feed WindowExpired next, if at all."""
    return state.window.deadline if state.window is not None else None


@dataclass(frozen=True, slots=True)
class Snapshot:
    holder: str | None
    epoch: int
    waiters: tuple[str, ...]
    window_open: bool
    window_holder: str | None
    window_remaining_s: float | None


def snapshot(state: LockState, now: float) -> Snapshot:
    w = state.window
    return Snapshot(
        holder=state.holder.engine_id if state.holder else None,
        epoch=state.epoch,
        waiters=tuple(x.engine_id for x in state.waiters),
        window_open=w is not None,
        window_holder=w.holder if w else None,
        window_remaining_s=max(0.0, w.deadline - now) if w else None,
    )


def describe(action: Action) -> str:
    """Short name of an action for logs and metrics (exhaustive by construction)."""
    match action:
        case Grant():
            return "grant"
        case Persist():
            return "persist"
        case Clear():
            return "clear"
        case Reject():
            return "reject"
        case WindowOpened():
            return "window_opened"
        case WindowClosed():
            return "window_closed"
        case ArmRetry():
            return "arm_retry"
        case _:
            assert_never(action)
