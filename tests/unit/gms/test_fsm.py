"""The GMS lock core: every (phase, event) pair, the grant rules, scenarios."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import get_args, get_origin

import pytest

from understudy.gms import fsm
from understudy.gms import messages as m
from understudy.gms.fsm import Phase, kv, weights
from understudy.gms.layout import AllocationRecord, MetadataRecord, canonical_json, layout_hash
from understudy.gms.messages import ErrorCode, LocalGmsError, LockState, Mode
from understudy.wire.machine import Entry, InvalidTransition

INFO = fsm.ServerInfo(device=0, tag="weights", backend="host", granularity=4096)
S = 1  # the session under test
OTHER = 9


def run(
    state: fsm.GmsState, *events: fsm.Event, now: float = 0.0
) -> tuple[fsm.GmsState, list[fsm.Action]]:
    actions: list[fsm.Action] = []
    for ev in events:
        state, more = fsm.step(state, ev, now)
        actions.extend(more)
    return state, actions


def req(sid: int, request: m.Request) -> fsm.Received:
    return fsm.Received(sid, request)


def hello(sid: int, mode: Mode, timeout: float = 5.0) -> fsm.Received:
    return req(sid, m.Hello(mode=mode, timeout_s=timeout))


def replies(actions: list[fsm.Action], sid: int | None = None) -> list[object]:
    return [
        a.message for a in actions if isinstance(a, fsm.Reply) and (sid is None or a.sid == sid)
    ]


def committed_state() -> fsm.GmsState:
    """OTHER wrote one allocation and a metadata key, committed, and left."""
    st, _ = run(
        fsm.initial_state(INFO),
        fsm.Connected(OTHER),
        hello(OTHER, Mode.RW),
        req(OTHER, m.Allocate(size=100)),
        req(OTHER, m.PutMetadata(key="k", value={"offset": 0})),
        req(OTHER, m.Commit()),
        fsm.Disconnected(OTHER),
    )
    return st


ADOPTED = layout_hash(
    (AllocationRecord(0, 4096, 100, "weights"),),
    (MetadataRecord("k", canonical_json({"offset": 0})),),
)


def adopt(sid: int, digest: str = ADOPTED) -> fsm.Received[m.Request]:
    return req(sid, m.Hello(mode=Mode.ADOPT, timeout_s=5.0, layout_hash=digest))


def orphaned_state(digest: str = ADOPTED, deadline: float = 10.0) -> fsm.GmsState:
    """A GMS that restarted over the record of layout ``digest``."""
    return fsm.initial_state(INFO, fsm.Orphan(digest, deadline))


def kv_ask(
    sid: int, epoch: int, client: str, timeout: float = 5.0, size: int = 100
) -> fsm.Received:
    return req(sid, m.KvAcquire(epoch=epoch, size=size, spec="s", timeout_s=timeout, client=client))


def kv_peek(sid: int, size: int = 100, spec: str = "s") -> fsm.Received:
    return req(sid, m.KvPeek(size=size, spec=spec, client="standby"))


def kv_checked(sid: int, holder: str | None, epoch: int) -> fsm.LockChecked:
    return fsm.LockChecked(sid, fsm.LockWord(holder, epoch))


def kv_held_by_other(epoch: int = 5) -> fsm.GmsState:
    """OTHER, the lock's holder under ``epoch``, maps the KV pool."""
    st, _ = run(
        fsm.initial_state(INFO),
        fsm.Connected(OTHER),
        kv_ask(OTHER, epoch, "old"),
        kv_checked(OTHER, "old", epoch),
    )
    return st


def state_in(phase: Phase) -> fsm.GmsState:
    """A state where session S is in ``phase``, with allocation 0 and key "k"
    present whenever S could see them (for the KV phases: the pool is
    allocation 0)."""
    base = fsm.initial_state(INFO)
    if phase is Phase.NONE:
        return base
    if phase is Phase.KV_CHECKING:
        return run(base, fsm.Connected(S), kv_ask(S, 7, "e"))[0]
    if phase is Phase.KV:
        return run(base, fsm.Connected(S), kv_ask(S, 7, "e"), kv_checked(S, "e", 7))[0]
    if phase is Phase.KV_READING:
        return run(kv_held_by_other(), fsm.Connected(S), kv_peek(S))[0]
    if phase is Phase.KV_WAITING:
        return run(kv_held_by_other(), fsm.Connected(S), kv_ask(S, 7, "e"), kv_checked(S, "e", 7))[
            0
        ]
    if phase is Phase.PENDING:
        return run(base, fsm.Connected(S))[0]
    if phase is Phase.WAITING:
        return run(base, fsm.Connected(S), hello(S, Mode.RO))[0]
    if phase is Phase.RW:
        return run(
            base,
            fsm.Connected(S),
            hello(S, Mode.RW),
            req(S, m.Allocate(size=100)),
            req(S, m.PutMetadata(key="k", value={"offset": 0})),
        )[0]
    if phase is Phase.ADOPTING:  # the restarted GMS has one allocation and the key back
        return run(
            orphaned_state(),
            fsm.Connected(S),
            adopt(S),
            req(S, m.AdoptAllocation(size=100)),
            req(S, m.PutMetadata(key="k", value={"offset": 0})),
        )[0]
    return run(committed_state(), fsm.Connected(S), hello(S, Mode.RO))[0]


