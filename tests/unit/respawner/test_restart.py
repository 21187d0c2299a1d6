"""The respawner's restart policy (respawner.restart): every (phase, event) pair,
the back-off for a child that cannot start, none for one that started."""

from __future__ import annotations

import dataclasses
import itertools
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.respawner import restart
from understudy.respawner.restart import (
    ArmTimer,
    Exit,
    Exited,
    Phase,
    Policy,
    Ready,
    Signal,
    Start,
    Stop,
    TimerFired,
)

P = Phase
POLICY = Policy(initial_s=1.0, max_s=8.0, give_up_after=3)
SPARE = Policy(initial_s=1.0, max_s=8.0, give_up_after=3, spare=True, spare_after_s=0.0)
# The default: the spare starts a while after the child said it started.
LATE_SPARE = Policy(initial_s=1.0, max_s=8.0, give_up_after=3, spare=True, spare_after_s=5.0)
EVENTS: list[restart.Event] = [
    Ready(),
    Exited(137),
    restart.SpareExited(9),
    TimerFired(),
    Stop(15),
]

# Where every legal pair lands, from the policy's rules (the module docstring),
# not read from the table. The started child's death restarts at once; a
# failed start backs off (here: the first failure of three).
LANDS: dict[tuple[Phase, type], Phase] = {
    (P.STARTING, Ready): P.RUNNING,
    (P.STARTING, Exited): P.BACKOFF,
    (P.STARTING, Stop): P.STOPPING,
    (P.RUNNING, Exited): P.STARTING,
    (P.RUNNING, Stop): P.STOPPING,
    (P.RUNNING, TimerFired): P.RUNNING,  # the spare's time (or a stale timer)
    (P.BACKOFF, TimerFired): P.STARTING,
    (P.BACKOFF, Stop): P.DONE,
    (P.STOPPING, Exited): P.DONE,
    (P.STOPPING, Stop): P.STOPPING,
    (P.STOPPING, Ready): P.STOPPING,
    # A spare's end changes no phase (it is not replaced until the next start).
    **{(p, restart.SpareExited): p for p in (P.STARTING, P.RUNNING, P.BACKOFF, P.STOPPING)},
}
# The actions of each legal pair, from phase entered at t=10 with 2 starts, at t=20.
ACTIONS: dict[tuple[Phase, type], list[type]] = {
    (P.STARTING, Ready): [restart.Note],
    (P.STARTING, Exited): [restart.Note, ArmTimer],
    (P.STARTING, Stop): [Signal],
    (P.RUNNING, Exited): [restart.Note, Start],
    (P.RUNNING, Stop): [Signal],
    (P.RUNNING, TimerFired): [],  # no spare in this policy: nothing is due
    (P.BACKOFF, TimerFired): [Start],
    (P.BACKOFF, Stop): [Exit],
    (P.STOPPING, Exited): [Exit],
    (P.STOPPING, Stop): [Signal],
    (P.STOPPING, Ready): [],
    **{(p, restart.SpareExited): [restart.Note] for p in (P.STARTING, P.RUNNING, P.BACKOFF)},
    (P.STOPPING, restart.SpareExited): [],
}


def in_phase(phase: Phase) -> restart.RestartState:
    """A respawner whose first child started (a restart's failure backs off)."""
    deadline = 20.0 if phase is P.BACKOFF else None
    return restart.RestartState(
        phase, POLICY, since=10.0, starts=2, deadline=deadline, ever_ready=True
    )


def test_the_event_list_covers_every_event_kind() -> None:
    assert {type(e) for e in EVENTS} == set(get_args(restart.Event))


