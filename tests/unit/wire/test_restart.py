"""The respawner's restart policy (wire.restart): every (phase, event) pair,
the back-off for a child that cannot start, none for one that started."""

from __future__ import annotations

import dataclasses
import itertools
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.wire import restart
from understudy.wire.restart import (
    ArmTimer,
    BackoffOver,
    Exit,
    Exited,
    Phase,
    Policy,
    Ready,
    Signal,
    Start,
    Stop,
)

P = Phase
POLICY = Policy(initial_s=1.0, max_s=8.0, give_up_after=3)
EVENTS: list[restart.Event] = [Ready(), Exited(137), BackoffOver(), Stop(15)]

# Where every legal pair lands, from the policy's rules (the module docstring),
# not read from the table. The started child's death restarts at once; a
# failed start backs off (here: the first failure of three).
LANDS: dict[tuple[Phase, type], Phase] = {
    (P.STARTING, Ready): P.RUNNING,
    (P.STARTING, Exited): P.BACKOFF,
    (P.STARTING, Stop): P.STOPPING,
    (P.RUNNING, Exited): P.STARTING,
    (P.RUNNING, Stop): P.STOPPING,
    (P.BACKOFF, BackoffOver): P.STARTING,
    (P.BACKOFF, Stop): P.DONE,
    (P.STOPPING, Exited): P.DONE,
    (P.STOPPING, Stop): P.STOPPING,
    (P.STOPPING, Ready): P.STOPPING,
}
# The actions of each legal pair, from phase entered at t=10 with 2 starts, at t=20.
ACTIONS: dict[tuple[Phase, type], list[type]] = {
    (P.STARTING, Ready): [restart.Note],
    (P.STARTING, Exited): [restart.Note, ArmTimer],
    (P.STARTING, Stop): [Signal],
    (P.RUNNING, Exited): [restart.Note, Start],
    (P.RUNNING, Stop): [Signal],
    (P.BACKOFF, BackoffOver): [Start],
    (P.BACKOFF, Stop): [Exit],
    (P.STOPPING, Exited): [Exit],
    (P.STOPPING, Stop): [Signal],
    (P.STOPPING, Ready): [],
}


def in_phase(phase: Phase) -> restart.RestartState:
    deadline = 20.0 if phase is P.BACKOFF else None
    return restart.RestartState(phase, POLICY, since=10.0, starts=2, deadline=deadline)


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


def test_a_child_that_cannot_start_is_backed_off_then_handed_to_kubelet() -> None:
    s, _ = restart.initial(0.0, POLICY)
    s, actions = restart.step(s, Exited(1), 0.2)
    assert s.phase is P.BACKOFF and ArmTimer(1.2) in actions and s.deadline == 1.2
    s, actions = restart.step(s, BackoffOver(), 1.2)
    assert actions == [Start(1)]
    s, actions = restart.step(s, Exited(1), 1.5)
    assert ArmTimer(3.5) in actions  # 2 s: doubled
    s, _ = restart.step(s, BackoffOver(), 3.5)
    s, actions = restart.step(s, Exited(2), 3.6)
    assert s.phase is P.DONE and actions == [Exit(2, actions[0].reason)]  # type: ignore[union-attr]
    assert "3 times" in actions[0].reason  # type: ignore[union-attr]


def test_a_start_resets_the_failures() -> None:
    s, _ = restart.initial(0.0, POLICY)
    s, _ = restart.step(s, Exited(1), 0.1)
    s, _ = restart.step(s, BackoffOver(), 1.1)
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
@given(st.lists(st.sampled_from(EVENTS), max_size=30))
def test_invariants(events: list[restart.Event]) -> None:
    """Over any sequence: one Start per child; Done is final and comes with
    one Exit; never more failures in a row than the policy allows."""
    s, actions = restart.initial(0.0, POLICY)
    starts = sum(isinstance(a, Start) for a in actions)
    exits = 0
    for t, e in zip(itertools.count(1), events, strict=False):
        try:
            s, actions = restart.step(s, e, float(t))
        except restart.InvalidTransition:
            continue
        starts += sum(isinstance(a, Start) for a in actions)
        exits += sum(isinstance(a, Exit) for a in actions)
        assert starts == s.starts
        assert s.failures <= POLICY.give_up_after
        assert exits == (1 if s.phase is P.DONE else 0)