EVENTS: dict[type, Callable[[], fsm.Event]] = {
    fsm.Connected: lambda: fsm.Connected(S),
    fsm.Disconnected: lambda: fsm.Disconnected(S),
    fsm.Expire: lambda: fsm.Expire(S),
    fsm.CreateFailed: lambda: fsm.CreateFailed(S, 0, "no memory"),
    m.Hello: lambda: hello(S, Mode.RW_OR_RO),
    m.Allocate: lambda: req(S, m.Allocate(size=1)),
    m.AdoptAllocation: lambda: req(S, m.AdoptAllocation(size=1)),
    fsm.AdoptionOver: fsm.AdoptionOver,
    m.Export: lambda: req(S, m.Export(id=0)),
    m.ExportMany: lambda: req(S, m.ExportMany(ids=(0,))),
    m.ListAllocations: lambda: req(S, m.ListAllocations()),
    m.PutMetadata: lambda: req(S, m.PutMetadata(key="x", value={})),
    m.GetMetadata: lambda: req(S, m.GetMetadata(key="k")),
    m.ListMetadata: lambda: req(S, m.ListMetadata()),
    m.Commit: lambda: req(S, m.Commit()),
    m.GetLayoutHash: lambda: req(S, m.GetLayoutHash()),
    m.GetState: lambda: req(S, m.GetState()),
    m.KvAcquire: lambda: kv_ask(S, 7, "e"),
    m.KvPeek: lambda: kv_peek(S),
    fsm.LockChecked: lambda: kv_checked(S, "e", 7),
}

P = Phase
# The two protocols' tables; ``fsm.step`` sends an event to the one holding its pair.
TABLES = (weights.TRANSITIONS, kv.TRANSITIONS)


def entry_for(phase: Phase, kind: type) -> Entry[fsm.GmsState, fsm.Action, Phase] | None:
    for table in TABLES:
        if (phase, kind) in table:
            return table[(phase, kind)]
    return None


def event_kinds() -> set[type]:
    """Every kind ``step`` can be fed, from the event union itself: a request's
    kind is its message class."""
    kinds: set[type] = set()
    for k in get_args(fsm.Event):
        if get_origin(k) is fsm.Received:
            (requests,) = get_args(k)  # Annotated[Hello | Allocate | ..., discriminator]
            kinds |= set(get_args(get_args(requests)[0]))
        else:
            kinds.add(k)
    return kinds


def test_event_builders_cover_every_kind() -> None:
    assert set(EVENTS) == event_kinds()
    assert {k for table in TABLES for _, k in table} <= set(EVENTS)


def test_the_two_protocols_share_no_pair() -> None:
    """So which core an event goes to is the tables' to say, never a tie."""
    assert not set(weights.TRANSITIONS) & set(kv.TRANSITIONS)


def landing(phase: Phase, kind: type) -> tuple[Phase, Phase]:
    """Step S in ``phase`` with the sample event of ``kind``: (before, after)."""
    state = state_in(phase)
    new, _ = fsm.step(state, EVENTS[kind](), 0.0)
    return state.phase(S), new.phase(S)


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
@pytest.mark.parametrize("kind", list(EVENTS), ids=lambda k: k.__name__)
def test_every_phase_event_pair(phase: Phase, kind: type) -> None:
    """A pair a table holds lands in a phase its entry declares; any other
    raises (Refused for a peer's request) and leaves the state as it was."""
    state = state_in(phase)
    assert state.phase(S) is phase
    event = EVENTS[kind]()
    if kind is fsm.AdoptionOver:  # no session's: every session stays where it is
        new, _ = fsm.step(state, event, 0.0)
        assert new.phase(S) is phase
        return
    entry = entry_for(phase, kind)
    if entry is not None:
        new, _ = fsm.step(state, event, 0.0)
        assert new.phase(S) in entry.targets
        return
    expected = fsm.Refused if isinstance(event, fsm.Received) else fsm.InvalidTransition
    with pytest.raises(expected) as info:
        fsm.step(state, event, 0.0)
    assert state == state_in(phase)
    if isinstance(info.value, fsm.Refused):
        assert info.value.code is ErrorCode.REFUSED
    else:
        assert (info.value.phase, info.value.kind) == (phase, kind)


