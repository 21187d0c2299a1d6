"""The front's routing machine and request verdicts, with no event loop."""

from __future__ import annotations

import typing
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from understudy.front import fsm
from understudy.front.fsm import (
    Attempt,
    FrontState,
    HolderSeen,
    Hung,
    Outcome,
    Phase,
    Policy,
    Route,
    Served,
    Verdict,
    step,
    verdict,
)
from understudy.wire import machine

A, B = "engine-primary/aa", "engine-shadow-1/bb"


def routed(engine: str = A, epoch: int = 1) -> FrontState:
    return FrontState(Phase.ROUTING, Route(engine, epoch), newest_epoch=epoch)


def test_first_grant_routes_without_a_failover() -> None:
    s, actions = step(FrontState(), HolderSeen(A, 1), 0.0)
    assert s == routed(A, 1)
    assert actions == [fsm.RouteTo(Route(A, 1), handover=False)]


def test_release_unroutes_and_starts_the_gap_then_next_grant_is_a_handover() -> None:
    s, actions = step(routed(), HolderSeen(None, 1), 10.0)
    assert (s.phase, s.route, s.lost_at) == (Phase.WAITING, None, 10.0)
    assert actions == [fsm.Unroute("released")]
    s, actions = step(s, HolderSeen(B, 2), 10.03)
    assert s.route == Route(B, 2) and s.lost_at == 10.0
    assert actions == [fsm.RouteTo(Route(B, 2), handover=True)]
    s, actions = step(s, Served(B), 10.05)
    assert s.lost_at is None
    assert actions == [fsm.GapEnded(pytest.approx(0.05))]


def test_direct_handover_starts_the_gap_when_it_is_seen() -> None:
    s, actions = step(routed(A, 1), HolderSeen(B, 2), 5.0)
    assert s.route == Route(B, 2) and s.lost_at == 5.0
    assert actions == [fsm.RouteTo(Route(B, 2), handover=True)]


def test_same_engine_new_epoch_is_not_a_failover() -> None:
    """A restarted lock server that re-grants the Active engine a new epoch."""
    s, actions = step(routed(A, 1), HolderSeen(A, 7), 5.0)
    assert s.route == Route(A, 7) and s.lost_at is None
    assert actions == [fsm.RouteTo(Route(A, 7), handover=False)]


def test_a_stale_epoch_is_never_routed() -> None:
    s0 = routed(B, 5)
    s, actions = step(s0, HolderSeen(A, 4), 1.0)
    assert s == s0
    assert actions == [fsm.IgnoredStale(A, 4, 5)]
    s, actions = step(replace(s0, phase=Phase.WAITING, route=None), HolderSeen(A, 3), 1.0)
    assert s.route is None


def test_hung_engine_is_unrouted_killed_and_never_routed_again() -> None:
    s, actions = step(routed(A, 3), Hung(A, 1.2), 20.0)
    assert s.phase is Phase.WAITING and s.condemned == A
    assert s.lost_at == pytest.approx(18.8)  # the gap started at its last heartbeat
    assert actions == [fsm.Unroute("hung"), fsm.Kill(A, "no heartbeat for 1.20s")]
    # The lock still names it until it dies: it stays unrouted.
    s2, actions = step(s, HolderSeen(A, 3), 20.01)
    assert s2.route is None and actions == []
    s3, actions = step(s2, HolderSeen(B, 4), 20.2)
    assert s3.route == Route(B, 4)
    assert actions == [fsm.RouteTo(Route(B, 4), handover=True)]


def test_hung_report_about_another_engine_changes_nothing() -> None:
    s0 = routed(B, 4)
    assert step(s0, Hung(A, 3.0), 1.0) == (s0, [])


# ------------------------------------------------------------ every pair --

Kind = fsm.Kind


def state_in(phase: Phase) -> FrontState:
    """Routing A at epoch 3 with a gap open (a handover not yet answered), or
    waiting after A was condemned, with epoch 3 seen."""
    if phase is Phase.ROUTING:
        return FrontState(Phase.ROUTING, Route(A, 3), newest_epoch=3, lost_at=0.5)
    return FrontState(Phase.WAITING, None, newest_epoch=3, lost_at=0.5, condemned=A)


# For every kind, an event that is judged so in ``phase`` (None: no event can
# be, since nothing is routed while waiting).
EVENTS: dict[Kind, dict[Phase, fsm.Event | None]] = {
    Kind.OLDER: {Phase.WAITING: HolderSeen(B, 2), Phase.ROUTING: HolderSeen(B, 2)},
    Kind.VACANT: {Phase.WAITING: HolderSeen(A, 4), Phase.ROUTING: HolderSeen(None, 3)},
    Kind.GRANTED: {Phase.WAITING: HolderSeen(B, 4), Phase.ROUTING: HolderSeen(B, 4)},
    Kind.CURRENT: {Phase.WAITING: None, Phase.ROUTING: HolderSeen(A, 3)},
    Kind.HUNG: {Phase.WAITING: None, Phase.ROUTING: Hung(A, 2.0)},
    Kind.HUNG_ELSEWHERE: {Phase.WAITING: Hung(A, 2.0), Phase.ROUTING: Hung(B, 2.0)},
    Kind.SERVED: {Phase.WAITING: None, Phase.ROUTING: Served(A)},
    Kind.SERVED_ELSEWHERE: {Phase.WAITING: Served(A), Phase.ROUTING: Served(B)},
}

