"""The engine state machine and its probe verdicts, without processes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.engine_shim import fsm
from understudy.engine_shim.fsm import (
    Acquire,
    BindServing,
    Budgets,
    Exit,
    ExitCode,
    State,
    Wake,
    step,
)
from understudy.engine_shim.probes import Probe, verdict

B = Budgets(startup_s=100.0, wake_s=5.0)
EVENTS = [
    fsm.InitDone(),
    fsm.InitTimeout(),
    fsm.LockGranted(7),
    fsm.WakeDone(),
    fsm.ServingReady(),
    fsm.WakeTimeout(),
    fsm.LockLost("lost"),
    fsm.GmsLost("gone"),
    fsm.Fatal("boom"),
]


def in_state(state: State) -> fsm.EngineState:
    return fsm.EngineState(state, since=10.0, started=0.0, budgets=B)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, EVENTS)))
def test_every_state_event_pair(state, event):
    """Legal pairs land in the entry's target; illegal ones raise and change nothing."""
    s = in_state(state)
    entry = fsm.TRANSITIONS.get((state, type(event)))
    if entry is None:
        with pytest.raises(fsm.InvalidTransition) as info:
            step(s, event, 20.0)
        assert (info.value.phase, info.value.kind) == (state, type(event))
        assert s == fsm.EngineState(state, since=10.0, started=0.0, budgets=B)
        return
    new, actions = step(s, event, 20.0)
    (target,) = entry.targets
    assert new.state is target
    assert new.since == (10.0 if target is state else 20.0)
    assert new.last_event == type(event).__name__
    if target is State.DEAD:
        (exit_,) = actions
        assert isinstance(exit_, Exit) and exit_.code != 0 and exit_.state is state


def test_happy_path_and_actions():
    s = fsm.initial(0.0, B)
    s, a = step(s, fsm.InitDone(), 1.0)
    assert (s.state, a) == (State.STANDBY, [Acquire()])
    s, a = step(s, fsm.LockGranted(3), 2.0)
    assert s.state is State.WAKING and s.epoch == 3 and a == [Wake(deadline=7.0)]
    s, a = step(s, fsm.WakeDone(), 2.5)
    assert s.state is State.WAKING and a == [BindServing()]  # not Active yet
    s, a = step(s, fsm.ServingReady(), 2.6)
    assert s.state is State.ACTIVE and a == [] and s.since == 2.6


def test_exit_codes_name_the_cause():
    assert step(in_state(State.ACTIVE), fsm.LockLost("x"), 0)[1][0].code is ExitCode.LOCK_LOST
    assert step(in_state(State.ACTIVE), fsm.GmsLost("x"), 0)[1][0].code is ExitCode.GMS_LOST
    assert step(in_state(State.WAKING), fsm.WakeTimeout(), 0)[1][0].code is ExitCode.WAKE_TIMEOUT
    assert step(in_state(State.INIT), fsm.InitTimeout(), 0)[1][0].code is ExitCode.INIT_TIMEOUT
    assert step(in_state(State.WAKING), fsm.Fatal("x"), 0)[1][0].code is ExitCode.FATAL


def test_deadlines():
    assert fsm.deadline(fsm.initial(3.0, B)) == 103.0
    assert fsm.deadline(in_state(State.WAKING)) == 15.0
    for st_ in (State.STANDBY, State.ACTIVE, State.DEAD):
        assert fsm.deadline(in_state(st_)) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), max_size=20))
def test_no_way_back_and_active_only_via_serving_ready(events):
    """Invariants over any sequence: states only move forward; Active is entered
    only by ServingReady after a LockGranted; Dead is final."""
    order = [State.INIT, State.STANDBY, State.WAKING, State.ACTIVE, State.DEAD]
    s = fsm.initial(0.0, B)
    granted = False
    for t, e in enumerate(events):
        try:
            new, _ = step(s, e, float(t))
        except fsm.InvalidTransition:
            continue
        assert order.index(new.state) >= order.index(s.state)
        if new.state is State.ACTIVE and s.state is not State.ACTIVE:
            assert isinstance(e, fsm.ServingReady) and granted
        granted = granted or isinstance(e, fsm.LockGranted)
        if s.state is State.DEAD:
            pytest.fail("Dead accepted an event")
        s = new


# ---------------------------------------------------------------- probes --


@pytest.mark.parametrize(
    ("probe", "state", "t", "healthy", "status"),
    [
        (Probe.STARTUP, State.INIT, 1, False, 503),
        (Probe.STARTUP, State.STANDBY, 1, False, 200),
        (Probe.STARTUP, State.ACTIVE, 1, True, 200),
        (Probe.LIVE, State.INIT, 1, False, 503),
        (Probe.LIVE, State.STANDBY, 10_000, False, 200),  # idle for ever is alive
        (Probe.LIVE, State.WAKING, 4.9, False, 200),
        (Probe.LIVE, State.WAKING, 5.1, False, 503),  # hung wake gets killed
        (Probe.LIVE, State.ACTIVE, 1, True, 200),
        (Probe.LIVE, State.ACTIVE, 1, False, 503),
        (Probe.LIVE, State.DEAD, 1, True, 503),
        (Probe.READY, State.INIT, 1, False, 503),
        (Probe.READY, State.STANDBY, 1, False, 200),
        (Probe.READY, State.WAKING, 1, False, 503),
        (Probe.READY, State.ACTIVE, 1, True, 200),
        (Probe.READY, State.ACTIVE, 1, False, 503),
    ],
)
def test_probe_verdicts(probe, state, t, healthy, status):
    v = verdict(probe, state, t, healthy, B, "why")
    assert v.status == status and v.reason


def test_every_probe_state_pair_has_a_verdict():
    for probe, state in itertools.product(Probe, State):
        for healthy in (True, False):
            assert verdict(probe, state, 0.0, healthy, B).status in (200, 503)
