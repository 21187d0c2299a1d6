"""Poison isolation: the pure core (``fsm.isolate``, ``fsm.may_send``) with
no event loop, then the forwarder carrying it out over engine doubles in
fake loop time (a poison among innocent requests, faults that stack)."""

from __future__ import annotations

import asyncio
import json
import typing
from dataclasses import replace
from typing import Any

import pytest
from doubles.front import Answer, Client, Engine, Router, after
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from understudy.front import fsm
from understudy.front.forwarder import Forwarder
from understudy.front.fsm import (
    Blame,
    Cleared,
    Died,
    Finished,
    Isolation,
    Poisoned,
    Returned,
    RunAlone,
    Sent,
    Suspected,
    Suspects,
    isolate,
    may_send,
)
from understudy.front.metrics import FrontMetrics
from understudy.wire import machine

OP, CL, AL = Isolation.OPEN, Isolation.CLEARING, Isolation.ALONE


def run(s: Suspects, *events: fsm.IsolationEvent) -> tuple[Suspects, list[fsm.IsolationAction]]:
    actions: list[fsm.IsolationAction] = []
    for e in events:
        s, more = isolate(s, e, 0.0)
        actions += more
    return s, actions


# ------------------------------------------------------------ the rule ----


def test_a_first_death_is_a_suspicion_and_stops_nothing() -> None:
    s, actions = run(Suspects(), Died(1), Died(2))
    assert s.phase is OP and dict(s.deaths) == {1: ("",), 2: ("",)}
    assert actions == [Suspected(1, 1), Suspected(2, 1)]
    assert may_send(s, 1, out=5, routed_for=1.0) and may_send(s, 3, out=5, routed_for=1.0)


def test_after_its_second_death_a_suspect_runs_alone_once_nothing_else_is_out() -> None:
    s, actions = run(Suspects(), Died(1), Died(2), Died(1))
    assert (s.phase, s.alone) == (CL, 1)
    assert actions[-2:] == [Suspected(1, 2), RunAlone(1)]
    assert not may_send(s, 1, out=1, routed_for=1.0)  # another is out: it finishes first
    assert not may_send(s, 2, out=0, routed_for=1.0)  # not its turn: held
    assert may_send(s, 1, out=0, routed_for=1.0)
    s, _ = run(s, Sent(1))
    assert s.phase is AL
    assert not may_send(s, 2, out=1, routed_for=1.0) and not may_send(s, 3, out=1, routed_for=1.0)


def test_a_turn_alone_waits_for_the_route_to_stand() -> None:
    """An engine that took over and dies at once is no trial of a suspect."""
    s, _ = run(Suspects(), Died(1, "a"), Died(1, "b"))
    assert not may_send(s, 1, out=0, routed_for=fsm.TRUSTED_AFTER_S - 0.01)
    assert may_send(s, 1, out=0, routed_for=fsm.TRUSTED_AFTER_S)
    assert may_send(Suspects(), 2, out=0, routed_for=0.0)  # nobody else waits for it


def test_an_engine_death_while_it_runs_alone_names_the_poison_at_its_third_death() -> None:
    s, _ = run(Suspects(), Died(1), Died(1), Sent(1))
    s, actions = run(s, Died(1))
    assert actions == [Poisoned(1, 3)]
    assert s == Suspects()  # forgotten: it is answered and gone


def test_a_suspect_that_completes_alone_is_cleared_and_the_next_one_gets_its_turn() -> None:
    s, _ = run(Suspects(), Died(1), Died(2), Died(1), Died(2))
    assert (s.alone, s.waiting) == (1, (2,))
    s, actions = run(s, Sent(1), Finished(1))
    assert actions == [Cleared(1), RunAlone(2)]
    assert (s.phase, s.alone, s.waiting) == (CL, 2, ())
    s, actions = run(s, Sent(2), Finished(2))
    assert actions == [Cleared(2)]
    assert s == Suspects()


