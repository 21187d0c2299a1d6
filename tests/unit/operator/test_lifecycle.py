"""The replica lifecycle: every (phase, event) pair, the limits and deadlines, the invariants.

Where a pair lands comes from the table (its entry's targets); what each event
means (its verdict, the reason of the move it causes) is written out here per
event kind, and every landing the table declares is run and seen to happen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import get_args

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from understudy.operator import lifecycle as lc
from understudy.operator.api import ReplicaPhase as P
from understudy.operator.conditions import Reason

V = lc.Verdict
# Distinct budgets, so a test can tell which one a phase is judged by.
POLICY = lc.Policy(
    bind_timeout=11, start_timeout=12, unknown_timeout=13, failed_backoff=14, drain_timeout=15
)
BUDGET_OF = {P.SCHEDULED: 11, P.STARTING: 12, P.UNKNOWN: 13, P.FAILED: 14, P.DRAINING: 15}
SINCE, NOW, ATTEMPT = 100.0, 105.0, 2  # NOW is within every budget


def sample(phase: P, **kw: object) -> lc.Replica:
    base = lc.Replica(
        index=0, phase=phase, attempt=ATTEMPT, retries=3, since=SINCE, node="n1", policy=POLICY
    )
    return replace(base, **kw)  # type: ignore[arg-type]


EVENTS: dict[type, Callable[[], lc.Event]] = {
    lc.Placed: lambda: lc.Placed(ATTEMPT, "placed", "n2"),
    lc.Unplaceable: lambda: lc.Unplaceable(ATTEMPT, "no feasible node"),
    lc.Fencing: lambda: lc.Fencing(ATTEMPT, "old pod terminating"),
    lc.PodPresent: lambda: lc.PodPresent(ATTEMPT, "pod present"),
    lc.PodLost: lambda: lc.PodLost(ATTEMPT, "pod is gone"),
    lc.NodeReady: lambda: lc.NodeReady(ATTEMPT, "node ready"),
    lc.NodeLost: lambda: lc.NodeLost(ATTEMPT, "node n1 lost"),
    lc.Bound: lambda: lc.Bound(ATTEMPT, "bound to n1"),
    lc.Unschedulable: lambda: lc.Unschedulable(ATTEMPT, "0/3 nodes are available"),
    lc.Unbound: lambda: lc.Unbound(ATTEMPT, "waiting for kube-scheduler"),
    lc.Started: lambda: lc.Started(ATTEMPT, "pod running"),
    lc.StartFailed: lambda: lc.StartFailed(ATTEMPT, "engine-primary: ImagePullBackOff"),
    lc.NotStarted: lambda: lc.NotStarted(ATTEMPT, "containers starting"),
    lc.NodeBack: lambda: lc.NodeBack(ATTEMPT, "node back"),
    lc.StillLost: lambda: lc.StillLost(ATTEMPT, "node n1 still lost"),
    lc.BackingOff: lambda: lc.BackingOff(ATTEMPT, "backing off"),
    lc.Drained: lambda: lc.Drained(ATTEMPT, "out of the Service's endpoints"),
    lc.NotDrained: lambda: lc.NotDrained(ATTEMPT, "still in the Service's endpoints"),
    lc.Reset: lc.Reset,
    lc.Drain: lc.Drain,
    lc.Delete: lc.Delete,
}
REPORTS = [k for k in EVENTS if issubclass(k, lc.Report)]

# What each event means in any phase that takes it: the verdict it records
# (None: no record) and the reason of the move it causes (None: the phase
# holds, as a failure under its limit or a wait within its budget does at NOW).
# Per kind, not per pair: which phases take it, and where it leads, is the
# table's to say.
MEANS: dict[type, tuple[V | None, Reason | None]] = {
    lc.Placed: (V.SUCCESS, Reason.PLACED),
    lc.Bound: (V.SUCCESS, Reason.BOUND),
    lc.Started: (V.SUCCESS, Reason.STARTED),
    lc.NodeBack: (V.SUCCESS, Reason.NODE_BACK),
    lc.Drained: (V.SUCCESS, Reason.DRAINED),
    lc.PodLost: (V.NEED_RETRY, Reason.POD_LOST),
    lc.NodeLost: (V.NEED_RETRY, Reason.NODE_LOST),
    **{k: (V.NEED_RETRY, None) for k in (lc.Unplaceable, lc.Unschedulable, lc.StartFailed)},
    **{
        k: (V.SKIPPED, None)
        for k in (lc.Fencing, lc.Unbound, lc.NotStarted, lc.StillLost, lc.BackingOff)
    },
    lc.NotDrained: (V.SKIPPED, None),
    lc.PodPresent: (None, None),  # a check that found nothing wrong
    lc.NodeReady: (None, None),
    **{k: (None, None) for k in (lc.Reset, lc.Drain, lc.Delete)},  # the planner's commands
}


def expected_landing(phase: P, kind: type) -> P:
    """A report that causes no move holds the phase; anything else goes to the
    one phase its entry declares besides those of a limit or a budget."""
    targets = lc.TRANSITIONS[(phase, kind)].targets
    if issubclass(kind, lc.Report) and MEANS[kind][1] is None:
        assert phase in targets
        return phase
    (to,) = targets
    return to


def records(actions: list[lc.Action]) -> list[lc.HistoryEntry]:
    return [a.entry for a in actions if isinstance(a, lc.Record)]


def test_event_builders_cover_every_kind() -> None:
    assert set(EVENTS) == set(get_args(lc.Event)) == set(MEANS)
    assert {k for _, k in lc.TRANSITIONS} <= set(EVENTS)


@pytest.mark.parametrize("phase", list(P), ids=str)
@pytest.mark.parametrize("kind", list(EVENTS), ids=lambda k: k.__name__)
def test_every_phase_event_pair(phase: P, kind: type) -> None:
    """Pairs the table holds land where their entry says and record what the
    event means; the rest raise."""
    rec = sample(phase)
    event = EVENTS[kind]()
    if (phase, kind) not in lc.TRANSITIONS:
        with pytest.raises(lc.InvalidTransition) as info:
            lc.step(rec, event, NOW)
        assert (info.value.phase, info.value.kind) == (phase, kind)
        return
    landing = expected_landing(phase, kind)
    verdict, reason = MEANS[kind]
    new, actions = lc.step(rec, event, NOW)
    assert new.phase is landing
    moved = landing is not phase
    assert new.since == (NOW if moved else SINCE)
    assert new.attempt == (ATTEMPT + 1 if kind is lc.Placed else ATTEMPT)
    assert new.node == ("n2" if kind is lc.Placed else "n1")
    if moved:
        assert new.retries == 0
    elif verdict is V.NEED_RETRY:
        assert new.retries == 4  # one more failure
    elif verdict is V.SKIPPED:
        assert new.retries == 3  # waiting counts nothing
    else:
        assert new.retries == 0  # a success clears the count
    got = records(actions)
    if verdict is None:
        assert got == []
        return
    assert got == [
        lc.HistoryEntry(
            time=NOW,
            replica=0,
            attempt=ATTEMPT,
            check=kind.check,
            verdict=verdict,
            reason=reason,
            phase=landing,
            message=event.message,  # type: ignore[union-attr]
        )
    ]


def test_only_placement_creates_a_pod() -> None:
    _, actions = lc.step(sample(P.PENDING), EVENTS[lc.Placed](), NOW)
    assert [a for a in actions if isinstance(a, lc.CreatePod)] == [
        lc.CreatePod(index=0, attempt=ATTEMPT + 1, node="n2")
    ]
    for phase, kind in lc.TRANSITIONS:
        if kind is not lc.Placed:
            _, actions = lc.step(sample(phase), EVENTS[kind](), NOW)
            assert not any(isinstance(a, lc.CreatePod) for a in actions), (phase, kind)


# Failures in a row before a check gives up; where the replica goes then is
# the other phase its entry declares.
GIVES_UP = {
    (P.PENDING, lc.Unplaceable): 30,
    (P.SCHEDULED, lc.Unschedulable): 60,
    (P.STARTING, lc.StartFailed): 20,
}


def beyond(phase: P, kind: type) -> P:
    """Where a failure past its limit, or a wait past its budget, leads: the
    one phase besides its own that the entry declares."""
    (to,) = lc.TRANSITIONS[(phase, kind)].targets - {phase}
    return to


@pytest.mark.parametrize(("phase", "kind"), list(GIVES_UP), ids=str)
def test_a_failure_past_its_limit_gives_up(phase: P, kind: type) -> None:
    limit, to = GIVES_UP[(phase, kind)], beyond(phase, kind)
    new, actions = lc.step(sample(phase, retries=limit - 1), EVENTS[kind](), NOW)
    assert (new.phase, new.retries) == (phase, limit)
    assert [e.verdict for e in records(actions)] == [V.NEED_RETRY]
    new, actions = lc.step(new, EVENTS[kind](), NOW)
    assert (new.phase, new.retries, new.since) == (to, 0, NOW)
    assert [(e.verdict, e.reason, e.phase) for e in records(actions)] == [
        (V.GIVE_UP, Reason.GAVE_UP, to)
    ]


def test_every_declared_target_is_reached() -> None:
    """An entry declares exactly the phases its handler is seen to lead to, run:
    every pair at NOW, each failure past its limit and each wait past its
    budget. No edge the diagram draws is unreachable, and none is missing."""
    runs = [(sample(p), EVENTS[k](), NOW) for p, k in lc.TRANSITIONS]
    runs += [(sample(p, retries=n), EVENTS[k](), NOW) for (p, k), n in GIVES_UP.items()]
    runs += [(sample(p), EVENTS[k](), SINCE + BUDGET_OF[p] + 0.5) for p, k in EXPIRES]
    reached: dict[tuple[P, type], set[P]] = {}
    for rec, event, now in runs:
        reached.setdefault((rec.phase, type(event)), set()).add(lc.step(rec, event, now)[0].phase)
    assert {pair: set(e.targets) for pair, e in lc.TRANSITIONS.items()} == reached


def test_deadlines_come_from_the_budget_table() -> None:
    for phase in P:
        want = BUDGET_OF.get(phase)
        rec = sample(phase)
        assert lc.budget(rec) == want
        assert lc.deadline(rec) == (None if want is None else SINCE + want)


# Waiting that expires (where the replica goes then: ``beyond``).
EXPIRES = [
    (P.SCHEDULED, lc.Unbound),
    (P.STARTING, lc.NotStarted),
    (P.UNKNOWN, lc.StillLost),
    (P.FAILED, lc.BackingOff),
    (P.DRAINING, lc.NotDrained),
]


@pytest.mark.parametrize(("phase", "kind"), list(EXPIRES), ids=str)
def test_waiting_expires_once_the_phase_budget_has_run_out(phase: P, kind: type) -> None:
    rec = sample(phase)
    end = SINCE + BUDGET_OF[phase]
    new, actions = lc.step(rec, EVENTS[kind](), end)  # at the deadline: still waiting
    assert new is rec and [e.verdict for e in records(actions)] == [V.SKIPPED]
    new, actions = lc.step(rec, EVENTS[kind](), end + 0.5)
    assert (new.phase, new.since, new.retries) == (beyond(phase, kind), end + 0.5, 0)
    assert [(e.verdict, e.reason) for e in records(actions)] == [(V.EXPIRED, Reason.EXPIRED)]


def test_fencing_never_expires() -> None:
    rec = sample(P.PENDING)
    new, actions = lc.step(rec, EVENTS[lc.Fencing](), 1e12)
    assert new is rec and [e.verdict for e in records(actions)] == [V.SKIPPED]


@pytest.mark.parametrize("phase", list(P), ids=str)
@pytest.mark.parametrize("kind", REPORTS, ids=lambda k: k.__name__)
def test_a_report_about_another_attempt_is_dropped(phase: P, kind: type) -> None:
    rec = sample(phase)
    event = replace(EVENTS[kind](), attempt=ATTEMPT - 1)  # type: ignore[type-var]
    new, actions = lc.step(rec, event, NOW)
    assert new is rec and actions == []


# Which check reports in which phase (what the planner dispatches on).
OBSERVED = {
    lc.Check.SCHEDULE: {P.PENDING},
    lc.Check.PRESENCE: {P.SCHEDULED, P.STARTING, P.RUNNING, P.UNKNOWN, P.DRAINING},
    lc.Check.NODE: {P.STARTING, P.RUNNING, P.DRAINING},
    lc.Check.BIND: {P.SCHEDULED},
    lc.Check.START: {P.STARTING},
    lc.Check.RECOVER: {P.UNKNOWN},
    lc.Check.RETRY_FAILED: {P.FAILED},
    lc.Check.DRAIN: {P.DRAINING},
}


@pytest.mark.parametrize("check", list(lc.Check), ids=str)
def test_a_check_reports_where_the_table_takes_all_its_events(check: lc.Check) -> None:
    """A check's phases take every event it can report, so the planner never sends a refused one."""
    kinds = [k for k in REPORTS if k.check is check]
    assert kinds
    for phase in P:
        taken = {(phase, k) in lc.TRANSITIONS for k in kinds}
        assert taken == {phase in OBSERVED[check]}, (phase, kinds)
        assert lc.observes(phase, check) is (phase in OBSERVED[check])


