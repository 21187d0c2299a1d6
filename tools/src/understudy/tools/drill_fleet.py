"""``understudy drill --scenario pod-kill|pod-freeze``: a whole pod lost, or
frozen, under load, N times (issue 28, "streams survive the pod").

Against a fleet (``understudy local up --pods N``: pods behind the gateway),
clients load the gateway as the engine drill's load a pod. Each round waits
until the fleet is armed (every pod routable at the gateway and armed inside:
an Active engine and a Standby), takes the pod serving the most streams (the
gateway's ``/state``; else the first routable one), and

- ``pod-kill``: SIGKILLs every process of it at once, as a node's loss
  would; the supervisor brings the pod back as kubelet would;
- ``pod-freeze``: SIGSTOPs every process of it for ``freeze_s``, then
  SIGCONTs them: a partition that heals, a node that stalls.

Measured per round, with the engine drill's machinery (``drill.Session``):
each stream's stall at the fault (its last token before -> first after,
``stalls``), the failed requests, the answers that differ from the others
of their kind (greedy: any difference is a wrong answer), the detection
(the fault -> the gateway no longer routes to the pod, and why: ``reset``,
``refused``, ``silent``), and the re-arm (the fault -> the fleet armed
again). A watcher on each pod's engines counts split-brain inside a pod.
Exit status as the engine drill's (``figures.verdict``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from understudy.tools import figures
from understudy.tools.drill import Session
from understudy.tools.drill_load import Kind, kinds_for
from understudy.tools.drill_result import Report, Round, pod_round_line
from understudy.tools.drill_target import FleetTarget, signal_all
from understudy.tools.drill_watch import Watcher, wait
from understudy.tools.series import KILL_WINDOW_S

SCENARIOS = ("pod-kill", "pod-freeze")
_SIGNAL = {"pod-kill": "KILL", "pod-freeze": "STOP"}
WATCH_PERIOD_S = 0.05  # each pod's engines, for split-brain and arming
DETECT_PERIOD_S = 0.01  # the gateway's /state, from the fault until it stops routing


@dataclass(frozen=True)
class _Plan:
    scenario: str
    freeze_s: float
    timeout: float


def _armed(target: FleetTarget, watchers: dict[str, Watcher]) -> dict[str, Any] | None:
    """The gateway's ``/state`` once the fleet is armed, else None."""
    view = target.gateway_state()
    engines = {name: w.snapshot() for name, w in watchers.items()}
    return view if view is not None and figures.fleet_armed(view["pods"], engines) else None


class _FleetSession(Session):
    """A fleet's drill: the load on the gateway, and a watcher on each pod."""

    def __init__(
        self, target: FleetTarget, watchers: dict[str, Watcher], kinds: list[Kind], clients: int
    ) -> None:
        super().__init__(target.serve_url, kinds, clients)
        self.target = target
        self.watchers = watchers

    def armed(self) -> dict[str, Any] | None:
        return _armed(self.target, self.watchers)

    def close(self) -> None:
        super().close()
        _stop(self.watchers)


def _stop(watchers: dict[str, Watcher]) -> None:
    for w in watchers.values():
        w.stop.set()
    for w in watchers.values():
        w.join(5)


def _detect(ses: _FleetSession, rnd: Round, t_fault: float, within: float) -> None:
    """Poll the gateway from the fault until it no longer routes to the pod."""

    def seen() -> tuple[float, figures.PodView] | None:
        view = ses.target.gateway_state()
        if view is None:
            return None
        pod = figures.pod_unroutable(view["pods"], rnd.killed, rnd.killed_epoch)
        return (time.monotonic(), pod) if pod is not None else None

    got = wait(seen, within, DETECT_PERIOD_S)
    if got is None:
        rnd.error = f"the gateway still routed to {rnd.killed} {within:g}s after the fault"
        return
    at, pod = got
    rnd.detect_s = at - t_fault
    rnd.reason = str(pod.get("reason") or pod.get("phase") or "")


