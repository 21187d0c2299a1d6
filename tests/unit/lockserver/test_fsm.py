"""The lock core, without an event loop: the table, every pair, the invariants."""

from __future__ import annotations

import itertools
import typing

import pytest
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from understudy.lockserver import fsm
from understudy.lockserver.fsm import (
    AcquireRequested,
    Clear,
    Connected,
    Disconnected,
    Grant,
    InvalidTransition,
    LockState,
    Persist,
    PersistedRecord,
    Phase,
    Reject,
    Restored,
    WindowExpired,
)

W = 10.0


def step(state, event, now):
    """The core as the shell drives it: a Persist is written (here: at once,
    successfully) and fed back as Persisted, whose actions follow it."""
    state, actions = fsm.step(state, event, now)
    if actions and isinstance(actions[-1], Persist):
        state, more = fsm.step(state, fsm.Persisted(), now)
        actions = [*actions, *more]
    return state, actions


# A state file that says nobody holds the lock (what every release writes).
NOBODY = PersistedRecord(None, 0)


def restored(record=NOBODY, corrupt=False, now=0.0, floor=0):
    return step(LockState(), Restored(record, corrupt, W, floor), now)


def grants(actions):
    return [a for a in actions if isinstance(a, Grant)]


# ---------------------------------------------------------------- phases --

NOW = 100.0  # past any window opened by state_in
SAMPLE_EVENTS = {
    Restored: Restored(NOBODY, False, W),
    Connected: Connected(1),
    AcquireRequested: AcquireRequested(1, "a"),
    Disconnected: Disconnected(1),
    WindowExpired: WindowExpired(),
    fsm.HolderGone: fsm.HolderGone("old", "its process 42 is gone"),
    fsm.Persisted: fsm.Persisted(),
    fsm.PersistFailed: fsm.PersistFailed("No space left on device (28)"),
    fsm.RetryGrant: fsm.RetryGrant(),
}


def state_in(phase: Phase, etype: type) -> LockState:
    """A state in ``phase``: for the write's outcome (Persisted, PersistFailed),
    HELD with its grant still being written, as the shell feeds them."""
    if phase is Phase.INIT:
        return LockState()
    if phase is Phase.FREE:
        return restored()[0]
    if phase is Phase.WINDOW:
        return restored(PersistedRecord("old", 4))[0]
    s, _ = fsm.step(restored()[0], AcquireRequested(9, "holder"), 0.0)
    assert s.pending is not None
    if etype in (fsm.Persisted, fsm.PersistFailed):
        return s
    return fsm.step(s, fsm.Persisted(), 0.0)[0]


PAIRS = list(itertools.product(Phase, SAMPLE_EVENTS))


def test_the_sample_events_cover_every_event_kind():
    assert set(SAMPLE_EVENTS) == set(typing.get_args(fsm.Event))
    assert {k for _, k in fsm.TRANSITIONS} <= set(SAMPLE_EVENTS)


@pytest.mark.parametrize(("phase", "etype"), PAIRS, ids=lambda x: getattr(x, "name", x))
def test_every_phase_event_pair(phase, etype):
    """A pair the table holds lands in a phase its entry declares; any other
    raises with the pair named. A refusal returns nothing, so the caller
    keeps the (frozen) state it had. Conn 1 is nobody the lock knows, "old"
    the window's holder; the window's deadline has passed at NOW."""
    state = state_in(phase, etype)
    assert state.phase is phase
    event = SAMPLE_EVENTS[etype]
    entry = fsm.TRANSITIONS.get((phase, etype))
    if entry is None:
        with pytest.raises(InvalidTransition) as info:
            fsm.step(state, event, NOW)
        assert (info.value.phase, info.value.kind) == (phase, etype)
    else:
        new, _ = fsm.step(state, event, NOW)
        assert new.phase in entry.targets


def failed_write():
    """FREE, with "b" first in line: its grant could not be written."""
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)
    s, _ = step(s, AcquireRequested(2, "b"), 0.0)
    s, _ = fsm.step(s, Disconnected(1), 1.0)
    return fsm.step(s, fsm.PersistFailed("No space left on device (28)"), 1.0)[0]