def test_a_suspect_sent_alone_to_an_engine_others_saw_die_is_not_blamed() -> None:
    """The engine died under the others; their breaks ended the wait, and the
    suspect went out before the route moved on: its break there is no
    evidence. It keeps its turn, and its next engine judges it."""
    s, _ = run(Suspects(), Died(1, "a"), Died(1, "b"), Died(2, "b"), Sent(1))
    s, actions = run(s, Died(1, "b"))
    assert actions == [] and (s.phase, s.alone, s.deaths[1]) == (CL, 1, ("a", "b"))
    s, actions = run(s, Sent(1), Died(1, "c"))
    assert actions == [Poisoned(1, 3)]


def test_one_engine_death_counts_once_however_often_the_request_broke_there() -> None:
    """Sent again to the dead engine before the lock named the next one, the
    request breaks there again: still one death, no turn alone."""
    s, actions = run(Suspects(), Died(1, "a"), Died(1, "a"), Died(1, "a"))
    assert actions == [Suspected(1, 1)]
    assert (s.phase, dict(s.deaths)) == (OP, {1: ("a",)})


def test_a_suspect_refused_before_it_ran_keeps_its_turn() -> None:
    s, _ = run(Suspects(), Died(1), Died(1), Sent(1), Returned(1))
    assert (s.phase, s.alone) == (CL, 1)
    assert may_send(s, 1, out=0, routed_for=1.0)


def test_a_suspect_whose_wait_ran_out_passes_its_turn_without_being_cleared() -> None:
    s, _ = run(Suspects(), Died(1), Died(2), Died(1), Died(2))
    s, actions = run(s, Finished(1))
    assert actions == [RunAlone(2)]
    s, actions = run(s, Finished(2))
    assert actions == [] and s == Suspects()


def test_requests_that_died_once_are_forgotten_when_they_end() -> None:
    s, _ = run(Suspects(), Died(1), Died(2), Died(2), Finished(1))
    assert dict(s.deaths) == {2: ("", "")} and s.alone == 2


def test_a_poison_verdict_ends_the_request_whatever_its_migrations() -> None:
    p = fsm.Policy(hold_s=30, migration_limit=8)
    assert fsm.verdict(fsm.Attempt(True, True, 2, poison=True), fsm.Outcome.BROKEN, p) is (
        fsm.Verdict.POISON
    )
    assert fsm.verdict(fsm.Attempt(True, True, 2), fsm.Outcome.BROKEN, p) is (
        fsm.Verdict.MIGRATE_ONGOING
    )
    # the ceiling stays the last guard
    assert fsm.verdict(fsm.Attempt(False, False, 8), fsm.Outcome.BROKEN, p) is fsm.Verdict.FAIL


# ------------------------------------------------------ every pair ----

# One state per phase, with requests 1 (its turn, two deaths), 2 (one
# death) and 3 (two deaths, waiting its turn).
# Engine "x" is known dead.
TWICE, ONCE = ("w", "x"), ("x",)
STATES = {
    OP: Suspects(OP, {2: ONCE}, dead=("x",)),
    CL: Suspects(CL, {1: TWICE, 2: ONCE, 3: TWICE}, waiting=(3,), alone=1, dead=("x",)),
    AL: Suspects(AL, {1: TWICE, 2: ONCE, 3: TWICE}, waiting=(3,), alone=1, dead=("x",)),
}
EVENTS: list[fsm.IsolationEvent] = [
    Died(1, "y"), Died(1, "x"), Died(2, "y"), Died(2, "x"), Died(4, "y"), Sent(1),
    Sent(2), Returned(1), Returned(2), Finished(1), Finished(2), Finished(3),
]  # fmt: skip


def test_the_events_cover_every_event_kind_and_the_states_every_phase() -> None:
    assert {type(e) for e in EVENTS} == set(typing.get_args(fsm.IsolationEvent))
    assert set(STATES) == set(Isolation)
    judged = {fsm.blame(s, e) for s in STATES.values() for e in EVENTS}
    assert judged == set(Blame)