# The other landings of the entries with several targets, by scenario: (the
# state S is in, the event, now). Where S lands is observed, not written here.
WITNESSES: list[Callable[[], tuple[fsm.GmsState, fsm.Event, float]]] = [
    lambda: (state_in(P.PENDING), hello(S, Mode.RO), 0.0),  # nothing committed: wait
    lambda: (run(committed_state(), fsm.Connected(S))[0], hello(S, Mode.RO), 0.0),
    lambda: (run(orphaned_state(), fsm.Connected(S))[0], adopt(S), 0.0),
    lambda: (state_in(P.WAITING), fsm.Expire(S), 5.0),  # at the deadline
    lambda: (state_in(P.KV_WAITING), fsm.Expire(S), 5.0),
    lambda: (  # an older holder maps the pool: wait for its end
        run(kv_held_by_other(), fsm.Connected(S), kv_ask(S, 7, "e"))[0],
        kv_checked(S, "e", 7),
        0.0,
    ),
    lambda: (state_in(P.KV_CHECKING), kv_checked(S, "someone", 7), 0.0),  # not the holder
    lambda: (run(kv_held_by_other(), fsm.Connected(S))[0], kv_peek(S), 0.0),  # a pool to map
]


def test_every_declared_target_is_reached() -> None:
    """No entry declares a phase its handler never leads to (a table that says
    "any" draws edges the machine never takes): the sample events and the
    witnesses, run, reach every target of every entry."""
    reached: dict[tuple[Phase, type], set[Phase]] = {}
    for phase in Phase:
        for kind in EVENTS:
            if entry_for(phase, kind) is not None:
                before, after = landing(phase, kind)
                reached.setdefault((before, kind), set()).add(after)
    for witness in WITNESSES:
        state, event, now = witness()
        new, _ = fsm.step(state, event, now)
        reached.setdefault((state.phase(S), fsm.kind_of(event)), set()).add(new.phase(S))
    for table in TABLES:
        for key, entry in table.items():
            assert reached.get(key, set()) == set(entry.targets), key


def test_a_state_is_frozen_so_a_refused_step_cannot_have_changed_it() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        state_in(Phase.RW).committed = True  # type: ignore[misc]


def test_a_shell_bug_is_a_local_error_and_a_shared_invalid_transition() -> None:
    state = state_in(Phase.PENDING)
    with pytest.raises(fsm.InvalidTransition) as info:
        fsm.step(state, fsm.Connected(S), 0.0)  # the session is already connected
    assert isinstance(info.value, LocalGmsError) and isinstance(info.value, InvalidTransition)
    assert (info.value.phase, info.value.kind) == (Phase.PENDING, fsm.Connected)


def test_the_shells_machine_keeps_its_state_when_a_step_raises() -> None:
    machine = fsm.Machine(state_in(Phase.PENDING))
    before = machine.state
    with pytest.raises(fsm.Refused):
        machine.feed(req(S, m.Commit()), 0.0)
    with pytest.raises(fsm.InvalidTransition):
        machine.feed(fsm.Connected(S), 0.0)
    assert machine.state is before


def test_rw_only_operations_are_refused_to_ro_with_a_clear_message() -> None:
    state = state_in(Phase.RO)
    for request in (m.Allocate(size=1), m.Commit(), m.PutMetadata(key="a", value={})):
        with pytest.raises(fsm.Refused, match="RW-only"):
            fsm.step(state, req(S, request), 0.0)


def lock_state_fixture(ls: LockState) -> fsm.GmsState:
    base = fsm.initial_state(INFO)
    if ls is LockState.EMPTY:
        return base
    if ls is LockState.ORPHANED:
        return orphaned_state()
    if ls is LockState.RW:
        return run(base, fsm.Connected(OTHER), hello(OTHER, Mode.RW))[0]
    if ls is LockState.COMMITTED:
        return committed_state()
    return run(committed_state(), fsm.Connected(OTHER), hello(OTHER, Mode.RO))[0]


# The rules, written out independently of fsm.GRANT_RULES: RW only with
# no writer and no readers; RO only when committed with no writer; RW_OR_RO
# takes RW only if free and nothing committed, else waits for RO.
EXPECTED_GRANT: dict[tuple[LockState, Mode], Phase] = {
    (LockState.EMPTY, Mode.RW): Phase.RW,
    (LockState.EMPTY, Mode.RO): Phase.WAITING,
    (LockState.EMPTY, Mode.RW_OR_RO): Phase.RW,
    (LockState.RW, Mode.RW): Phase.WAITING,
    (LockState.RW, Mode.RO): Phase.WAITING,
    (LockState.RW, Mode.RW_OR_RO): Phase.WAITING,
    (LockState.COMMITTED, Mode.RW): Phase.RW,
    (LockState.COMMITTED, Mode.RO): Phase.RO,
    (LockState.COMMITTED, Mode.RW_OR_RO): Phase.RO,
    (LockState.RO, Mode.RW): Phase.WAITING,
    (LockState.RO, Mode.RO): Phase.RO,
    (LockState.RO, Mode.RW_OR_RO): Phase.RO,
    # Re-adoption: everyone waits for the orphaned layout's adopter; an
    # adopter re-creates a layout where there is none, or re-attaches RO to
    # the same one.
    (LockState.ORPHANED, Mode.RW): Phase.WAITING,
    (LockState.ORPHANED, Mode.RO): Phase.WAITING,
    (LockState.ORPHANED, Mode.RW_OR_RO): Phase.WAITING,
    (LockState.ORPHANED, Mode.ADOPT): Phase.ADOPTING,
    (LockState.EMPTY, Mode.ADOPT): Phase.ADOPTING,
    (LockState.COMMITTED, Mode.ADOPT): Phase.RO,
    (LockState.RO, Mode.ADOPT): Phase.RO,
    (LockState.RW, Mode.ADOPT): Phase.PENDING,  # refused: a new layout is coming
}


