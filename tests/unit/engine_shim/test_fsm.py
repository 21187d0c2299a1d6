"""The engine state machine and its probe verdicts, without processes."""

from __future__ import annotations

import dataclasses
import itertools
from typing import get_args

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

B = Budgets(startup_s=100.0, wake_s=5.0, drain_s=25.0)
EVENTS = [
    fsm.InitDone(),
    fsm.InitTimeout(),
    fsm.LockGranted(7),
    fsm.WakeDone(),
    fsm.ServingReady(),
    fsm.WakeTimeout(),
    fsm.LockLost("lost"),
    fsm.GmsLost("gone"),
    fsm.Readopted(),
    fsm.ReadoptFailed("refused"),
    fsm.EpochReissued(8),
    fsm.Terminate(),
    fsm.Drained(unfinished=2),
    fsm.Fatal("boom"),
]

S = State
# The exit code of every pair that lands in Dead.
EXIT_CODES: dict[type, ExitCode] = {
    fsm.InitTimeout: ExitCode.INIT_TIMEOUT,
    fsm.WakeTimeout: ExitCode.WAKE_TIMEOUT,
    fsm.LockLost: ExitCode.LOCK_LOST,
    fsm.GmsLost: ExitCode.GMS_LOST,
    fsm.ReadoptFailed: ExitCode.GMS_LOST,
    fsm.Fatal: ExitCode.FATAL,
    fsm.Terminate: ExitCode.DONE,
    fsm.Drained: ExitCode.DONE,
}


def in_state(state: State) -> fsm.EngineState:
    return fsm.EngineState(state, since=10.0, started=0.0, budgets=B, epoch=7)


def test_the_event_list_covers_every_event_kind() -> None:
    assert {type(e) for e in EVENTS} == set(get_args(fsm.Event))
    assert {k for _, k in fsm.TRANSITIONS} <= {type(e) for e in EVENTS}


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_state_event_pair(state: State, event: fsm.Event) -> None:
    """A pair the table holds lands in a state its entry declares, with its
    actions; the others raise, naming the pair."""
    s = in_state(state)
    entry = fsm.TRANSITIONS.get((state, type(event)))
    if entry is None:
        with pytest.raises(fsm.InvalidTransition) as info:
            step(s, event, 20.0)
        assert (info.value.phase, info.value.kind) == (state, type(event))
        return
    new, actions = step(s, event, 20.0)
    assert new.state in entry.targets
    assert new.since == (10.0 if new.state is state else 20.0)
    assert new.last_event == type(event).__name__
    assert new.epoch == (event.epoch if hasattr(event, "epoch") else 7)
    if new.state is State.DEAD:
        assert actions == [Exit(EXIT_CODES[type(event)], actions[0].reason, state)]
        assert actions[0].reason
    else:
        assert actions == _ACTIONS_ON_THE_WAY.get((state, type(event)), [])


def test_every_declared_target_is_reached() -> None:
    """No entry declares a state its handler never leads to: every pair the
    table holds, run, reaches every target its entry names."""
    reached: dict[tuple[State, type], set[State]] = {}
    for state, event in itertools.product(State, EVENTS):
        key = (state, type(event))
        if key in fsm.TRANSITIONS:
            reached.setdefault(key, set()).add(step(in_state(state), event, 20.0)[0].state)
    for key, entry in fsm.TRANSITIONS.items():
        assert reached.get(key, set()) == set(entry.targets), key


# The actions of the pairs that do not end the engine (at now=20, budgets B).
_ACTIONS_ON_THE_WAY: dict[tuple[State, type], list[fsm.Action]] = {
    (S.INIT, fsm.InitDone): [Acquire()],
    (S.STANDBY, fsm.LockGranted): [Wake(deadline=25.0)],
    (S.WAKING, fsm.WakeDone): [BindServing()],
    (S.ACTIVE, fsm.Terminate): [fsm.Drain(deadline=45.0)],
    (S.WAKING, fsm.GmsLost): [fsm.Readopt(deadline=25.0)],
    (S.ACTIVE, fsm.GmsLost): [fsm.Readopt(deadline=25.0)],
}


def test_gms_lost_twice_while_active_gives_the_weights_back_once() -> None:
    """One GMS death loses every device's session: one re-adoption, not one each."""
    s, actions = step(in_state(State.ACTIVE), fsm.GmsLost("device 0"), 20.0)
    assert s.readopting and actions == [fsm.Readopt(deadline=25.0)]
    s, actions = step(s, fsm.GmsLost("device 1"), 20.1)
    assert s.state is State.ACTIVE and s.readopting and actions == []
    s, actions = step(s, fsm.Readopted(), 20.5)
    assert s.state is State.ACTIVE and not s.readopting and actions == []
    s, actions = step(s, fsm.GmsLost("again, later"), 30.0)
    assert actions == [fsm.Readopt(deadline=35.0)]