def window_with_a_waiter():
    return step(restored(PersistedRecord("old", 4))[0], AcquireRequested(1, "b"), 0.0)[0]


# The other landings of the entries with several targets, by scenario: (state,
# event). Where each lands is observed, not written here.
WITNESSES = [
    lambda: (LockState(), Restored(PersistedRecord("old", 4), False, W)),  # a holder to wait for
    lambda: (failed_write(), AcquireRequested(3, "c")),  # queues behind "b"
    lambda: (failed_write(), fsm.RetryGrant()),  # "b" is granted
    lambda: (state_in(Phase.HELD, Disconnected), Disconnected(9)),  # the holder leaves
    lambda: (state_in(Phase.WINDOW, AcquireRequested), AcquireRequested(1, "old")),
    lambda: (window_with_a_waiter(), WindowExpired()),  # the first waiter is granted
    lambda: (window_with_a_waiter(), fsm.HolderGone("old", "its process 42 is gone")),
]


def test_every_declared_target_is_reached():
    """No entry declares a phase its handler never leads to: the sample events
    and the witnesses, run, reach every target of every entry."""
    reached: dict[tuple[Phase, type], set[Phase]] = {}
    samples = [(state_in(p, k), SAMPLE_EVENTS[k]) for p, k in PAIRS]
    for state, event in [*samples, *(w() for w in WITNESSES)]:
        key = (state.phase, type(event))
        if key in fsm.TRANSITIONS:
            reached.setdefault(key, set()).add(fsm.step(state, event, NOW)[0].phase)
    for key, entry in fsm.TRANSITIONS.items():
        assert reached.get(key, set()) == set(entry.targets), key


def test_an_early_expiry_or_a_report_on_another_engine_is_refused():
    """The shell feeds WindowExpired only once the deadline is due, and
    HolderGone only for the holder its window waits for."""
    s, _ = restored(PersistedRecord("a", 7), now=0.0)
    with pytest.raises(InvalidTransition, match="before the deadline"):
        fsm.step(s, WindowExpired(), 9.999)
    with pytest.raises(InvalidTransition, match="waits for a"):
        fsm.step(s, fsm.HolderGone("someone-else", "pid gone"), 1.0)


# ------------------------------------------------------------- scenarios --


def test_first_boot_grants_at_once_and_persists_before_grant():
    s, _ = restored()
    s, actions = step(s, AcquireRequested(1, "a"), 0.0)
    assert actions[0] == Persist("a", 1)
    assert isinstance(actions[1], Grant) and actions[1].epoch == 1
    assert s.phase is Phase.HELD


def test_holder_disconnect_promotes_fifo_with_higher_epoch():
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)
    s, a2 = step(s, AcquireRequested(2, "b"), 1.0)
    s, a3 = step(s, AcquireRequested(3, "c"), 2.0)
    assert a2 == [] and a3 == []
    s, actions = step(s, Disconnected(1), 5.0)
    (g,) = grants(actions)
    assert (g.engine_id, g.epoch, g.waited_s) == ("b", 2, 4.0)
    s, actions = step(s, Disconnected(2), 6.0)
    assert grants(actions)[0].engine_id == "c"
    s, actions = step(s, Disconnected(3), 7.0)
    assert actions == [Clear(3)] and s.phase is Phase.FREE


def test_waiter_disconnect_leaves_queue():
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)
    s, _ = step(s, AcquireRequested(2, "b"), 0.0)
    s, _ = step(s, Disconnected(2), 0.0)
    assert s.waiters == ()
    s, actions = step(s, Disconnected(1), 0.0)
    assert actions == [Clear(1)]


def test_second_acquire_on_same_connection_is_refused_and_keeps_the_lock():
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)
    s2, actions = step(s, AcquireRequested(1, "a"), 0.0)
    assert s2 == s and isinstance(actions[0], Reject) and actions[0].code == "bad_request"