@pytest.mark.parametrize("rule", list(EXPECTED_GRANT), ids=lambda r: f"{r[0]}-{r[1]}")
def test_grant_rules(rule: tuple[LockState, Mode]) -> None:
    ls, mode = rule
    state = lock_state_fixture(ls)
    assert fsm.lock_state(state) is ls
    state, _ = run(state, fsm.Connected(S))
    expected = EXPECTED_GRANT[rule]
    if mode is Mode.ADOPT:
        digest = ADOPTED if ls is LockState.ORPHANED else (state.layout_hash or ADOPTED)
        if expected is Phase.PENDING:
            with pytest.raises(fsm.Refused) as info:
                fsm.step(state, adopt(S, digest), 0.0)
            assert info.value.code is ErrorCode.STALE_LAYOUT
            return
        new, _ = fsm.step(state, adopt(S, digest), 0.0)
        assert new.phase(S) is expected
        return
    new, actions = run(state, hello(S, mode))
    assert new.phase(S) is expected
    if expected is Phase.WAITING:
        assert fsm.ArmTimer(S, 5.0) in actions


def test_grant_rules_cover_every_state_and_mode() -> None:
    assert set(fsm.GRANT_RULES) == {(s, md) for s in LockState for md in Mode}


def test_ro_waits_behind_a_waiting_writer() -> None:
    st = lock_state_fixture(LockState.RO)  # OTHER reads
    st, _ = run(st, fsm.Connected(2), hello(2, Mode.RW), fsm.Connected(S), hello(S, Mode.RO))
    assert st.phase(2) is Phase.WAITING and st.phase(S) is Phase.WAITING
    assert st.waiting_writers == 1
    st, actions = run(st, fsm.Disconnected(OTHER))  # last reader leaves: writer first
    assert st.phase(2) is Phase.RW and st.phase(S) is Phase.WAITING
    assert any(isinstance(a, fsm.ReleaseMemory) for a in actions)  # layout replaced
    assert st.allocations == () and not st.committed


def test_abort_releases_everything_and_wakes_rw_or_ro() -> None:
    st, _ = run(
        fsm.initial_state(INFO),
        fsm.Connected(OTHER),
        hello(OTHER, Mode.RW_OR_RO),
        req(OTHER, m.Allocate(size=10)),
        req(OTHER, m.Allocate(size=5000)),
        req(OTHER, m.PutMetadata(key="a", value={"x": 1})),
        fsm.Connected(S),
        hello(S, Mode.RW_OR_RO),
        fsm.Connected(2),
        hello(2, Mode.RO),
    )
    assert [a.size for a in st.allocations] == [4096, 8192]
    assert st.phase(S) is Phase.WAITING
    st, actions = run(st, fsm.Disconnected(OTHER), now=1.5)
    assert fsm.ReleaseMemory((0, 1)) in actions
    assert st.allocations == () and st.metadata == () and st.layout_hash is None
    assert st.phase(S) is Phase.RW  # the next RW_OR_RO loads
    assert st.phase(2) is Phase.WAITING  # RO keeps waiting for a commit
    grant = [a for a in actions if isinstance(a, fsm.Transition) and a.event == "grant"]
    assert grant[0].waited_s == 1.5


def test_commit_hashes_downgrades_and_grants_readers() -> None:
    st, _ = run(
        fsm.initial_state(INFO),
        fsm.Connected(OTHER),
        hello(OTHER, Mode.RW_OR_RO),
        req(OTHER, m.Allocate(size=10)),
        fsm.Connected(S),
        hello(S, Mode.RW_OR_RO),
    )
    st, actions = run(st, req(OTHER, m.Commit()))
    assert st.committed and st.layout_hash is not None
    assert st.phase(OTHER) is Phase.RO and st.phase(S) is Phase.RO
    assert m.Committed(layout_hash=st.layout_hash) in replies(actions, OTHER)
    ok = replies(actions, S)[0]
    assert isinstance(ok, m.HelloOk) and ok.layout_hash == st.layout_hash
    assert fsm.lock_state(st) is LockState.RO
    st, _ = run(st, fsm.Disconnected(OTHER), fsm.Disconnected(S))
    assert fsm.lock_state(st) is LockState.COMMITTED and len(st.allocations) == 1