# What each legal pair does: written out, not read from the table under test.
# Where it lands is the table's own declaration (each entry names one phase),
# which ``machine.run_step`` holds every handler to.
DOES: dict[tuple[Phase, Kind], list[fsm.Action]] = {
    (Phase.WAITING, Kind.OLDER): [fsm.IgnoredStale(B, 2, 3)],
    (Phase.ROUTING, Kind.OLDER): [fsm.IgnoredStale(B, 2, 3)],
    (Phase.WAITING, Kind.VACANT): [],
    (Phase.ROUTING, Kind.VACANT): [fsm.Unroute("released")],
    (Phase.WAITING, Kind.GRANTED): [fsm.RouteTo(Route(B, 4), handover=True)],
    (Phase.ROUTING, Kind.GRANTED): [fsm.RouteTo(Route(B, 4), handover=True)],
    (Phase.ROUTING, Kind.CURRENT): [],
    (Phase.ROUTING, Kind.HUNG): [fsm.Unroute("hung"), fsm.Kill(A, "no heartbeat for 2.00s")],
    (Phase.WAITING, Kind.HUNG_ELSEWHERE): [],
    (Phase.ROUTING, Kind.HUNG_ELSEWHERE): [],
    (Phase.ROUTING, Kind.SERVED): [fsm.GapEnded(0.5)],
    (Phase.WAITING, Kind.SERVED_ELSEWHERE): [],
    (Phase.ROUTING, Kind.SERVED_ELSEWHERE): [],
}


def lands(phase: Phase, k: Kind) -> Phase:
    """The one phase the table says ``(phase, k)`` leads to."""
    (target,) = fsm.TRANSITIONS[(phase, k)].targets
    return target


def test_the_event_list_covers_every_kind_and_phase() -> None:
    assert set(EVENTS) == set(Kind)
    assert all(set(by_phase) == set(Phase) for by_phase in EVENTS.values())
    made = {type(e) for by_phase in EVENTS.values() for e in by_phase.values() if e}
    assert made == set(typing.get_args(fsm.Event))


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
@pytest.mark.parametrize("k", list(Kind), ids=lambda k: k.name)
def test_every_phase_kind_pair(phase: Phase, k: Kind) -> None:
    """Each event is judged as its kind; a legal pair lands where the table
    declares, with the actions DOES lists; a pair without an entry is one no
    event can make."""
    event = EVENTS[k][phase]
    assert ((phase, k) in fsm.TRANSITIONS) is (event is not None)
    assert ((phase, k) in DOES) is (event is not None)
    if event is None:
        # Nothing is routed while waiting: every such event is judged "elsewhere".
        for candidate in (Hung(A, 2.0), Hung(B, 2.0), Served(A), HolderSeen(A, 3)):
            assert (phase, fsm.kind(state_in(phase), candidate)) in fsm.TRANSITIONS
        return
    s = state_in(phase)
    assert fsm.kind(s, event) is k
    new, actions = step(s, event, 1.0)
    assert (new.phase, actions) == (lands(phase, k), DOES[(phase, k)])
    assert (new.route is None) is (new.phase is Phase.WAITING)


def test_a_pair_without_an_entry_raises_and_returns_nothing() -> None:
    """The table is the contract: a judged kind the phase has no entry for is
    refused (here forced, since ``kind`` never makes one)."""
    s = state_in(Phase.WAITING)
    with pytest.raises(fsm.InvalidTransition) as info:
        machine.run_step(
            fsm.TRANSITIONS,
            lambda st, e: st.phase,
            s,
            Served(A),
            1.0,
            kind_of=lambda _: Kind.SERVED,
            error=fsm.InvalidTransition,
        )
    assert (info.value.phase, info.value.kind) == (Phase.WAITING, Kind.SERVED)


def test_ready_while_routing_or_within_the_hold() -> None:
    assert not fsm.ready(FrontState(), 0.0, 30.0)  # never had an engine
    assert fsm.ready(routed(), 0.0, 30.0)
    lost = FrontState(Phase.WAITING, None, 1, lost_at=100.0)
    assert fsm.ready(lost, 129.0, 30.0) and not fsm.ready(lost, 130.5, 30.0)


events = st.one_of(
    st.builds(HolderSeen, st.sampled_from([A, B, None]), st.integers(0, 20)),
    st.builds(Hung, st.sampled_from([A, B]), st.floats(1.0, 5.0)),
    st.builds(Served, st.sampled_from([A, B])),
)


