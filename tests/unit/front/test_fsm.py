"""The front's routing machine and request verdicts, with no event loop."""

from __future__ import annotations

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


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize(
    "event", [HolderSeen(A, 1), HolderSeen(None, 1), Hung(A, 2.0), Served(A)], ids=repr
)
def test_every_pair_is_in_the_table_and_lands_in_a_declared_phase(
    phase: Phase, event: fsm.Event
) -> None:
    s = routed(A, 1) if phase is Phase.ROUTING else FrontState()
    new, _ = step(s, event, 1.0)
    assert new.phase in fsm.TRANSITIONS[(phase, type(event))].targets


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