def test_wait_expires_at_its_deadline_only() -> None:
    st, actions = run(fsm.initial_state(INFO), fsm.Connected(S), hello(S, Mode.RO, 2.0), now=10.0)
    assert fsm.ArmTimer(S, 12.0) in actions
    assert st.next_deadline() == 12.0
    early, actions = fsm.step(st, fsm.Expire(S), 11.0)
    assert early.phase(S) is Phase.WAITING and actions == [fsm.ArmTimer(S, 12.0)]
    late, actions = fsm.step(st, fsm.Expire(S), 12.0)
    assert late.phase(S) is Phase.PENDING and late.next_deadline() is None
    (err,) = replies(actions, S)
    assert isinstance(err, m.ErrorReply) and err.code is ErrorCode.TIMEOUT
    # A stale timer after a grant is a no-op.
    granted, _ = run(committed_state(), fsm.Connected(S), hello(S, Mode.RO))
    assert fsm.step(granted, fsm.Expire(S), 99.0) == (granted, [])


def test_zero_timeout_fails_at_once() -> None:
    st, _ = run(fsm.initial_state(INFO), fsm.Connected(S))
    with pytest.raises(fsm.Refused) as info:
        fsm.step(st, hello(S, Mode.RO, 0.0), 0.0)
    assert info.value.code is ErrorCode.TIMEOUT


def test_export_and_metadata_lookups() -> None:
    st = state_in(Phase.RO)
    _, actions = fsm.step(st, req(S, m.Export(id=0)), 0.0)
    assert actions == [fsm.SendExport(S, st.allocations[0], writable=False)]
    rw = state_in(Phase.RW)
    _, actions = fsm.step(rw, req(S, m.Export(id=0)), 0.0)
    assert actions == [fsm.SendExport(S, rw.allocations[0], writable=True)]
    with pytest.raises(fsm.Refused) as info:
        fsm.step(st, req(S, m.Export(id=12345)), 0.0)
    assert info.value.code is ErrorCode.NOT_FOUND
    with pytest.raises(fsm.Refused) as info:  # all or nothing
        fsm.step(st, req(S, m.ExportMany(ids=(0, 12345))), 0.0)
    assert info.value.code is ErrorCode.NOT_FOUND
    _, actions = fsm.step(st, req(S, m.ExportMany(ids=(0, 0))), 0.0)
    assert actions == [fsm.SendExport(S, st.allocations[0], writable=False)] * 2
    with pytest.raises(fsm.Refused) as info:
        fsm.step(st, req(S, m.GetMetadata(key="nope")), 0.0)
    assert info.value.code is ErrorCode.NOT_FOUND
    _, actions = fsm.step(st, req(S, m.GetMetadata(key="k")), 0.0)
    assert replies(actions) == [m.MetadataValue(key="k", value={"offset": 0})]


def test_create_failed_forgets_the_allocation() -> None:
    st = state_in(Phase.RW)
    st, actions = fsm.step(st, req(S, m.Allocate(size=1)), 0.0)
    (create,) = actions
    assert isinstance(create, fsm.CreateMemory)
    st, actions = fsm.step(st, fsm.CreateFailed(S, create.allocation.id, "ENOMEM"), 0.0)
    assert [a.id for a in st.allocations] == [0]
    (err,) = replies(actions)
    assert isinstance(err, m.ErrorReply) and err.code is ErrorCode.NO_MEMORY


def test_ids_are_never_reused_across_layouts() -> None:
    st = committed_state()
    st, _ = run(st, fsm.Connected(S), hello(S, Mode.RW), req(S, m.Allocate(size=1)))
    assert [a.id for a in st.allocations] == [1]


def test_report() -> None:
    st = lock_state_fixture(LockState.RO)
    rep = fsm.report(st)
    assert rep.state is LockState.RO and rep.committed and rep.allocations == 1
    assert rep.sessions[m.Granted.RO] == 1 and rep.bytes == 4096


def test_a_writer_with_a_stale_epoch_is_refused_and_nothing_changes() -> None:
    """The lock's epoch as a fencing token: once an engine of epoch 7 has said
    hello, one that still believes in epoch 5 may not take the write lock."""
    from understudy.gms import fsm as g
    from understudy.gms import messages as msgs

    state = g.initial_state(INFO)
    state, _ = g.step(state, g.Connected(1), 0.0)
    state, _ = g.step(state, g.Connected(2), 0.0)
    state, _ = g.step(
        state, g.Received(1, msgs.Hello(mode=msgs.Mode.RO, timeout_s=1, epoch=7)), 0.0
    )
    assert state.newest_epoch == 7
    with pytest.raises(g.Refused) as info:
        g.step(state, g.Received(2, msgs.Hello(mode=msgs.Mode.RW, timeout_s=1, epoch=5)), 0.0)
    assert info.value.code is msgs.ErrorCode.STALE_EPOCH
    # A current epoch, or none at all (an engine still loading), may write.
    ok, _ = g.step(
        state, g.Received(2, msgs.Hello(mode=msgs.Mode.RW_OR_RO, timeout_s=1, epoch=7)), 0.0
    )
    assert ok.newest_epoch == 7


# --- re-adoption: a GMS that restarted under an engine still serving --------


def _adopted(st: fsm.GmsState, sid: int = S) -> tuple[fsm.GmsState, list[fsm.Action]]:
    return run(
        st,
        fsm.Connected(sid),
        adopt(sid),
        req(sid, m.AdoptAllocation(size=100)),
        req(sid, m.PutMetadata(key="k", value={"offset": 0})),
        req(sid, m.Commit()),
        now=1.0,
    )