@pytest.mark.parametrize("phase", list(P), ids=str)
def test_reset_delete_and_retire(phase: P) -> None:
    """reset revives only a Failed replica; delete ends any other; retire drains a Running one."""
    rec = sample(phase)
    revived = lc.reset(rec, 9.0)
    if phase is P.FAILED:
        assert (revived.phase, revived.since, revived.retries) == (P.PENDING, 9.0, 0)
    else:
        assert revived is rec
    deleted = lc.delete(rec, 9.0)
    if phase is P.TERMINATING:
        assert deleted is rec
    else:
        assert (deleted.phase, deleted.since, deleted.attempt) == (P.TERMINATING, 9.0, ATTEMPT)
    retired = lc.retire(rec, 9.0)
    if phase in (P.DRAINING, P.TERMINATING):
        assert retired is rec
    else:
        assert retired.phase is (P.DRAINING if phase is P.RUNNING else P.TERMINATING)


# ------------------------------------------------------------- properties

# The most failures a record may hold in each phase (0 elsewhere).
MOST_RETRIES = {P.PENDING: 30, P.SCHEDULED: 60, P.STARTING: 20}

events = st.one_of(
    st.builds(
        lambda k, attempt: replace(EVENTS[k](), attempt=attempt),
        st.sampled_from(REPORTS),
        st.integers(0, 4),
    ),
    st.sampled_from([lc.Reset(), lc.Drain(), lc.Delete()]),
)


class ReplicaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rec = lc.Replica(0, policy=POLICY)
        self.now = 0.0
        self.ended = False

    @rule(event=events, dt=st.floats(0, 30))
    def step(self, event: lc.Event, dt: float) -> None:
        self.now += dt
        before = self.rec
        stale = isinstance(event, lc.Report) and event.attempt != before.attempt
        try:
            new, actions = lc.step(before, event, self.now)
        except lc.InvalidTransition:
            assert not stale and (before.phase, type(event)) not in lc.TRANSITIONS
            return
        if stale:
            assert new is before and actions == []
        if self.ended:
            assert new.phase is P.TERMINATING  # nothing leaves Terminating
        # The attempt rises by one exactly when a placement is taken, and only then.
        placed = isinstance(event, lc.Placed) and not stale
        assert new.attempt == before.attempt + (1 if placed else 0)
        # A record tells the phase after the step; a report that moves the
        # replica is always recorded.
        got = records(actions)
        assert all(e.phase is new.phase for e in got)
        if new.phase is not before.phase and isinstance(event, lc.Report):
            assert len(got) == 1 and got[0].reason is not None
        self.rec = new
        self.ended = self.ended or new.phase is P.TERMINATING

    @invariant()
    def retries_within_the_phase_limit(self) -> None:
        assert self.rec.retries <= MOST_RETRIES.get(self.rec.phase, 0)


TestReplicaMachine = ReplicaMachine.TestCase
TestReplicaMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
