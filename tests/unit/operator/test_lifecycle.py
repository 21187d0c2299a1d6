"""The replica lifecycle: the transition table, the coordinator, and its invariants."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from understudy.operator import lifecycle as lc
from understudy.operator.api import ReplicaPhase as P

PAIRS = list(itertools.product(P, lc.Event))


@pytest.mark.parametrize(("phase", "event"), PAIRS, ids=str)
def test_every_phase_event_pair(phase: P, event: lc.Event) -> None:
    """Legal pairs land in the entry's target; illegal ones raise and change nothing."""
    rec = lc.Replica(index=0, phase=phase, attempt=2, retries=3, since=1.0, node="n1")
    entry = lc.TRANSITIONS.get((phase, event))
    if entry is None:
        with pytest.raises(lc.InvalidTransition) as info:
            lc.step(rec, event, now=5.0)
        assert (info.value.phase, info.value.kind) == (phase, event)
        return
    new, actions = lc.step(rec, event, now=5.0)
    (expected,) = entry.targets
    assert new.phase is expected and actions == []
    assert new.since == 5.0 and new.retries == 0 and new.node == "n1"
    assert new.attempt == (3 if event is lc.Event.PLACED else 2)


def test_only_placement_raises_the_attempt() -> None:
    assert [k for k in lc.TRANSITIONS if k[1] is lc.Event.PLACED] == [(P.PENDING, lc.Event.PLACED)]


def test_handler_declarations_are_valid_transitions() -> None:
    """Every event a handler declares exists in the table for every phase it targets."""
    for name, spec in lc.HANDLERS.items():
        tr = spec.transitions
        for event in (tr.success, tr.need_retry, tr.expired, tr.give_up):
            if event is None:
                continue
            for phase in spec.targets:
                assert (phase, event) in lc.TRANSITIONS, (name, phase, event)


def test_deletion_is_possible_from_every_non_terminal_phase() -> None:
    for phase in P:
        if phase is not P.TERMINATING:
            assert lc.TRANSITIONS[(phase, lc.Event.DELETE)].targets == {P.TERMINATING}


POLICY = lc.Policy(bind_timeout=10, start_timeout=10, unknown_timeout=10, failed_backoff=10)


def _judge(
    rec: lc.Replica,
    handler: lc.Handler,
    outcome: lc.Outcome,
    now: float = 1.0,
    attempt: int | None = None,
):
    rep = lc.Report(
        handler, rec.index, rec.attempt if attempt is None else attempt, outcome, "m", "n1"
    )
    return lc.judge(rec, rep, POLICY, now)


def test_success_applies_the_declared_event() -> None:
    rec, entry = _judge(lc.Replica(0), lc.Handler.SCHEDULE, lc.Outcome.SUCCESS)
    assert (rec.phase, rec.attempt, rec.node) == (P.SCHEDULED, 1, "n1")
    assert (
        entry is not None and entry.verdict is lc.Verdict.SUCCESS and entry.event is lc.Event.PLACED
    )


def test_failures_retry_then_give_up() -> None:
    rec = lc.Replica(0)
    limit = lc.HANDLERS[lc.Handler.SCHEDULE].max_retries
    assert limit is not None
    for n in range(1, limit + 1):
        rec, entry = _judge(rec, lc.Handler.SCHEDULE, lc.Outcome.FAILURE)
        assert rec.phase is P.PENDING and rec.retries == n
        assert entry is not None and entry.verdict is lc.Verdict.NEED_RETRY
    rec, entry = _judge(rec, lc.Handler.SCHEDULE, lc.Outcome.FAILURE)
    assert entry is not None and entry.verdict is lc.Verdict.GIVE_UP
    assert rec.phase is P.FAILED


def test_need_retry_may_declare_a_transition() -> None:
    rec = lc.Replica(0, phase=P.RUNNING, attempt=1)
    rec, _ = _judge(rec, lc.Handler.NODE, lc.Outcome.FAILURE)
    assert rec.phase is P.UNKNOWN


def test_skipped_expires_after_the_phase_budget() -> None:
    rec = lc.Replica(0, phase=P.UNKNOWN, attempt=1, since=100.0)
    same, entry = _judge(rec, lc.Handler.RECOVER, lc.Outcome.SKIPPED, now=105.0)
    assert same == rec and entry is not None and entry.verdict is lc.Verdict.SKIPPED
    new, entry = _judge(rec, lc.Handler.RECOVER, lc.Outcome.SKIPPED, now=111.0)
    assert new.phase is P.PENDING and entry is not None and entry.verdict is lc.Verdict.EXPIRED