def test_an_orphaned_layout_is_given_back_and_the_waiters_get_it_unchanged() -> None:
    st, _ = run(orphaned_state(), fsm.Connected(2), hello(2, Mode.RW_OR_RO))
    assert st.phase(2) is Phase.WAITING  # no reload over a layout on its way back
    st, actions = _adopted(st)
    assert [a for a in actions if isinstance(a, fsm.AdoptMemory)] == [
        fsm.AdoptMemory(S, AllocationRecord(0, 4096, 100, "weights"))
    ]
    assert st.committed and st.layout_hash == ADOPTED and st.orphan is None
    assert st.phase(S) is Phase.RO and st.phase(2) is Phase.RO  # the waiter: RO, no load
    assert m.Committed(layout_hash=ADOPTED) in replies(actions, S)
    assert any(isinstance(a, fsm.Transition) and a.event == "adopt" for a in actions)


def test_an_adopter_must_commit_the_layout_it_announced() -> None:
    st, _ = run(
        orphaned_state(),
        fsm.Connected(S),
        adopt(S),
        req(S, m.AdoptAllocation(size=100)),
        req(S, m.PutMetadata(key="k", value={"offset": 1})),  # not what was committed
    )
    with pytest.raises(fsm.Refused) as info:
        fsm.step(st, req(S, m.Commit()), 0.0)
    assert info.value.code is ErrorCode.STALE_LAYOUT


@pytest.mark.parametrize("state", ["orphaned", "committed"])
def test_an_adopter_of_another_layout_is_refused(state: str) -> None:
    st = orphaned_state("f" * 64) if state == "orphaned" else committed_state()
    st, _ = run(st, fsm.Connected(S))
    with pytest.raises(fsm.Refused) as info:
        fsm.step(st, adopt(S, "e" * 64), 0.0)
    assert info.value.code is ErrorCode.STALE_LAYOUT


def test_a_layout_still_committed_is_reattached_not_sent_again() -> None:
    st = committed_state()
    st, actions = run(st, fsm.Connected(S), adopt(S, st.layout_hash or ""))
    assert st.phase(S) is Phase.RO and not any(isinstance(a, fsm.AdoptMemory) for a in actions)


def test_an_adopter_that_dies_halfway_leaves_the_pod_to_load_anew() -> None:
    st, _ = run(orphaned_state(), fsm.Connected(2), hello(2, Mode.RW_OR_RO))
    st, _ = run(st, fsm.Connected(S), adopt(S), req(S, m.AdoptAllocation(size=100)))
    st, actions = run(st, fsm.Disconnected(S))
    assert fsm.ReleaseMemory((0,)) in actions and st.allocations == () and st.orphan is None
    assert st.phase(2) is Phase.RW  # the primary loads the checkpoint: today's path


def test_the_adoption_window_ends_and_the_usual_rules_apply() -> None:
    st, _ = run(orphaned_state(deadline=10.0), fsm.Connected(2), hello(2, Mode.RW_OR_RO))
    early, actions = fsm.step(st, fsm.AdoptionOver(), 9.0)
    assert early.orphan is not None and actions == [fsm.ArmAdoptionTimer(10.0)]
    late, actions = fsm.step(st, fsm.AdoptionOver(), 10.0)
    assert late.orphan is None and late.phase(2) is Phase.RW
    assert any(isinstance(a, fsm.Transition) and a.event == "orphan_expired" for a in actions)
    # A late adopter finds nothing committed and no writer... only after the writer left.
    assert fsm.step(committed_state(), fsm.AdoptionOver(), 0.0)[1] == []  # stale timer


def test_an_adopter_with_a_stale_epoch_may_not_write() -> None:
    st, _ = run(
        orphaned_state(), fsm.Connected(2), req(2, m.Hello(mode=Mode.RO, timeout_s=1, epoch=9))
    )
    st, _ = run(st, fsm.Connected(S))
    stale = m.Hello(mode=Mode.ADOPT, timeout_s=1, epoch=8, layout_hash=ADOPTED)
    with pytest.raises(fsm.Refused) as info:
        fsm.step(st, req(S, stale), 0.0)
    assert info.value.code is ErrorCode.STALE_EPOCH


def test_adopt_goes_with_a_layout_hash_and_only_adopt() -> None:
    with pytest.raises(ValueError, match="layout_hash goes with mode ADOPT"):
        m.Hello(mode=Mode.ADOPT, timeout_s=1)
    with pytest.raises(ValueError, match="layout_hash goes with mode ADOPT"):
        m.Hello(mode=Mode.RO, timeout_s=1, layout_hash=ADOPTED)


# --- the KV pool: granted read-write to the lock's holder only, under its
# epoch, to one session at a time, and handed on as it is ---------------------


def grants(actions: list[fsm.Action]) -> list[fsm.GrantKv]:
    return [a for a in actions if isinstance(a, fsm.GrantKv)]


