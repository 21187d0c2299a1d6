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


def verdict(  # noqa: C901
    probe: Probe,
    state: State,
    time_in_state: float,
    serving_healthy: bool,
    budgets: Budgets,
    serving_detail: str = "",
) -> Verdict:
    match probe, state:
        case (_, State.DEAD):
            return Verdict(FAIL, "dead")
        case (Probe.STARTUP, State.INIT):
            return Verdict(FAIL, f"initialising for {time_in_state:.1f}s")
        case (Probe.STARTUP, _):
            return Verdict(OK, f"started ({state.value})")
        case (Probe.LIVE, State.INIT) | (Probe.READY, State.INIT):
            return Verdict(FAIL, f"initialising for {time_in_state:.1f}s")
        case (Probe.LIVE, State.STANDBY) | (Probe.READY, State.STANDBY):
            return Verdict(OK, "standby")
        case (Probe.LIVE, State.WAKING):
            if time_in_state > budgets.wake_s:
                return Verdict(FAIL, f"waking for {time_in_state:.1f}s > {budgets.wake_s:g}s")
            return Verdict(OK, f"waking for {time_in_state:.1f}s")
        case (Probe.READY, State.WAKING):
            return Verdict(FAIL, "waking: not serving yet")
        case (Probe.LIVE, State.DRAINING):
            return Verdict(OK, f"draining for {time_in_state:.1f}s")
        case (Probe.READY, State.DRAINING):
            return Verdict(FAIL, "draining: takes no new requests")
        case (_, State.ACTIVE):
            if serving_healthy:
                return Verdict(OK, "active, serving")
            return Verdict(FAIL, f"active, serving endpoint unhealthy: {serving_detail}")
    raise AssertionError(f"unhandled probe {probe} in {state}")  # pragma: no cover
