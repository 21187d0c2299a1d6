"""The autoscaler core: examples, then its invariants under hypothesis.

Invariants, checked over random pressure histories, time steps and policies
with the reconciler (``rollout.moves``) acting on every decision:

* the replica count never leaves [min, max];
* no flapping: after a scale-up to N at t the count stays >= N until
  t + down_window, and after a scale-down to M it stays <= M until
  t + up_window;
* scale-down takes the highest indices first.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from understudy.operator import autoscaler as a
from understudy.operator import rollout

P = a.Policy(min_replicas=1, max_replicas=8, target=4, up_window=0.0, down_window=60.0)


def test_recommend_is_total_pressure_over_target_within_bounds() -> None:
    assert a.recommend(P, [9], 1) == 3  # ceil(9 / 4)
    assert a.recommend(P, [0, 0], 2) == 1  # idle: min
    assert a.recommend(P, [400], 1) == 8  # capped at max
    assert a.recommend(P, [None, None], 2) is None  # nothing known: no recommendation


def test_unknown_replicas_count_on_target_when_shrinking_and_idle_when_growing() -> None:
    # Shrinking assumes an unknown replica is exactly on target: with 3 known
    # and two unknown, (3 + 2 * 4) / 4 -> 3 replicas hold, where the known
    # ones alone (ceil(3 / 4) = 1) would shrink to 1.
    assert a.recommend(P, [3, None, None], 3) == 3
    assert a.recommend(P, [0, 0, None], 3) == 1  # (0 + 4) / 4
    # ... and count as idle when growing: 9 known -> 3, whatever the unknown do.
    assert a.recommend(P, [9, None], 2) == 3


def test_scale_up_is_immediate_and_scale_down_waits_for_the_window() -> None:
    s, d = a.decide(P, a.State(), [12], 1, now=0.0)
    assert (d.desired, d.reason) == (3, a.Reason.SCALE_UP)
    s, d = a.decide(P, s, [0, 0, 0], 3, now=10.0)
    assert (d.desired, d.reason) == (3, a.Reason.STABILIZING)
    assert "held at 3 by the 60 s window" in d.message
    s, d = a.decide(P, s, [0, 0, 0], 3, now=69.0)
    assert d.desired == 3  # 3 was in force until t=10
    s, d = a.decide(P, s, [0, 0, 0], 3, now=70.5)
    assert (d.desired, d.reason) == (1, a.Reason.IDLE)
    assert s.last_scale == 70.5


def test_scale_down_goes_to_the_highest_recommendation_of_the_window() -> None:
    s, _ = a.decide(P, a.State(), [28], 7, now=0.0)  # 7
    s, _ = a.decide(P, s, [16], 7, now=20.0)  # 4
    s, d = a.decide(P, s, [4], 7, now=40.0)  # 1
    assert d.desired == 7
    s, d = a.decide(P, s, [4], 7, now=79.0)  # 7 was in force until t=20
    assert d.desired == 7
    s, d = a.decide(P, s, [4], 7, now=80.5)  # 7 left the window; 4 is the highest
    assert (d.desired, d.reason) == (4, a.Reason.SCALE_DOWN)


def test_unknown_pressure_holds_the_count_and_records_nothing() -> None:
    s, d = a.decide(P, a.State(), [None], 2, now=0.0)
    assert (d.desired, d.reason, s) == (2, a.Reason.PRESSURE_UNKNOWN, a.State())


def test_out_of_bounds_is_clamped_at_once() -> None:
    _, d = a.decide(P, a.State(), [0], 12, now=0.0)
    assert (d.desired, d.reason) == (8, a.Reason.OUT_OF_BOUNDS)


def test_the_record_is_bounded_and_merges_conservatively() -> None:
    s = a.State()
    p = a.Policy(1, 64, 1, up_window=1e6, down_window=1e6)
    for i in range(200):
        s, _ = a.decide(p, s, [i % 50], 25, now=float(i))
    assert len(s.recommendations) == a.MAX_RECOMMENDATIONS
    lows = min(r.low for r in s.recommendations)
    highs = max(r.high for r in s.recommendations)
    assert lows == 1 and highs == 49  # merged entries keep both extremes


# ------------------------------------------------------------------ properties


@st.composite
def policies(draw: st.DrawFn) -> a.Policy:
    lo = draw(st.integers(1, 5))
    hi = draw(st.integers(lo, lo + 8))
    return a.Policy(
        min_replicas=lo,
        max_replicas=hi,
        target=draw(st.integers(1, 10)),
        up_window=draw(st.sampled_from([0.0, 5.0, 30.0])),
        down_window=draw(st.sampled_from([0.0, 10.0, 60.0, 300.0])),
    )


class Fleet(RuleBasedStateMachine):
    """The autoscaler deciding, the reconciler acting at once on each decision."""

    @initialize(policy=policies(), start=st.integers(0, 20))
    def setup(self, policy: a.Policy, start: int) -> None:
        self.policy = policy
        self.state = a.State()
        self.now = 0.0
        self.count = policy.clamp(start)
        self.replicas = set(range(self.count))
        self.changes: list[tuple[float, str, int]] = []  # (time, "up"|"down", count)

    @rule(
        dt=st.floats(0.0, 120.0),
        loads=st.lists(st.one_of(st.none(), st.integers(0, 60)), min_size=0, max_size=20),
    )
    def step(self, dt: float, loads: list[int | None]) -> None:
        self.now += dt
        per_replica = [loads[i % len(loads)] if loads else None for i in range(self.count)]
        self.state, d = a.decide(self.policy, self.state, per_replica, self.count, self.now)
        if d.desired != self.count:
            self.changes.append((self.now, "up" if d.desired > self.count else "down", d.desired))
        members = [rollout.Member(i, updated=True, available=True) for i in self.replicas]
        moves = rollout.moves(members, rollout.Budget(d.desired))
        if moves.retire:
            # Scale-down drains the highest indices first.
            kept = self.replicas - set(moves.retire)
            assert min(moves.retire) > max(kept, default=-1)
        assert not set(moves.add) & self.replicas
        self.replicas = (self.replicas - set(moves.retire)) | set(moves.add)
        self.count = d.desired

    @invariant()
    def within_bounds(self) -> None:
        assert self.policy.min_replicas <= self.count <= self.policy.max_replicas
        assert len(self.replicas) == self.count

    @invariant()
    def no_flapping_inside_a_window(self) -> None:
        for i, (t, kind, n) in enumerate(self.changes):
            for t2, _, n2 in self.changes[i + 1 :]:
                if kind == "up" and t2 < t + self.policy.down_window:
                    assert n2 >= n, (self.changes, self.policy)
                if kind == "down" and t2 < t + self.policy.up_window:
                    assert n2 <= n, (self.changes, self.policy)


TestFleet = Fleet.TestCase
TestFleet.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


@given(policies(), st.lists(st.one_of(st.none(), st.integers(0, 100)), max_size=12))
def test_decision_is_always_within_bounds_even_from_outside(
    policy: a.Policy, loads: list[int | None]
) -> None:
    for current in (0, policy.min_replicas, policy.max_replicas, policy.max_replicas + 3):
        _, d = a.decide(policy, a.State(), loads, current, now=1.0)
        assert policy.min_replicas <= d.desired <= policy.max_replicas
