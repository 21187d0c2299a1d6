"""Probe verdicts: a pure function of (endpoint, state, time in state, health, budgets).

Three endpoints on the engine's status port (docs/pod.md):

- ``/startup`` — 503 in Init (kubelet's startup probe covers model loading and
  graph capture, which take minutes), 200 once the engine has left Init.
- ``/live`` — Init 503 (unreachable in a pod: the startup probe gates it);
  Standby 200, an idle standby is alive; Waking 200 until the wake timeout,
  then 503, so a hung wake gets the container killed; Active: the serving
  endpoint's health; Draining 200 (it is finishing its requests); Dead 503.
- ``/ready`` — "a useful member of the pod": Standby 200, Active 200 when the
  serving endpoint is healthy, otherwise 503. Routing does not depend on it
  (see the readiness trap in docs/pod.md); pod Ready means "fully armed".
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from understudy.engine_shim.fsm import Budgets, State


class Probe(enum.Enum):
    STARTUP = "startup"
    LIVE = "live"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class Verdict:
    status: int
    reason: str

    @property
    def ok(self) -> bool:
        return self.status == 200


OK, FAIL = 200, 503


@dataclass(frozen=True, slots=True)
class Seen:
    """What a verdict is judged on, besides the probe and the state."""

    time_in_state: float
    serving_healthy: bool
    budgets: Budgets
    serving_detail: str = ""


Rule = Callable[[Seen], Verdict]


def _always(status: int, reason: str) -> Rule:
    return lambda seen: Verdict(status, reason)


def _initialising(status: int) -> Rule:
    return lambda seen: Verdict(status, f"initialising for {seen.time_in_state:.1f}s")


def _live_while_waking(seen: Seen) -> Verdict:
    """A wake that outlasts its timeout is hung: fail, so the container is replaced."""
    t, limit = seen.time_in_state, seen.budgets.wake_s
    if t > limit:
        return Verdict(FAIL, f"waking for {t:.1f}s > {limit:g}s")
    return Verdict(OK, f"waking for {t:.1f}s")


def _serving(seen: Seen) -> Verdict:
    if seen.serving_healthy:
        return Verdict(OK, "active, serving")
    return Verdict(FAIL, f"active, serving endpoint unhealthy: {seen.serving_detail}")


def _draining(seen: Seen) -> Verdict:
    return Verdict(OK, f"draining for {seen.time_in_state:.1f}s")


def _started(state: State) -> Rule:
    return _always(OK, f"started ({state.value})")


# (probe, state) -> rule: the one place the verdicts are decided (module docstring).
VERDICTS: dict[tuple[Probe, State], Rule] = {
    (Probe.STARTUP, State.INIT): _initialising(FAIL),
    **{(Probe.STARTUP, s): _started(s) for s in State if s not in (State.INIT, State.DEAD)},
    (Probe.LIVE, State.INIT): _initialising(FAIL),
    (Probe.LIVE, State.STANDBY): _always(OK, "standby"),
    (Probe.LIVE, State.WAKING): _live_while_waking,
    (Probe.LIVE, State.ACTIVE): _serving,
    (Probe.LIVE, State.DRAINING): _draining,
    (Probe.READY, State.INIT): _initialising(FAIL),
    (Probe.READY, State.STANDBY): _always(OK, "standby"),
    (Probe.READY, State.WAKING): _always(FAIL, "waking: not serving yet"),
    (Probe.READY, State.ACTIVE): _serving,
    (Probe.READY, State.DRAINING): _always(FAIL, "draining: takes no new requests"),
    **{(p, State.DEAD): _always(FAIL, "dead") for p in Probe},
}


def verdict(
    probe: Probe,
    state: State,
    time_in_state: float,
    serving_healthy: bool,
    budgets: Budgets,
    serving_detail: str = "",
) -> Verdict:
    seen = Seen(time_in_state, serving_healthy, budgets, serving_detail)
    return VERDICTS[(probe, state)](seen)