def refusal(actions: list[fsm.Action], sid: int = S) -> m.ErrorReply:
    (err,) = replies(actions, sid)
    assert isinstance(err, m.ErrorReply)
    return err


def test_the_holder_gets_a_new_pool_after_the_lock_is_read() -> None:
    st, actions = run(fsm.initial_state(INFO), fsm.Connected(S), kv_ask(S, 3, "e", size=5000))
    assert actions[-1] == fsm.ReadLock(S) and st.phase(S) is Phase.KV_CHECKING
    st, actions = run(st, kv_checked(S, "e", 3))
    (grant,) = grants(actions)
    assert grant.created and grant.previous_epoch is None
    assert grant.allocation.tag == "kv" and grant.allocation.size == 8192  # aligned
    assert st.phase(S) is Phase.KV and st.newest_epoch == 3
    assert st.kv is not None and (st.kv.holder, st.kv.holder_epoch) == (S, 3)
    assert st.allocations == ()  # not part of the weights' layout, nor of its hash


@pytest.mark.parametrize(
    ("word", "why"),
    [
        (fsm.LockWord("e", 4), "epoch 4"),  # the lock moved on
        (fsm.LockWord("someone", 3), "'someone'"),  # another engine holds it
        (fsm.LockWord(None, 3), "nobody holds"),  # released: the holder is gone
    ],
)
def test_anyone_but_the_holder_under_its_epoch_is_refused(word: fsm.LockWord, why: str) -> None:
    st, _ = run(fsm.initial_state(INFO), fsm.Connected(S), kv_ask(S, 3, "e"))
    st, actions = run(st, fsm.LockChecked(S, word))
    err = refusal(actions)
    assert err.code is ErrorCode.STALE_EPOCH and why in err.message
    assert st.phase(S) is Phase.PENDING and st.kv is None
    assert st.session(S) == fsm.Session(S, Phase.PENDING, since=0.0)


def test_without_the_locks_record_an_older_epoch_than_seen_is_refused() -> None:
    st, _ = run(
        fsm.initial_state(INFO),
        fsm.Connected(OTHER),
        req(OTHER, m.Hello(mode=Mode.RO, timeout_s=1, epoch=9)),
        fsm.Connected(S),
        kv_ask(S, 8, "e"),
    )
    st, actions = run(st, fsm.LockChecked(S, None, "no lock record"))
    assert refusal(actions).code is ErrorCode.STALE_EPOCH
    st, actions = run(st, kv_ask(S, 9, "e"), fsm.LockChecked(S, None, "no lock record"))
    assert grants(actions) and st.phase(S) is Phase.KV


def test_the_same_epoch_twice_is_refused_the_pool_is_never_mapped_twice() -> None:
    st = kv_held_by_other(epoch=5)
    st, actions = run(st, fsm.Connected(S), kv_ask(S, 5, "old"), kv_checked(S, "old", 5))
    assert refusal(actions).code is ErrorCode.STALE_EPOCH
    assert st.kv is not None and st.kv.holder == OTHER


def test_a_newer_epoch_waits_for_the_old_holders_end_and_gets_the_pool_as_it_was() -> None:
    st = kv_held_by_other(epoch=5)
    st, actions = run(st, fsm.Connected(S), kv_ask(S, 6, "e", timeout=2.0), kv_checked(S, "e", 6))
    assert st.phase(S) is Phase.KV_WAITING and fsm.ArmTimer(S, 2.0) in actions
    assert not grants(actions)
    st, actions = run(st, fsm.Disconnected(OTHER), now=0.5)  # the old holder's death
    (grant,) = grants(actions)
    assert not grant.created and grant.previous_epoch == 5
    assert not any(isinstance(a, fsm.ReleaseMemory) for a in actions)
    assert st.phase(S) is Phase.KV and st.kv is not None and st.kv.grants == 2
    kv_grant = [a for a in actions if isinstance(a, fsm.Transition) and a.event == "kv_grant"]
    assert kv_grant[0].waited_s == 0.5


def test_of_two_waiters_the_newest_epoch_gets_the_pool() -> None:
    st = kv_held_by_other(epoch=5)
    st, _ = run(
        st,
        fsm.Connected(S),
        kv_ask(S, 6, "a"),
        kv_checked(S, "a", 6),
        fsm.Connected(2),
        kv_ask(2, 7, "b"),
        kv_checked(2, "b", 7),
    )
    st, actions = run(st, fsm.Disconnected(OTHER))
    assert st.phase(2) is Phase.KV and st.phase(S) is Phase.PENDING
    assert refusal(actions, S).code is ErrorCode.STALE_EPOCH


def test_a_wait_for_the_pool_expires_at_its_deadline() -> None:
    st = kv_held_by_other(epoch=5)
    st, _ = run(st, fsm.Connected(S), kv_ask(S, 6, "e", timeout=2.0), kv_checked(S, "e", 6))
    early, actions = fsm.step(st, fsm.Expire(S), 1.0)
    assert early.phase(S) is Phase.KV_WAITING and actions == [fsm.ArmTimer(S, 2.0)]
    late, actions = fsm.step(st, fsm.Expire(S), 2.0)
    assert late.phase(S) is Phase.PENDING and refusal(actions).code is ErrorCode.TIMEOUT
    late, actions = fsm.step(late, fsm.Disconnected(OTHER), 3.0)
    assert not grants(actions) and late.kv is not None and late.kv.holder is None