def test_window_regrants_persisted_holder_with_same_epoch():
    s, actions = restored(PersistedRecord("a", 7), now=100.0)
    assert s.phase is Phase.WINDOW and s.window.deadline == 110.0
    s, actions = step(s, AcquireRequested(1, "b"), 101.0)
    assert actions == [] and s.phase is Phase.WINDOW  # others wait
    s, actions = step(s, AcquireRequested(2, "a", resume_epoch=7), 102.0)
    (g,) = grants(actions)
    assert (g.engine_id, g.epoch, g.resumed) == ("a", 7, True)
    assert s.phase is Phase.HELD and s.window is None
    s, actions = step(s, Disconnected(2), 103.0)
    assert grants(actions)[0].epoch == 8  # b, strictly higher


def test_window_expiry_frees_then_next_acquire_wins_with_higher_epoch():
    s, _ = restored(PersistedRecord("a", 7), now=0.0)
    s, actions = step(s, WindowExpired(), 10.0)
    assert s.phase is Phase.FREE and Clear(7) in actions
    s, actions = step(s, AcquireRequested(1, "b"), 11.0)
    assert grants(actions)[0].epoch == 8


def test_window_expiry_promotes_first_waiter():
    s, _ = restored(PersistedRecord("a", 3), now=0.0)
    s, _ = step(s, AcquireRequested(1, "b"), 1.0)
    s, _ = step(s, AcquireRequested(2, "c"), 2.0)
    s, actions = step(s, WindowExpired(), 10.0)
    assert grants(actions)[0].engine_id == "b" and s.epoch == 4


def test_corrupt_file_opens_window_for_unknown_holder_and_raises_epoch_floor():
    s, actions = restored(corrupt=True, now=0.0, floor=1_000_000)
    assert s.phase is Phase.WINDOW and s.window.holder is None
    assert actions[0].corrupt
    s, actions = step(s, AcquireRequested(1, "anyone"), 1.0)
    assert actions == []  # nobody can be granted during the window
    s, actions = step(s, WindowExpired(), 10.0)
    assert grants(actions)[0].epoch == 1_000_001


def test_resume_of_superseded_epoch_is_refused():
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)  # epoch 1
    s, _ = step(s, Disconnected(1), 0.0)
    s, _ = step(s, AcquireRequested(2, "b"), 0.0)  # epoch 2
    s2, actions = step(s, AcquireRequested(3, "a", resume_epoch=1), 0.0)
    assert s2 == s and actions[0].code == "superseded"


def test_resume_after_quiet_drop_keeps_epoch():
    """A TCP hiccup: the holder's connection dropped and nobody else was granted."""
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)
    s, _ = step(s, Disconnected(1), 0.0)
    s, actions = step(s, AcquireRequested(2, "a", resume_epoch=1), 0.0)
    assert grants(actions)[0].epoch == 1 and grants(actions)[0].resumed


def test_a_claim_of_an_epoch_not_issued_to_that_engine_is_refused():
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)
    s, _ = step(s, Disconnected(1), 0.0)
    before = s
    # Epoch 1 was a's, not mallory's; epoch 2**40 was never issued at all.
    for claim in (1, 2**40):
        s, actions = step(before, AcquireRequested(2, "mallory", resume_epoch=claim), 0.0)
        assert s == before
        assert actions == [Reject(2, "bad_request", actions[0].message)]
        assert f"epoch {claim} was not issued to mallory" in actions[0].message
    # The engine it was issued to gets it back; a plain acquire gets a new one.
    s, actions = step(before, AcquireRequested(3, "a", resume_epoch=1), 0.0)
    assert [(g.epoch, g.resumed) for g in grants(actions)] == [(1, True)]
    s, actions = step(before, AcquireRequested(4, "mallory"), 0.0)
    assert [(g.epoch, g.resumed) for g in grants(actions)] == [(2, False)]