@pytest.mark.parametrize("phase", list(Isolation))
@pytest.mark.parametrize("event", EVENTS, ids=repr)
def test_every_pair_lands_where_the_table_says_or_raises_and_changes_nothing(
    phase: Isolation, event: fsm.IsolationEvent
) -> None:
    s = STATES[phase]
    entry = fsm.ISOLATION.get((phase, fsm.blame(s, event)))
    if entry is None:
        with pytest.raises(fsm.InvalidIsolation):
            isolate(s, event, 0.0)
        assert s == STATES[phase]
        return
    new, _ = isolate(s, event, 0.0)
    assert new.phase in entry.targets


def test_the_table_draws() -> None:
    assert machine.mermaid(fsm.ISOLATION, initial=OP).startswith("stateDiagram-v2")


# ------------------------------------------------------------ properties --


class Isolating(RuleBasedStateMachine):
    """A shell that obeys ``may_send``: requests go out, die, return and end at
    random; the invariants hold whatever the order."""

    def __init__(self) -> None:
        super().__init__()
        self.s = Suspects()
        self.engine = 0  # the Active engine's number; each death starts the next
        self.out: set[int] = set()
        self.poisoned: list[tuple[int, set[int]]] = []  # the poison, and who was out beside it

    def _step(self, e: fsm.IsolationEvent) -> list[fsm.IsolationAction]:
        self.s, actions = isolate(self.s, e, 0.0)
        return actions

    @rule(r=st.integers(1, 5))
    def send(self, r: int) -> None:
        if r in self.out or not may_send(self.s, r, len(self.out), 1.0):
            return
        self.out.add(r)
        if r == self.s.alone:
            self._step(Sent(r))

    @rule(data=st.data())
    def die(self, data: st.DataObject) -> None:
        """The engine dies: every request out at it breaks."""
        engine = f"e{self.engine}"
        self.engine += 1
        for r in sorted(self.out):
            beside = self.out - {r}
            for a in self._step(Died(r, engine)):
                if isinstance(a, Poisoned):
                    self.poisoned.append((a.request, beside))
                    self.out.discard(r)
                    self._end(r)
        self.out.clear()

    @rule(r=st.integers(1, 5))
    def complete(self, r: int) -> None:
        if r in self.out:
            self.out.discard(r)
            self._end(r)

    @rule(r=st.integers(1, 5))
    def gives_up(self, r: int) -> None:
        if r not in self.out:
            self._end(r)

    def _end(self, r: int) -> None:
        if r in self.s.deaths:
            self._step(Finished(r))

    @invariant()
    def a_poison_is_only_ever_named_alone(self) -> None:
        for _, beside in self.poisoned:
            assert not beside

    @invariant()
    def open_means_no_turn(self) -> None:
        if self.s.phase is OP:
            assert self.s.alone is None and not self.s.waiting
        else:
            assert self.s.alone is not None and self.s.alone not in self.s.waiting
            assert len(self.s.deaths.get(self.s.alone, ())) >= 2

    @invariant()
    def alone_means_alone(self) -> None:
        if self.s.phase is AL:
            assert self.out <= {self.s.alone}

    @invariant()
    def no_request_is_out_past_three_deaths(self) -> None:
        assert all(len(engines) <= 2 for engines in self.s.deaths.values())


Isolating.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_isolation_invariants = Isolating.TestCase


# ------------------------------------------- the forwarder carries it out --

MARKER = "POISON-PILL"
NAMES = ("engine-primary/aa", "engine-shadow-1/bb", "engine-shadow-2/cc")