@given(st.lists(events, max_size=40))
def test_routes_only_to_the_newest_epoch_and_never_to_a_condemned_engine(
    evs: list[fsm.Event],
) -> None:
    s, now, newest = FrontState(), 0.0, 0
    for e in evs:
        now += 0.01
        s, _ = step(s, e, now)
        if isinstance(e, HolderSeen):
            newest = max(newest, e.epoch)
        assert s.newest_epoch == newest
        if s.route is not None:
            assert s.route.epoch == newest
            assert s.route.engine_id != s.condemned
            assert s.phase is Phase.ROUTING
        else:
            assert s.phase is Phase.WAITING


P = Policy(hold_s=30, migration_limit=3)


@pytest.mark.parametrize(
    ("attempt", "outcome", "expected"),
    [
        (Attempt(False, False, 0), Outcome.ANSWERED, Verdict.RELAY),  # 2xx and 4xx alike
        (Attempt(False, False, 0), Outcome.NOT_ACTIVE, Verdict.WAIT),
        (Attempt(True, False, 2), Outcome.UNREACHABLE, Verdict.WAIT),
        (Attempt(False, False, 0), Outcome.BROKEN, Verdict.MIGRATE_NEW),
        (Attempt(True, False, 0), Outcome.BROKEN, Verdict.MIGRATE_NEW),
        (Attempt(True, True, 1), Outcome.BROKEN, Verdict.MIGRATE_ONGOING),
        (Attempt(True, True, 3), Outcome.BROKEN, Verdict.FAIL),  # migration limit
        (Attempt(False, False, 3), Outcome.BROKEN, Verdict.FAIL),
        (Attempt(False, True, 0), Outcome.BROKEN, Verdict.FAIL),  # a half-sent plain answer
        (Attempt(True, True, 1), Outcome.REJECTED, Verdict.FAIL),  # never a second answer
    ],
)
def test_verdicts(attempt: Attempt, outcome: Outcome, expected: Verdict) -> None:
    assert verdict(attempt, outcome, P) is expected


# ---------------------------------------------------- heartbeat judgement --

W = fsm.Watchdog(hang_after_s=1.0, check_s=0.1, stall_s=0.25)


@pytest.mark.parametrize(
    ("due", "now", "beat_at", "expected"),
    [
        (10.0, 10.0, 9.5, fsm.Beat.ALIVE),
        (10.0, 10.0, 9.0, fsm.Beat.ALIVE),  # exactly the limit: not yet
        (10.0, 10.01, 9.0, fsm.Beat.HUNG),
        (10.0, 10.25, 5.0, fsm.Beat.HUNG),  # late, but within the stall bound
        (10.0, 10.26, 5.0, fsm.Beat.STALLED),  # the front itself did not run
        (10.0, 12.0, 11.9, fsm.Beat.STALLED),  # no verdict either way
        (10.0, 10.0, None, fsm.Beat.UNKNOWN),  # no heartbeat written yet
        (10.0, 11.0, None, fsm.Beat.STALLED),
    ],
)
def test_judge_beat(due: float, now: float, beat_at: float | None, expected: fsm.Beat) -> None:
    judged = fsm.judge_beat(W, due, now, beat_at)
    assert judged.beat is expected
    assert judged.late_s == pytest.approx(now - due)
    if expected in (fsm.Beat.ALIVE, fsm.Beat.HUNG):
        assert beat_at is not None and judged.silent_s == pytest.approx(now - beat_at)


@pytest.mark.parametrize(
    ("silent", "working", "expected"),
    [
        (1.5, False, fsm.Beat.HUNG),
        (1.5, True, fsm.Beat.ALIVE),  # starved, not stopped: the longer limit
        (5.0, True, fsm.Beat.ALIVE),
        (5.01, True, fsm.Beat.HUNG),
    ],
)
def test_a_working_engine_gets_the_longer_limit(
    silent: float, working: bool, expected: fsm.Beat
) -> None:
    assert fsm.judge_beat(W, 10.0, 10.0, 10.0 - silent, working=working).beat is expected


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([], False),
        ([(9.9, 100), (10.0, 105)], False),  # no sample a window old yet
        ([(9.4, 100), (9.5, 100), (10.0, 100)], False),  # stopped
        ([(9.4, 100), (9.5, 100), (10.0, 101)], True),
        ([(9.5, 100), (9.9, 103), (10.0, 103)], True),  # worked inside the window
        ([(9.0, 90), (9.4, 100), (10.0, 100)], False),  # before the window only
    ],
)
def test_cpu_progressed(samples: list[tuple[float, int]], expected: bool) -> None:
    assert fsm.cpu_progressed(samples, 10.0) is expected


@given(
    st.floats(0, 1e6),
    st.floats(0, 10),
    st.one_of(st.none(), st.floats(0, 20)),
)
def test_a_late_check_never_condemns_and_a_punctual_one_judges_by_silence(
    due: float, late: float, ago: float | None
) -> None:
    now = due + late
    judged = fsm.judge_beat(W, due, now, None if ago is None else now - ago)
    if late > W.stall_s:
        assert judged.beat is fsm.Beat.STALLED
    elif ago is None:
        assert judged.beat is fsm.Beat.UNKNOWN
    else:
        assert (judged.beat is fsm.Beat.HUNG) is (judged.silent_s > W.hang_after_s)