def test_lost_record_reissues_the_first_claim_under_a_new_epoch():
    """The double fault: a damaged state file and a restart. The Active engine
    that comes back is the one that held the lock (only one can have); it keeps
    it under a fresh epoch, and anyone else's claim is then superseded."""
    s, actions = restored(None, corrupt=True, floor=1000)
    assert s.phase is Phase.WINDOW and s.history_unknown
    s, actions = step(s, AcquireRequested(1, "a", resume_epoch=7), 0.5)
    g = grants(actions)
    assert [(x.epoch, x.resumed, x.reissued) for x in g] == [(1001, False, True)]
    assert s.phase is Phase.HELD and not s.history_unknown
    s, actions = step(s, AcquireRequested(2, "b", resume_epoch=5000), 0.6)
    assert actions[0].code == "bad_request"  # never issued by this server
    s, actions = step(s, AcquireRequested(3, "b", resume_epoch=9), 0.6)
    assert actions[0].code == "superseded"  # older than what it holds now


def test_a_missing_record_restarts_epochs_above_the_floor():
    """No file: a new pod, or a lost volume. A claimant gets the first turn for
    a second; after it, anyone."""
    s, _ = restored(None, floor=5000)
    assert (s.phase, s.epoch, s.history_unknown) == (Phase.WINDOW, 5000, True)
    assert s.window.deadline == fsm.NO_RECORD_WINDOW_S
    _, actions = step(s, AcquireRequested(1, "a", resume_epoch=3), 0.1)
    assert [(g.epoch, g.reissued) for g in grants(actions)] == [(5001, True)]
    s2, actions = step(s, AcquireRequested(2, "b"), 0.1)
    assert actions == []  # a plain acquire waits out the short window
    s2, actions = step(s2, WindowExpired(), 1.0)
    assert [(g.engine_id, g.epoch, g.reissued) for g in grants(actions)] == [("b", 5001, False)]


def test_a_failed_write_sends_no_grant_and_retries():
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)
    s, _ = step(s, AcquireRequested(2, "b"), 0.0)
    held = s
    # a dies; the grant to b cannot be written (a full volume).
    s, actions = fsm.step(held, Disconnected(1), 1.0)
    assert actions == [Persist("b", 2)]
    s, actions = fsm.step(s, fsm.PersistFailed("No space left on device (28)"), 1.0)
    assert actions == [fsm.ArmRetry(1.0 + fsm.RETRY_S, "No space left on device (28)")]
    assert (s.phase, s.holder, s.epoch) == (Phase.FREE, None, 1)
    assert [w.engine_id for w in s.waiters] == ["b"]  # still first in line
    # A newcomer queues behind it rather than jumping the line.
    s, actions = step(s, AcquireRequested(3, "c"), 1.05)
    assert actions == [] and [w.engine_id for w in s.waiters] == ["b", "c"]
    s, actions = step(s, fsm.RetryGrant(), 1.1)
    assert [(g.engine_id, g.epoch) for g in grants(actions)] == [("b", 2)]


def test_pending_resume_is_rejected_when_someone_else_is_granted():
    s, _ = restored()
    s, _ = step(s, AcquireRequested(1, "a"), 0.0)  # epoch 1
    s, _ = step(s, AcquireRequested(2, "b"), 0.0)
    # a's connection is half-open; a reconnects and queues a resume of epoch 1
    s, _ = step(s, AcquireRequested(3, "a", resume_epoch=1), 0.0)
    s, actions = step(s, Disconnected(1), 0.0)
    # a's resume goes first: it is the last holder resuming the current epoch
    assert grants(actions)[0].engine_id == "a" and grants(actions)[0].epoch == 1


# ------------------------------------------------------------ properties --