def test_the_table_takes_exactly_the_expected_pairs() -> None:
    assert set(restart.TRANSITIONS) == set(LANDS)


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_phase_event_pair(phase: Phase, event: restart.Event) -> None:
    s = in_phase(phase)
    key = (phase, type(event))
    if key not in LANDS:
        with pytest.raises(restart.InvalidTransition) as info:
            restart.step(s, event, 20.0)
        assert (info.value.phase, info.value.kind) == key
        return
    new, actions = restart.step(s, event, 20.0)
    assert new.phase is LANDS[key]
    assert [type(a) for a in actions] == ACTIONS[key]


def test_the_first_child_starts_at_once() -> None:
    s, actions = restart.initial(5.0, POLICY)
    assert s.phase is P.STARTING and actions == [Start(0)] and s.restarts == 0


def test_a_child_that_started_is_restarted_at_once_every_time() -> None:
    """Ten deaths in a row of a child that started each time: ten immediate
    restarts, no back-off, whatever the pace."""
    s, _ = restart.initial(0.0, POLICY)
    for i in range(10):
        t = i * 0.5
        s, _ = restart.step(s, Ready(), t + 0.3)
        s, actions = restart.step(s, Exited(137), t + 0.5)
        assert s.phase is P.STARTING and actions[-1] == Start(i + 1)
        assert not any(isinstance(a, ArmTimer) for a in actions)


def test_a_container_whose_first_process_never_starts_is_kubelets_at_once() -> None:
    s, _ = restart.initial(0.0, POLICY)
    s, actions = restart.step(s, Exited(2), 0.5)
    assert s.phase is P.DONE and [type(a) for a in actions] == [Exit]
    assert actions[0].code == 2  # type: ignore[union-attr]


def test_a_restart_that_cannot_start_is_backed_off_then_handed_to_kubelet() -> None:
    s, _ = restart.initial(0.0, POLICY)
    s, _ = restart.step(s, Ready(), 0.1)  # the container's first engine started
    s, _ = restart.step(s, Exited(137), 0.15)  # and died: restarted at once
    s, actions = restart.step(s, Exited(1), 0.2)  # the restart fails to start
    assert s.phase is P.BACKOFF and ArmTimer(1.2) in actions and s.deadline == 1.2
    s, actions = restart.step(s, TimerFired(), 1.2)
    assert actions == [Start(2)]
    s, actions = restart.step(s, Exited(1), 1.5)
    assert ArmTimer(3.5) in actions  # 2 s: doubled
    s, _ = restart.step(s, TimerFired(), 3.5)
    s, actions = restart.step(s, Exited(2), 3.6)
    assert s.phase is P.DONE and actions == [Exit(2, actions[0].reason)]  # type: ignore[union-attr]
    assert "3 times" in actions[0].reason  # type: ignore[union-attr]


def test_a_start_resets_the_failures() -> None:
    s, _ = restart.initial(0.0, POLICY)
    s, _ = restart.step(s, Ready(), 0.05)
    s, _ = restart.step(s, Exited(137), 0.07)
    s, _ = restart.step(s, Exited(1), 0.1)
    s, _ = restart.step(s, TimerFired(), 1.1)
    s, _ = restart.step(s, Ready(), 2.0)
    assert s.failures == 0
    s, _ = restart.step(s, Exited(137), 3.0)
    s, actions = restart.step(s, Exited(1), 3.1)  # then it fails to start: 1 s again
    assert ArmTimer(4.1) in actions


def test_a_stop_passes_the_signal_on_and_ends_with_the_childs_code() -> None:
    s, _ = restart.initial(0.0, POLICY)
    s, _ = restart.step(s, Ready(), 1.0)
    s, actions = restart.step(s, Stop(15), 2.0)
    assert actions == [Signal(15)]
    s, actions = restart.step(s, Exited(0), 2.5)
    assert s.phase is P.DONE and actions == [Exit(0, "stopped")]
    s, _ = restart.step(in_phase(P.BACKOFF), Stop(2), 20.0)
    assert s.phase is P.DONE