def test_stale_attempt_and_foreign_phase_reports_are_ignored() -> None:
    rec = lc.Replica(0, phase=P.SCHEDULED, attempt=4)
    assert _judge(rec, lc.Handler.BIND, lc.Outcome.SUCCESS, attempt=3) == (rec, None)
    assert _judge(rec, lc.Handler.START, lc.Outcome.SUCCESS) == (rec, None)


def test_history_drops_repeats_and_quiet_successes() -> None:
    e = lc.HistoryEntry(
        1.0, 0, 1, lc.Handler.BIND, lc.Verdict.SKIPPED, None, P.SCHEDULED, "waiting"
    )
    ok = replace(e, handler=lc.Handler.PRESENCE, verdict=lc.Verdict.SUCCESS)
    assert lc.accepted([], [e, e, ok]) == [e]
    assert lc.accepted([e], [replace(e, time=2.0)]) == []
    moved = replace(e, event=lc.Event.BOUND, verdict=lc.Verdict.SUCCESS)
    assert lc.accepted([e], [moved]) == [moved]


# ------------------------------------------------------------- properties

reports = st.builds(
    lc.Report,
    handler=st.sampled_from(list(lc.Handler)),
    replica=st.just(0),
    attempt=st.integers(0, 6),
    outcome=st.sampled_from(list(lc.Outcome)),
    message=st.sampled_from(["a", "b"]),
    node=st.sampled_from([None, "n1", "n2"]),
)


class ReplicaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rec = lc.Replica(0)
        self.now = 0.0
        self.history: tuple[lc.HistoryEntry, ...] = ()
        self.max_attempt = 0

    @rule(report=reports, dt=st.floats(0, 100))
    def report(self, report: lc.Report, dt: float) -> None:
        self.now += dt
        before = self.rec
        new, entry = lc.judge(before, report, POLICY, self.now)
        if report.attempt != before.attempt:
            # Stale: nothing changes, nothing is recorded.
            assert (new, entry) == (before, None)
        if new.phase is not before.phase:
            assert (before.phase, entry.event) in lc.TRANSITIONS  # type: ignore[union-attr]
        self.rec = new
        if entry is not None:
            self.history = lc.append_history(self.history, [entry], limit=8)

    @rule(dt=st.floats(0, 100))
    def reset_or_delete(self, dt: float) -> None:
        self.now += dt
        self.rec = lc.reset(self.rec, self.now)

    @invariant()
    def attempts_never_decrease(self) -> None:
        assert self.rec.attempt >= self.max_attempt
        self.max_attempt = self.rec.attempt

    @invariant()
    def history_bounded(self) -> None:
        assert len(self.history) <= 8

    @invariant()
    def retries_bounded(self) -> None:
        limits = [s.max_retries for s in lc.HANDLERS.values() if s.max_retries is not None]
        assert self.rec.retries <= max(limits) + 1


TestReplicaMachine = ReplicaMachine.TestCase
TestReplicaMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(reports, max_size=60), st.integers(1, 10))
def test_history_never_exceeds_its_limit(rs: list[lc.Report], limit: int) -> None:
    rec = lc.Replica(0)
    hist: tuple[lc.HistoryEntry, ...] = ()
    for i, r in enumerate(rs):
        rec, entry = lc.judge(rec, replace(r, attempt=rec.attempt), POLICY, float(i))
        if entry is not None:
            hist = lc.append_history(hist, [entry], limit)
        assert len(hist) <= limit


@pytest.mark.parametrize("phase", list(P), ids=str)
def test_reset_and_delete_change_only_what_the_table_allows(phase: P) -> None:
    """reset only revives a Failed replica, delete ends any other; neither touches the attempt."""
    rec = lc.Replica(0, phase=phase, attempt=4, retries=2, since=1.0, node="n1")
    if phase is P.FAILED:
        expected = lc.Replica(0, phase=P.PENDING, attempt=4, retries=0, since=9.0, node="n1")
    else:
        expected = lc.Replica(0, phase=phase, attempt=4, retries=2, since=1.0, node="n1")
    assert lc.reset(rec, 9.0) == expected
    if phase is P.TERMINATING:
        expected = lc.Replica(0, phase=phase, attempt=4, retries=2, since=1.0, node="n1")
    else:
        expected = lc.Replica(0, phase=P.TERMINATING, attempt=4, retries=0, since=9.0, node="n1")
    assert lc.delete(rec, 9.0) == expected