class LockMachine(RuleBasedStateMachine):
    """Random connects, acquires, resumes (honest and forged), disconnects,
    restarts with a good, missing or damaged file, a full volume, and timers."""

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.conns = itertools.count(1)
        self.state, _ = restored()
        self.persisted = PersistedRecord(None, 0)
        self.granted_epochs: list[int] = []
        self.issued: set[tuple[str, int]] = set()  # (engine, epoch) ever granted
        self.holder_grants: dict[int, tuple[str, int]] = {}  # conn -> (engine, epoch)
        self.disk_full = False
        self.retry_armed = False

    def apply(self, event):
        """Drive the core as the shell does, writing the state file for real
        (here: a record that a full volume refuses)."""
        before = self.state
        self.state, actions = fsm.step(self.state, event, self.now)
        if actions and isinstance(actions[-1], Persist):
            p = actions[-1]
            if self.disk_full:
                self.state, more = fsm.step(self.state, fsm.PersistFailed("full"), self.now)
            else:
                self.persisted = PersistedRecord(p.engine_id, p.epoch)
                self.state, more = fsm.step(self.state, fsm.Persisted(), self.now)
            actions = [*actions, *more]
        for a in actions:
            if isinstance(a, Clear) and not self.disk_full:
                self.persisted = PersistedRecord(None, a.epoch)
            elif isinstance(a, fsm.ArmRetry):
                self.retry_armed = True
                assert not any(isinstance(x, Grant) for x in actions)  # never half-made
            elif isinstance(a, Grant):
                # a waiter is granted only with no holder and no open window...
                assert (
                    before.holder is None
                    or before.holder.conn == a.conn
                    or (isinstance(event, Disconnected) and before.holder.conn == event.conn)
                )
                ends_window = isinstance(event, WindowExpired | fsm.HolderGone)
                if before.window is not None and not ends_window:
                    if before.window.holder is not None:
                        # ...during a window only the persisted holder, with its epoch
                        assert a.engine_id == before.window.holder
                        assert a.epoch == before.window.epoch
                    else:
                        assert a.reissued  # a lost record: only a claimant, re-granted
                if a.resumed:
                    # the server never grants an epoch it did not issue to that engine
                    assert (a.engine_id, a.epoch) in self.issued
                else:
                    assert all(a.epoch > e for e in self.granted_epochs)
                assert a.epoch <= fsm.MAX_EPOCH
                self.granted_epochs.append(a.epoch)
                self.issued.add((a.engine_id, a.epoch))
                self.holder_grants[a.conn] = (a.engine_id, a.epoch)
        return actions

    @rule(engine=st.sampled_from(["a", "b", "c"]))
    def acquire(self, engine):
        self.now += 0.1
        self.apply(AcquireRequested(next(self.conns), engine))

    @rule(data=st.data())
    def resume(self, data):
        assume(self.holder_grants)
        conn = data.draw(st.sampled_from(sorted(self.holder_grants)))
        engine, epoch = self.holder_grants[conn]
        self.now += 0.1
        self.apply(AcquireRequested(next(self.conns), engine, resume_epoch=epoch))

    @rule(engine=st.sampled_from(["a", "b", "mallory"]), epoch=st.integers(0, fsm.MAX_EPOCH))
    def forged_resume(self, engine, epoch):
        self.now += 0.1
        self.apply(AcquireRequested(next(self.conns), engine, resume_epoch=epoch))

    @rule(data=st.data())
    def disconnect(self, data):
        live = [w.conn for w in self.state.waiters]
        if self.state.holder:
            live.append(self.state.holder.conn)
        assume(live)
        conn = data.draw(st.sampled_from(live))
        self.now += 0.1
        self.apply(Disconnected(conn))

    @rule(dt=st.floats(0, 20))
    def time_passes(self, dt):
        """The shell's timer: WindowExpired once the deadline is due."""
        self.now += dt
        deadline = fsm.next_deadline(self.state)
        if deadline is not None and self.now >= deadline:
            self.apply(WindowExpired())

    @precondition(lambda self: self.state.window is not None)
    @rule()
    def holder_seen_gone(self):
        """The persisted holder's heartbeat, or (an unknown holder) every
        engine's, says it is gone."""
        w = self.state.window
        self.now += 0.05
        self.apply(fsm.HolderGone(w.holder, "gone"))

    @rule(full=st.booleans())
    def volume(self, full):
        self.disk_full = full

    @precondition(lambda self: self.retry_armed)
    @rule()
    def retry(self):
        self.now += fsm.RETRY_S
        self.retry_armed = False
        self.apply(fsm.RetryGrant())

    @rule(record=st.sampled_from(["kept", "missing", "damaged"]), sees=st.booleans())
    def server_restarts(self, record, sees):
        """Everything in memory is lost; only the persisted record survives.
        Engines that held grants are still alive and will claim them."""
        self.now += 0.5
        # The shell passes wall time in microseconds: it only rises, and far
        # faster than grants can be made.
        floor = 10**12 + int(self.now * 1_000_000)
        kept = self.persisted if record == "kept" else None
        self.state, _ = fsm.step(
            LockState(), Restored(kept, record == "damaged", W, floor, sees), self.now
        )
        self.retry_armed = False

    @invariant()
    def at_most_one_holder_and_consistent(self):
        s = self.state
        if s.phase is Phase.HELD:
            assert s.holder is not None and s.window is None
        else:
            assert s.holder is None
        if s.phase is Phase.FREE and not self.retry_armed:
            assert s.waiters == ()  # nobody waits for a free lock, but for a retry
        conns = [w.conn for w in s.waiters] + ([s.holder.conn] if s.holder else [])
        assert len(conns) == len(set(conns))
        if s.holder:
            assert s.holder.epoch == s.epoch
        assert s.pending is None  # the shell always settles a write at once

    @precondition(lambda self: self.state.phase is not Phase.INIT)
    @invariant()
    def persisted_matches_holder(self):
        if self.state.holder is not None:
            assert self.persisted == PersistedRecord(self.state.holder.engine_id, self.state.epoch)