@pytest.mark.parametrize("failures", range(1, 8))
def test_backoff_delays_double_to_the_cap(failures: int) -> None:
    assert POLICY.delay(failures) == min(8.0, 2.0 ** (failures - 1))


def test_a_state_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        in_phase(P.RUNNING).phase = P.DONE  # type: ignore[misc]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), max_size=30), st.sampled_from([POLICY, SPARE]))
def test_invariants(events: list[restart.Event], policy: Policy) -> None:
    """Over any sequence: one Start or Go per child; Done is final and comes with
    one Exit; never more failures in a row than the policy allows; a Go only
    with a spare, and never two spares."""
    s, actions = restart.initial(0.0, policy)
    starts = sum(isinstance(a, Start) for a in actions)
    exits = 0
    for t, e in zip(itertools.count(1), events, strict=False):
        try:
            s, actions = restart.step(s, e, float(t))
        except restart.InvalidTransition:
            continue
        starts += sum(isinstance(a, Start) for a in actions)
        exits += sum(isinstance(a, Exit) for a in actions)
        starts += sum(isinstance(a, restart.Go) for a in actions)
        assert starts == s.starts
        assert s.failures <= policy.give_up_after
        assert exits == (1 if s.phase is P.DONE else 0)
        assert not s.spare or policy.spare


def test_with_a_spare_the_next_process_is_prepared_and_then_goes_on() -> None:
    s, actions = restart.initial(0.0, SPARE)
    assert actions == [Start(0)]  # the first start has no spare to use
    s, actions = restart.step(s, Ready(), 2.0)
    assert restart.StartSpare() in actions and s.spare
    for i in range(1, 6):
        s, actions = restart.step(s, Exited(137), 10.0 * i)
        assert actions[-1] == restart.Go(i) and not s.spare  # the spare goes on
        s, actions = restart.step(s, Ready(), 10.0 * i + 0.5)
        assert restart.StartSpare() in actions and s.spare  # and a new one is prepared


def test_the_spare_starts_a_while_after_the_child_said_it_started() -> None:
    s, _ = restart.initial(0.0, LATE_SPARE)
    s, actions = restart.step(s, Ready(), 2.0)
    assert actions[-1] == ArmTimer(7.0) and not s.spare  # not during the failover
    s, actions = restart.step(s, TimerFired(), 6.9)  # early: nothing yet
    assert actions == [] and not s.spare
    s, actions = restart.step(s, TimerFired(), 7.0)
    assert actions == [restart.StartSpare()] and s.spare and s.deadline is None
    s, actions = restart.step(s, TimerFired(), 8.0)  # a stale timer starts no second one
    assert actions == []
    # A death before the spare's time: a cold start, and the timer is forgotten.
    s, _ = restart.step(s, Exited(137), 20.0)
    s, _ = restart.step(s, Ready(), 21.0)
    s, actions = restart.step(s, Exited(137), 22.0)
    assert actions[-1] == Start(2) and s.deadline is None
    s, actions = restart.step(s, Ready(), 23.0)
    assert actions[-1] == ArmTimer(28.0)


def test_a_spare_that_dies_is_not_replaced_until_the_next_start() -> None:
    s, _ = restart.initial(0.0, SPARE)
    s, _ = restart.step(s, Ready(), 1.0)
    s, actions = restart.step(s, restart.SpareExited(1), 2.0)
    assert not s.spare and not any(isinstance(a, restart.StartSpare) for a in actions)
    s, actions = restart.step(s, Exited(137), 3.0)
    assert actions[-1] == Start(1)  # no spare: a fresh start
    s, actions = restart.step(s, Ready(), 4.0)
    assert restart.StartSpare() in actions


def test_a_stop_ends_the_spare_too() -> None:
    s, _ = restart.initial(0.0, SPARE)
    s, _ = restart.step(s, Ready(), 1.0)
    s, actions = restart.step(s, Stop(15), 2.0)
    assert actions == [restart.StopSpare(), Signal(15)]