class Pod:
    """A forwarder over three engine doubles; the engine that dies is back
    (a respawned process) a moment later, and the lock goes to the next."""

    def __init__(self, migration_limit: int = 8, seconds: float = 1.0) -> None:
        self.loop = asyncio.get_running_loop()
        self.engines = [Engine(n, self._behave(seconds), pid=100 + i) for i, n in enumerate(NAMES)]
        self.router = Router({e.name: e for e in self.engines})
        self.metrics = FrontMetrics()
        policy = fsm.Policy(hold_s=30.0, migration_limit=migration_limit)
        self.fwd = Forwarder(self.router, policy, self.metrics)
        self.epoch = 1
        self.deaths = 0
        self.router.set(NAMES[0], self.epoch)

    def _behave(self, seconds: float) -> Any:
        answer_later = after(seconds)

        async def behave(engine: Engine, answer: Answer, doc: dict[str, Any]) -> None:
            if MARKER in doc.get("prompt", ""):
                self.loop.call_soon(self.kill, engine)  # it kills the engine that starts it
                await asyncio.Event().wait()
            await answer_later(engine, answer, doc)

        return behave

    def kill(self, engine: Engine) -> None:
        if not engine.alive:
            return
        self.deaths += 1
        engine.die()
        self.router.set(None)
        self.loop.call_later(0.05, self._failover, engine)

    def kill_active(self) -> None:
        assert self.router.route is not None
        self.kill(self.router.engines[self.router.route.engine_id])

    def _failover(self, dead: Engine) -> None:
        # Respawned, a Standby again: a new process, so a new engine id.
        self.epoch += 1
        dead.alive = dead.listening = True
        dead.name = f"{dead.name.split('@')[0]}@{self.epoch}"
        self.router.engines[dead.name] = dead
        nxt = self.engines[(self.engines.index(dead) + 1) % len(self.engines)]
        self.router.set(nxt.name, self.epoch)

    def idle(self) -> bool:
        """Nothing out, no suspect left (the engines seen dying aside)."""
        iso = self.fwd.isolation
        return iso.out == 0 and replace(iso.state, dead=()) == Suspects()

    def send(self, prompt: str) -> Client:
        client = Client()
        self.fwd.handle(client.request({"prompt": prompt}))
        return client

    async def close(self) -> None:
        for e in self.engines:
            await e.close()


@pytest.mark.looptime
@pytest.mark.timeout(10)
async def test_a_poison_among_eight_is_told_after_three_deaths_and_the_rest_complete() -> None:
    pod = Pod()
    innocents = [pod.send(f"innocent {i}") for i in range(7)]
    poison = pod.send(f"tell me about {MARKER}")
    await poison.done.wait()
    for c in innocents:
        await c.done.wait()
    await asyncio.sleep(0)
    assert poison.status == 422
    assert b"Retry-After" not in poison.data
    message = json.loads(poison.body)["error"]["message"]
    assert "killed the engine that ran it alone" in message and "(3 in all)" in message
    assert pod.deaths == 3
    assert [c.status for c in innocents] == [200] * 7
    # all eight were out at the first two deaths: each ran alone in turn
    assert pod.metrics.poison.value == 1 and pod.metrics.isolated.value == 8
    assert pod.idle()
    await pod.close()


@pytest.mark.looptime
@pytest.mark.timeout(10)
async def test_innocents_through_back_to_back_double_faults_all_complete() -> None:
    """Eight clients, each sending its next request when the last is answered,
    through two rounds of two deaths (the engine that took over killed too):
    every request out at both deaths of a round runs alone after it and
    completes; none is failed, none blamed."""
    pod = Pod(seconds=0.3)
    answers: list[int] = []

    async def client(i: int) -> None:
        while pod.loop.time() - t0 < 6.0:
            c = pod.send(f"innocent {i}")
            await c.done.wait()
            answers.append(c.status)

    t0 = pod.loop.time()
    for t in (0.1, 0.2, 4.1, 4.2):  # the second round after the first one's turns alone
        pod.loop.call_at(t0 + t, pod.kill_active)
    await asyncio.gather(*(client(i) for i in range(8)))
    await asyncio.sleep(0)
    assert pod.deaths == 4
    assert len(answers) > 16 and set(answers) == {200}
    assert pod.metrics.poison.value == 0
    assert pod.metrics.isolated.value == 16  # each of the two rounds' eight, alone
    assert pod.idle()
    await pod.close()