TestLockMachine = LockMachine.TestCase
TestLockMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_snapshot_reports_window_then_holder():
    s, _ = restored(PersistedRecord("a", 2), now=0.0)
    snap = fsm.snapshot(s, 4.0)
    assert snap.window_open and snap.window_holder == "a" and snap.window_remaining_s == 6.0
    assert fsm.snapshot(s, 12.0).window_remaining_s == 0.0  # an overdue timer is not negative
    s, _ = step(s, AcquireRequested(1, "b"), 5.0)
    s, _ = step(s, AcquireRequested(2, "a", resume_epoch=2), 6.0)
    assert fsm.snapshot(s, 7.0) == fsm.Snapshot(
        holder="a",
        epoch=2,
        waiters=("b",),
        window_open=False,
        window_holder=None,
        window_remaining_s=None,
    )


def test_a_window_ends_early_when_its_holder_is_seen_gone():
    s, _ = restored(PersistedRecord("a", 4), now=0.0)
    s, _ = step(s, AcquireRequested(1, "b"), 0.1)
    assert s.phase is Phase.WINDOW
    s, actions = step(s, fsm.HolderGone("a", "its process 42 is gone"), 0.2)
    assert actions[0] == fsm.WindowClosed("holder_gone")
    assert [(g.engine_id, g.epoch) for g in grants(actions)] == [("b", 5)]


@pytest.mark.parametrize("corrupt", [True, False], ids=["damaged", "missing"])
def test_an_unknown_holder_is_waited_for_until_no_engine_holds_an_epoch(corrupt):
    """When the shell sees every engine's heartbeat, a lost record costs no
    guess: the window lasts while an engine of the pod holds an epoch (it may
    be the holder, and claims its grant back), and ends the moment none does."""
    s, actions = step(LockState(), Restored(None, corrupt, W, 5000, sees_claimants=True), 0.0)
    assert s.window == fsm.Window(None, 5000, W)  # the whole window, not the short guess
    s, actions = step(s, AcquireRequested(1, "b"), 0.5)
    assert actions == []
    s, actions = step(s, fsm.HolderGone(None, "no heartbeat holds an epoch"), 0.6)
    assert actions[0] == fsm.WindowClosed("holder_gone")
    assert [(g.engine_id, g.epoch, g.reissued) for g in grants(actions)] == [("b", 5001, False)]


def test_an_unknown_holder_that_claims_first_keeps_serving():
    s, _ = step(LockState(), Restored(None, True, W, 5000, sees_claimants=True), 0.0)
    s, actions = step(s, AcquireRequested(1, "a", resume_epoch=12), 0.2)
    assert [(g.engine_id, g.epoch, g.reissued) for g in grants(actions)] == [("a", 5001, True)]