def test_a_zero_timeout_does_not_wait() -> None:
    st = kv_held_by_other(epoch=5)
    st, actions = run(st, fsm.Connected(S), kv_ask(S, 6, "e", timeout=0), kv_checked(S, "e", 6))
    assert refusal(actions).code is ErrorCode.TIMEOUT and st.phase(S) is Phase.PENDING


def test_another_geometry_replaces_a_free_pool() -> None:
    st = kv_held_by_other(epoch=5)
    st, _ = run(st, fsm.Disconnected(OTHER))
    assert st.kv is not None
    old = st.kv.allocation
    st, actions = run(st, fsm.Connected(S), kv_ask(S, 6, "e", size=99999), kv_checked(S, "e", 6))
    assert fsm.ReleaseMemory((old.id,)) in actions
    (grant,) = grants(actions)
    assert grant.created and grant.allocation.id != old.id


def test_a_failed_create_forgets_the_pool() -> None:
    st, actions = run(fsm.initial_state(INFO), fsm.Connected(S), kv_ask(S, 1, "e"))
    st, actions = run(st, kv_checked(S, "e", 1))
    (grant,) = grants(actions)
    st, actions = run(st, fsm.CreateFailed(S, grant.allocation.id, "ENOMEM"))
    assert refusal(actions).code is ErrorCode.NO_MEMORY
    assert st.kv is None and st.phase(S) is Phase.PENDING
    with pytest.raises(fsm.InvalidTransition):
        run(kv_held_by_other(), fsm.CreateFailed(OTHER, 12345, "ENOMEM"))


def test_the_weights_being_replaced_leave_the_pool_alone() -> None:
    st = kv_held_by_other(epoch=5)
    st, actions = run(
        st,
        fsm.Connected(S),
        req(S, m.Hello(mode=Mode.RW, timeout_s=1)),
        req(S, m.Allocate(size=10)),
        fsm.Disconnected(S),  # a writer that dies aborts its layout
    )
    assert st.kv is not None and st.kv.holder == OTHER
    released = [a for a in actions if isinstance(a, fsm.ReleaseMemory)]
    assert released and st.kv.allocation.id not in released[0].ids


def test_the_report_shows_the_pool() -> None:
    st = kv_held_by_other(epoch=5)
    rep = fsm.report(st)
    assert rep.kv == m.KvReport(bytes=4096, spec="s", holder_epoch=5, last_epoch=5, grants=1)
    assert rep.bytes == 0  # the weights' bytes only
    st, _ = run(st, fsm.Disconnected(OTHER))
    assert fsm.report(st).kv == m.KvReport(
        bytes=4096, spec="s", holder_epoch=None, last_epoch=5, grants=1
    )


def test_a_reader_maps_the_pool_as_it_is_and_holds_nothing_up() -> None:
    st, actions = run(fsm.initial_state(INFO), fsm.Connected(S), kv_peek(S))
    err = refusal(actions)
    assert err.code is ErrorCode.NOT_FOUND and "no KV pool" in err.message
    assert st.phase(S) is Phase.PENDING
    st = kv_held_by_other(epoch=5)
    st, actions = run(st, fsm.Connected(S), kv_peek(S, spec="other"))
    assert refusal(actions).code is ErrorCode.NOT_FOUND and st.phase(S) is Phase.PENDING
    st, actions = run(st, kv_peek(S))
    (grant,) = grants(actions)
    assert not grant.writable and not grant.created and grant.previous_epoch == 5
    assert st.phase(S) is Phase.KV_READING and st.kv is not None and st.kv.holder == OTHER
    assert fsm.report(st).kv == m.KvReport(
        bytes=4096, spec="s", holder_epoch=5, last_epoch=5, grants=1, readers=1
    )
    # The holder's end hands the pool on to the next holder, not to the reader.
    st, actions = run(st, fsm.Disconnected(OTHER))
    assert not grants(actions) and st.kv is not None and st.kv.holder is None
    st, actions = run(st, fsm.Connected(2), kv_ask(2, 6, "e"), kv_checked(2, "e", 6))
    (grant,) = grants(actions)
    assert grant.writable and grant.previous_epoch == 5 and st.phase(S) is Phase.KV_READING
    st, _ = run(st, fsm.Disconnected(S))
    assert st.phase(S) is Phase.NONE and st.kv is not None and st.kv.holder == 2


def test_a_lock_check_without_a_request_is_a_shell_bug() -> None:
    st, _ = run(fsm.initial_state(INFO), fsm.Connected(S), kv_ask(S, 1, "e"))
    st = dataclasses.replace(st, sessions=(fsm.Session(S, Phase.KV_CHECKING),))
    with pytest.raises(fsm.InvalidTransition):
        fsm.step(st, kv_checked(S, "e", 1), 0.0)