def _round(ses: _FleetSession, plan: _Plan, i: int, log: Callable[[str], None]) -> bool:
    """One fault to the busiest pod and its measurements; False when the
    fleet was never armed."""
    if ses.armed() is None and wait(ses.armed, plan.timeout) is None:
        ses.rounds.append(Round(i, "?", 0, 0, error="fleet not armed"))
        return False
    time.sleep(0.2)  # steady traffic before the fault
    # the pod serving the most streams: wait a little for one to be open
    view = (
        wait(
            lambda: (
                (v := ses.target.gateway_state()) and any(p.get("streams") for p in v["pods"]) and v
            ),
            2.0,
        )
        or ses.target.gateway_state()
    )
    pod = figures.busiest_pod(view["pods"]) if view else None
    if pod is None:
        ses.rounds.append(Round(i, "?", 0, 0, error="no pod routable"))
        return False
    rnd = Round(
        i,
        str(pod["name"]),
        0,
        int(pod.get("generation") or 0),
        signal=_SIGNAL[plan.scenario],
        steady_gap_s=figures.steady_gap(ses.samples(), ses.steady_since(), time.monotonic()),
        whole_pod=True,
    )
    # what ended well before this round's fault is needed only as counts
    ses.fold(time.monotonic() + KILL_WINDOW_S[0] - 0.5)
    t_fault = time.monotonic()
    if plan.scenario == "pod-kill":
        pids = ses.target.kill_pod(rnd.killed)
        rnd.kill_at_s = t_fault - ses.origin
        _detect(ses, rnd, t_fault, plan.timeout)
    else:
        pids = ses.target.stop_pod(rnd.killed)
        rnd.kill_at_s = t_fault - ses.origin
        try:
            _detect(ses, rnd, t_fault, plan.freeze_s)
            time.sleep(max(0.0, t_fault + plan.freeze_s - time.monotonic()))
        finally:
            signal_all(pids, signal.SIGCONT)
    rnd.killed_pid = len(pids)  # a pod has no one pid: how many processes it had
    ses.served_again(rnd, t_fault, plan.timeout)
    back = wait(ses.armed, plan.timeout)
    if back is None:
        rnd.error = rnd.error or f"fleet not armed again within {plan.timeout}s"
    else:
        rnd.rearm_s = time.monotonic() - t_fault
        again = [p for p in back["pods"] if p.get("name") == rnd.killed]
        rnd.new_active = rnd.killed
        rnd.new_epoch = int(again[0].get("generation") or 0) if again else 0
    ses.rounds.append(rnd)
    log(f"round {i}: {rnd.error}" if rnd.error else pod_round_line(rnd))
    return True


def fleet_drill(
    target: FleetTarget,
    rounds: int,
    scenario: str,
    *,
    freeze_s: float = 5.0,
    timeout: float = 60.0,
    log: Callable[[str], None] = print,
    clients: int = 16,
    max_tokens: int = 32,
) -> Report:
    """``rounds`` rounds of: wait until the fleet is armed, kill or freeze the
    pod serving the most streams, measure."""
    if scenario not in SCENARIOS:
        raise ValueError(f"not a fleet scenario: {scenario!r} (one of {', '.join(SCENARIOS)})")
    plan = _Plan(scenario, freeze_s, timeout)
    watchers = {name: Watcher(pod, WATCH_PERIOD_S) for name, pod in target.pods.items()}
    for w in watchers.values():
        w.start()
    if wait(lambda: _armed(target, watchers), timeout) is None:
        _stop(watchers)
        raise RuntimeError(
            f"fleet not armed (every pod routable, one Active and a Standby each) within {timeout}s"
        )
    first = figures.armed(next(iter(watchers.values())).snapshot())
    adapter = first[0].get("adapter", "reference") if first else "reference"
    ses = _FleetSession(target, watchers, kinds_for(adapter, max_tokens), clients)
    try:
        for i in range(1, rounds + 1):
            if not _round(ses, plan, i, log):
                break
    finally:
        ses.close()
    report = ses.report(f"{_SIGNAL[scenario]} +{scenario}", clients)
    for name, w in watchers.items():
        report.split_brain += [{"pod": name, **x} for x in w.split_brain]
        report.epoch_regressions += [{"pod": name, **x} for x in w.epoch_regressions]
    return report