def test_gms_lost_inside_a_wake_gives_the_weights_back_and_the_wake_goes_on() -> None:
    """GMS reports a loss only for a mapped session: a waking engine holds the
    weights and gives them back while it wakes, whichever ends first."""
    s, actions = step(in_state(State.WAKING), fsm.GmsLost("device 0"), 20.0)
    assert s.state is State.WAKING and s.readopting and actions == [fsm.Readopt(deadline=25.0)]
    active, _ = step(s, fsm.ServingReady(), 20.2)
    assert active.state is State.ACTIVE and active.readopting  # still giving them back
    assert not step(active, fsm.Readopted(), 20.5)[0].readopting
    s, actions = step(s, fsm.Readopted(), 20.3)  # or given back before it serves
    assert s.state is State.WAKING and not s.readopting and actions == []
    s, actions = step(in_state(State.WAKING), fsm.GmsLost("device 0"), 20.0)
    s, actions = step(s, fsm.ReadoptFailed("refused"), 21.0)
    assert s.state is State.DEAD and actions[0].code is ExitCode.GMS_LOST


def test_a_state_is_frozen_so_a_refused_step_cannot_have_changed_it() -> None:
    s = in_state(State.STANDBY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.state = State.ACTIVE  # type: ignore[misc]


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


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
def test_deadlines_and_what_their_expiry_does(state: State) -> None:
    """Init's budget runs from the process start, Waking's and Draining's from
    entering the state; each expiry is an event its state takes, and it ends
    the engine. The other states wait for ever (an idle standby is fine)."""
    s = in_state(state)
    expected = {S.INIT: 100.0, S.WAKING: 15.0, S.DRAINING: 35.0}.get(state)
    assert fsm.deadline(s) == expected
    if expected is None:
        with pytest.raises(KeyError):
            fsm.expired(s, 0)
        return
    event = fsm.expired(s, 3)
    new, actions = step(s, event, expected)
    assert new.state is State.DEAD
    assert [a.code for a in actions if isinstance(a, Exit)] == [EXIT_CODES[type(event)]]
    if state is State.DRAINING:
        assert event == fsm.Drained(unfinished=3)
        assert "3 unfinished" in actions[0].reason


def test_init_deadline_runs_from_the_process_start() -> None:
    assert fsm.deadline(fsm.initial(3.0, B)) == 103.0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), max_size=20))
def test_no_way_back_and_active_only_via_serving_ready(events):
    """Invariants over any sequence: states only move forward; Active is entered
    only by ServingReady after a LockGranted; Dead is final."""
    order = [S.INIT, S.STANDBY, S.WAKING, S.ACTIVE, S.DRAINING, S.DEAD]
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

# Every (probe, state): the status with a healthy serving endpoint and with an
# unhealthy one, one second into the state (docs/pod.md, the probes).
PROBE_STATUS: dict[tuple[Probe, State], tuple[int, int]] = {
    (Probe.STARTUP, S.INIT): (503, 503),
    (Probe.STARTUP, S.STANDBY): (200, 200),
    (Probe.STARTUP, S.WAKING): (200, 200),
    (Probe.STARTUP, S.ACTIVE): (200, 200),
    (Probe.STARTUP, S.DRAINING): (200, 200),
    (Probe.STARTUP, S.DEAD): (503, 503),
    (Probe.LIVE, S.INIT): (200, 200),  # the shim enforces its startup budget itself
    (Probe.LIVE, S.STANDBY): (200, 200),
    (Probe.LIVE, S.WAKING): (200, 200),  # within the wake timeout
    (Probe.LIVE, S.ACTIVE): (200, 503),
    (Probe.LIVE, S.DRAINING): (200, 200),  # finishing its requests
    (Probe.LIVE, S.DEAD): (503, 503),
    (Probe.READY, S.INIT): (503, 503),
    (Probe.READY, S.STANDBY): (200, 200),
    (Probe.READY, S.WAKING): (503, 503),
    (Probe.READY, S.ACTIVE): (200, 503),
    (Probe.READY, S.DRAINING): (503, 503),
    (Probe.READY, S.DEAD): (503, 503),
}


def test_every_probe_and_state_has_an_expected_verdict() -> None:
    assert set(PROBE_STATUS) == set(itertools.product(Probe, State))


@pytest.mark.parametrize(("probe", "state"), list(PROBE_STATUS), ids=str)
def test_probe_verdicts(probe: Probe, state: State) -> None:
    healthy, unhealthy = PROBE_STATUS[(probe, state)]
    for serving, status in ((True, healthy), (False, unhealthy)):
        v = verdict(probe, state, 1.0, serving, B, "why")
        assert v.status == status and v.reason
        if status == 503 and state is S.ACTIVE:
            assert "why" in v.reason  # the serving endpoint's own reason


def test_a_hung_wake_fails_liveness_after_the_wake_timeout() -> None:
    assert verdict(Probe.LIVE, S.WAKING, 4.9, False, B).ok
    assert not verdict(Probe.LIVE, S.WAKING, 5.1, False, B).ok
    assert verdict(Probe.LIVE, S.STANDBY, 10_000, False, B).ok  # idle for ever is alive
