"""Invariants of the GMS lock under random event sequences (hypothesis)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from understudy.gms import fsm
from understudy.gms import messages as m
from understudy.gms.fsm import Phase
from understudy.gms.messages import LockState, Mode

INFO = fsm.ServerInfo(device=0, tag="weights", backend="host", granularity=4096)
SIDS = st.integers(min_value=1, max_value=6)


class GmsLock(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = fsm.initial_state(INFO)
        self.now = 0.0
        self.live_memory: set[int] = set()  # created and not released (the backend's view)
        self.committed_hashes: list[str] = []
        # The pod's lock, as its record would say: holder "e<epoch>" under epoch.
        self.lock_epoch = 0
        self.kv_grants: list[int] = []  # the epochs the pool was granted to, in order

    def feed(self, event: fsm.Event) -> list[fsm.Action] | None:
        try:
            self.state, actions = fsm.step(self.state, event, self.now)
        except (fsm.Refused, fsm.InvalidTransition):
            return None
        for a in actions:
            if isinstance(a, fsm.CreateMemory | fsm.AdoptMemory):
                assert a.allocation.id not in self.live_memory
                self.live_memory.add(a.allocation.id)
            elif isinstance(a, fsm.ReleaseMemory):
                assert set(a.ids) <= self.live_memory
                self.live_memory -= set(a.ids)
            elif isinstance(a, fsm.GrantKv):
                if a.created:
                    assert a.allocation.id not in self.live_memory
                    self.live_memory.add(a.allocation.id)
                session = self.state.session(a.sid)
                assert session is not None and session.kv is not None
                self.kv_grants.append(session.kv.epoch)
        return actions

    @rule(sid=SIDS)
    def connect(self, sid: int) -> None:
        self.feed(fsm.Connected(sid))

    @rule(sid=SIDS)
    def disconnect(self, sid: int) -> None:
        was_writer = self.state.phase(sid) is Phase.RW
        actions = self.feed(fsm.Disconnected(sid))
        if was_writer and actions is not None:
            # an abort leaves nothing behind
            assert self.state.allocations == () and self.state.metadata == ()
            assert not self.state.committed and self.live_memory == self.kv_memory()

    def kv_memory(self) -> set[int]:
        return set() if self.state.kv is None else {self.state.kv.allocation.id}

    @rule()
    def lock_moves_on(self) -> None:
        self.lock_epoch += 1

    @rule(sid=SIDS, behind=st.sampled_from([0, 0, 1]), size=st.sampled_from([100, 9000]))
    def kv_acquire(self, sid: int, behind: int, size: int) -> None:
        """The lock's current holder asks (or, ``behind`` > 0, an older one)."""
        epoch = max(0, self.lock_epoch - behind)
        request = m.KvAcquire(epoch=epoch, size=size, spec="s", timeout_s=1.0, client=f"e{epoch}")
        if self.feed(fsm.Received(sid, request)) is not None:
            word = fsm.LockWord(f"e{self.lock_epoch}", self.lock_epoch)
            self.feed(fsm.LockChecked(sid, word))

    @rule(
        sid=SIDS,
        mode=st.sampled_from([Mode.RW, Mode.RO, Mode.RW_OR_RO]),
        timeout=st.sampled_from([0.0, 0.5, 3.0]),
    )
    def hello(self, sid: int, mode: Mode, timeout: float) -> None:
        self.feed(fsm.Received(sid, m.Hello(mode=mode, timeout_s=timeout)))

    @rule(sid=SIDS, same=st.booleans())
    def adopt(self, sid: int, same: bool) -> None:
        """An engine giving a layout back: the committed one's, or another's."""
        digest = self.state.layout_hash if same and self.state.layout_hash else "a" * 64
        self.feed(fsm.Received(sid, m.Hello(mode=Mode.ADOPT, timeout_s=1.0, layout_hash=digest)))

    @rule(sid=SIDS, size=st.integers(min_value=1, max_value=20000))
    def adopt_allocation(self, sid: int, size: int) -> None:
        self.feed(fsm.Received(sid, m.AdoptAllocation(size=size)))

    @rule(sid=SIDS, size=st.integers(min_value=1, max_value=20000))
    def allocate(self, sid: int, size: int) -> None:
        self.feed(fsm.Received(sid, m.Allocate(size=size)))

    @rule(sid=SIDS, key=st.sampled_from(["a", "b"]), x=st.integers(0, 3))
    def put_metadata(self, sid: int, key: str, x: int) -> None:
        self.feed(fsm.Received(sid, m.PutMetadata(key=key, value={"x": x})))

    @rule(sid=SIDS)
    def commit(self, sid: int) -> None:
        if self.feed(fsm.Received(sid, m.Commit())) is not None:
            assert self.state.layout_hash is not None
            self.committed_hashes.append(self.state.layout_hash)

    @rule(sid=SIDS, alloc_id=st.integers(0, 8))
    def export(self, sid: int, alloc_id: int) -> None:
        actions = self.feed(fsm.Received(sid, m.Export(id=alloc_id)))
        if actions is not None:
            (send,) = actions
            assert isinstance(send, fsm.SendExport) and send.allocation.id in self.live_memory
            assert send.writable == (self.state.phase(sid) is Phase.RW)

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 5.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        for s in self.state.sessions:
            if s.deadline is not None and s.deadline <= self.now:
                self.feed(fsm.Expire(s.sid))

    @invariant()
    def never_rw_beside_another_session(self) -> None:
        writers = self.state.count(Phase.RW) + self.state.count(Phase.ADOPTING)
        assert writers <= 1
        if writers:
            assert self.state.count(Phase.RO) == 0
            assert not self.state.committed

    @invariant()
    def ro_only_after_commit(self) -> None:
        if self.state.count(Phase.RO):
            assert self.state.committed and self.state.layout_hash is not None

    @invariant()
    def backend_matches_the_records(self) -> None:
        assert {a.id for a in self.state.allocations} | self.kv_memory() == self.live_memory

    @invariant()
    def the_kv_pool_is_mapped_once_by_the_newest_epoch_granted(self) -> None:
        holders = [s for s in self.state.sessions if s.phase is Phase.KV]
        assert len(holders) <= 1
        pool = self.state.kv
        if holders:
            assert pool is not None and pool.holder == holders[0].sid
            assert holders[0].kv is not None and pool.holder_epoch == holders[0].kv.epoch
        else:
            assert pool is None or pool.holder is None
        # Grants never go back to an older epoch (the holder may map it again).
        assert all(a <= b for a, b in zip(self.kv_grants, self.kv_grants[1:], strict=False))
        assert all(s.phase is not Phase.KV_CHECKING for s in self.state.sessions)

    @invariant()
    def no_waiter_could_be_granted(self) -> None:
        for s in self.state.sessions:
            if s.phase is Phase.WAITING:
                assert s.mode is not None and s.deadline is not None
                assert s.deadline > self.now
                assert fsm.decide(self.state, s.mode) is fsm.Decision.WAIT

    @invariant()
    def derived_state_is_consistent(self) -> None:
        ls = fsm.lock_state(self.state)
        if ls is LockState.EMPTY:
            assert not self.state.committed and self.state.count(Phase.RW) == 0
        if ls is LockState.COMMITTED:
            assert self.state.count(Phase.RO) == 0


GmsLock.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestGmsLock = GmsLock.TestCase
