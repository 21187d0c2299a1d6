"""``understudy drill``: kill the active engine under load, N times, and measure.

Clients (16 by default) keep continuous request streams against the serving
endpoint, mixing the kinds of request the engine serves (for a generative
engine: chat and text completions, streaming and not, greedy, so every answer
of a kind must be identical). Each round: wait until the pod is armed (one
Active engine, the others Standby), kill the Active engine's process with the
chosen signal, and measure

- each stream's stall: for every stream in flight at the kill, from its last
  token before the kill to its first after, against the same streams' time
  between tokens over the drill (``stalls``): the headline, what a reader
  of a streamed answer waits through,
- kill → lock granted → Active (from the new engine's ``/state``),
- the longest time with no request completed after the kill, up to the
  first request that started after it (``gap_s``; on a model whose answers
  take seconds, that is seconds with or without a kill),
- failed requests, and re-arm: kill → the killed engine back in Standby.

The modules: the pod and its processes (``drill_target``), the clients
(``drill_load``), the watcher (``drill_watch``), the rounds and what is
reported of them (``drill_result``), the figures (``figures``, ``stalls``,
``series``); the sidecar drills are ``drill_sidecar`` and ``drill_front``.

A watcher polls every engine's ``/state`` all along and counts split-brain
(two engines Active at once, or an epoch that does not rise), and after each
failover checks that only the new Active engine listens for requests. Exit
status 1 if any request failed, any answer differed, any check failed or a
round had no failover: an engine death may cost latency, never an error.
"""

from __future__ import annotations

import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from understudy.tools import figures
from understudy.tools.drill_load import Client, Kind, Poisoner, fold, kinds_for
from understudy.tools.drill_result import Report, Round, round_line
from understudy.tools.drill_target import Target, isolation_open
from understudy.tools.drill_watch import Watcher, wait
from understudy.tools.series import KILL_WINDOW_S, RECENT, Sample, Tally

SCENARIOS = ("takeover-kill", "lockserver", "gms")
STEADY_S = 30.0  # the stretch before each kill whose gaps between answers are the baseline
# The clients move in step after a failover (every request it caught starts
# again at once, all of one length), so a kill at a fixed delay after the pod
# re-arms lands at the same point of their cycle every round: in one run of
# SmolLM2 with 8 clients, every kill caught the streams in their prefills,
# and 10 kills caught 1 stream between two tokens. Each kill waits a further
# random part of one request's duration (the median of the last ones:
# series.RECENT, and those not folded yet).


class Session:
    """One drill's load: the clients, the tally of what they recorded and the
    rounds so far. The figures come from ``figures``; a pod's drill adds its
    watcher (``_Session``), a fleet's its pods' (``drill_fleet``)."""

    def __init__(self, serve_url: str, kinds: list[Kind], clients: int) -> None:
        self.kinds = kinds
        self.pool = [Client(serve_url, kinds, i) for i in range(clients)]
        self.tally = Tally()
        self.rounds: list[Round] = []
        self.origin = time.monotonic()
        for c in self.pool:
            c.start()

    def samples(self) -> list[Sample]:
        return [s for c in self.pool for s in list(c.samples)]

    def request_s(self) -> float:
        """The median duration of the last answered requests (0 before any)."""
        done = [*self.tally.recent_s, *(s.end - s.start for s in self.samples() if s.ok)]
        return statistics.median(done[-RECENT:]) if done else 0.0

    def killed_at(self) -> list[float]:
        return [self.origin + r.kill_at_s for r in self.rounds if r.kill_at_s is not None]

    def fold(self, before: float) -> None:
        fold(self.pool, self.tally, before, self.killed_at())

    def steady_since(self) -> float:
        """Where the steady stretch before the next kill starts: STEADY_S ago,
        or once the previous failover had served again, if later."""
        t0 = time.monotonic() - STEADY_S
        if self.rounds and (last := self.rounds[-1]).kill_at_s is not None:
            settle = last.first_served_s or KILL_WINDOW_S[1]
            t0 = max(t0, self.origin + last.kill_at_s + settle)
        return t0

    def close(self) -> None:
        """Stop the clients and fold everything they recorded."""
        for c in self.pool:
            c.stop.set()
        for c in self.pool:
            c.join(120)
        self.fold(float("inf"))

    def served_again(self, rnd: Round, t_kill: float, timeout: float) -> None:
        """Wait for the first request started after the kill to be answered;
        fill in the round's first-served, gap and failures (or its error)."""
        ok = wait(lambda: figures.first_served(self.samples(), t_kill), timeout)
        if ok is None:
            rnd.error = rnd.error or f"no successful request within {timeout}s of the kill"
            return
        samples = self.samples()
        rnd.first_served_s = ok.end - t_kill
        rnd.gap_s = figures.client_gap(samples, t_kill, ok)
        rnd.failed_requests = figures.failed_between(samples, t_kill, ok.end + timeout)

    def report(self, signal: str, clients: int) -> Report:
        """What every drill reports of its load: the requests, the answers
        that differ, and each round's streams' stalls."""
        tally = self.tally
        # the tally's kills are the rounds that sent one, in order
        for k, rnd in enumerate(r for r in self.rounds if r.kill_at_s is not None):
            rnd.stalls_s = [x.stall_s for x in tally.stalls if x.kill == k]
        return Report(
            rounds=self.rounds,
            requests=tally.requests,
            failed_requests=tally.failed,
            wrong_answers=tally.wrong_answers(),
            signal=signal,
            clients=clients,
            by_kind=tally.by_kind,
            errors=tally.errors,
            series=tally.series(self.kinds, self.origin, self.killed_at()),
            stalls=tally.stalls,
            between=tally.between,
        )


class _Session(Session):
    """A pod's drill: the load, and the watcher on the pod's engines."""

    def __init__(self, target: Target, watcher: Watcher, kinds: list[Kind], clients: int) -> None:
        super().__init__(target.serve_url, kinds, clients)
        self.target = target
        self.watcher = watcher

    def close(self) -> None:
        super().close()
        self.watcher.stop.set()
        self.watcher.join(5)


@dataclass(frozen=True)
class _Plan:
    """What every round of one drill does."""

    sigs: list[int]
    names: list[str]
    scenario: str | None
    timeout: float
    rearm: bool
    check_serving: bool
    takeover_delay: float = 0.0  # takeover-kill: after the new engine is seen Active
    every: float | None = None  # a round's kill this long after the last one's, at the soonest


def _kill(ses: _Session, plan: _Plan, rnd: Round, active: dict[str, Any]) -> tuple[float, float]:
    """Kill the Active engine (and, by scenario, a second thing inside the
    failover); returns the kill's monotonic and wall-clock times."""
    sig = plan.sigs[(rnd.index - 1) % len(plan.sigs)]
    time.sleep(0.2)  # steady traffic before the kill
    if plan.every and (kills := ses.killed_at()):
        # Rounds back to back: faults stack on requests that lived through the last one.
        time.sleep(max(0.0, kills[-1] + plan.every - time.monotonic()))
    time.sleep(random.uniform(0.0, ses.request_s()))
    t_kill, wall_kill = time.monotonic(), time.time()
    ses.target.kill(active, sig)
    rnd.kill_at_s = t_kill - ses.origin
    if plan.scenario in ("lockserver", "gms"):
        # A second fault inside the failover: the sidecar dies while the next
        # engine is being granted (lock server) or wakes (GMS).
        ses.target.kill_sidecar(plan.scenario)
        rnd.also_killed = plan.scenario
    elif plan.scenario == "takeover-kill":
        taker = ses.watcher.until(lambda es: figures.successor(es, rnd.killed_epoch), plan.timeout)
        if taker is not None:
            # The engine that just took over dies too, as soon as it serves
            # (or ``takeover_delay`` later: with requests sent to it).
            time.sleep(plan.takeover_delay)
            ses.target.kill(taker, sig)
            rnd.also_killed = taker["name"]
            rnd.killed_epoch = taker.get("epoch") or rnd.killed_epoch
    return t_kill, wall_kill


def _measure(ses: _Session, plan: _Plan, rnd: Round, t_kill: float, wall_kill: float) -> None:
    """Wait for the successor and the first request it serves; fill in the round."""
    new = ses.watcher.until(lambda es: figures.successor(es, rnd.killed_epoch), plan.timeout)
    if new is None:
        rnd.error = f"no new Active engine within {plan.timeout}s"
        return
    rnd.new_active, rnd.new_epoch = new["name"], new.get("epoch") or 0
    if (w := figures.wake(new, wall_kill)) is not None:
        rnd.kill_to_grant_s, rnd.grant_to_active_s = w.kill_to_grant_s, w.grant_to_active_s
        rnd.kill_to_active_s = w.kill_to_active_s
    if plan.check_serving and (listeners := ses.target.serving_listeners()) is not None:
        rnd.serving_ok = listeners == {new.get("pid")}
    ses.served_again(rnd, t_kill, plan.timeout)
    if plan.rearm:
        back = ses.watcher.until(
            lambda es: figures.rearmed(es, rnd.killed, rnd.killed_engine_id), plan.timeout
        )
        if back:
            with ses.watcher.lock:
                seen = dict(ses.watcher.standby_seen)
            rnd.rearm_s = figures.rearm_s(seen, rnd.killed, rnd.killed_engine_id, t_kill)


def _round(ses: _Session, plan: _Plan, i: int, log: Callable[[str], None]) -> bool:
    """One kill and its measurements; False when the pod was never armed."""
    # The last round's suspects cleared first (isolation_open): each round's
    # faults stand on their own, not as a third death of one request.
    if wait(lambda: isolation_open(ses.target), plan.timeout, 0.05) is None:
        log(f"round {i}: a suspect still waits to run alone after {plan.timeout}s; killing anyway")
    got = ses.watcher.until(figures.armed, plan.timeout)
    if got is None:
        ses.rounds.append(Round(i, "?", 0, 0, error="pod not armed"))
        return False
    active = got[0]
    rnd = Round(
        i,
        active["name"],
        active["pid"],
        active.get("epoch") or 0,
        killed_engine_id=active.get("engine_id", ""),
        signal=plan.names[(i - 1) % len(plan.names)],
        steady_gap_s=figures.steady_gap(ses.samples(), ses.steady_since(), time.monotonic()),
    )
    # what ended well before this round's kill is needed only as counts
    ses.fold(time.monotonic() + KILL_WINDOW_S[0] - 0.5)
    t_kill, wall_kill = _kill(ses, plan, rnd, active)
    _measure(ses, plan, rnd, t_kill, wall_kill)
    ses.rounds.append(rnd)
    log(f"round {i}: {rnd.error}" if rnd.error else round_line(rnd))
    return True


def drill(
    target: Target,
    kills: int,
    sig: int | list[int],
    *,
    scenario: str | None = None,
    timeout: float = 60.0,
    rearm: bool = True,
    log: Callable[[str], None] = print,
    check_serving: bool = True,
    clients: int = 16,
    max_tokens: int = 32,
    takeover_delay: float = 0.0,
    every: float | None = None,
    poison: str | None = None,
) -> Report:
    """``kills`` rounds of: wait until armed, kill the Active engine, measure.
    ``poison``: also send one request holding this marker (the pod's engines
    armed with failpoint ``engine.poison``), reported apart."""
    sigs = sig if isinstance(sig, list) else [sig]
    names = [signal.Signals(x).name.removeprefix("SIG") for x in sigs]
    plan = _Plan(sigs, names, scenario, timeout, rearm, check_serving, takeover_delay, every)
    watcher = Watcher(target)
    watcher.start()
    first = watcher.until(figures.armed, timeout)
    if first is None:
        watcher.stop.set()
        raise RuntimeError(f"pod not armed (one Active, at least one Standby) within {timeout}s")
    kinds = kinds_for(first[0].get("adapter", "reference"), max_tokens)
    ses = _Session(target, watcher, kinds, clients)
    poisoner = Poisoner(target.serve_url, poison) if poison else None
    try:
        if poisoner is not None:
            poisoner.start()
        for i in range(1, kills + 1):
            if not _round(ses, plan, i, log):
                break
        if poisoner is not None:
            poisoner.join(poisoner.timeout)
            # The others served after it, once the pod is armed again, count too.
            ses.watcher.until(figures.armed, timeout)
            time.sleep(2.0)
    finally:
        ses.close()
    report = _report(ses, plan, clients)
    if poisoner is not None:
        report.poison = dict(poisoner.result)
    return report


def _report(ses: _Session, plan: _Plan, clients: int) -> Report:
    w = ses.watcher
    end = time.monotonic()
    report = ses.report(
        ",".join(plan.names) + (f" +{plan.scenario}" if plan.scenario else ""), clients
    )
    report.split_brain = w.split_brain
    report.epoch_regressions = w.epoch_regressions
    report.unarmed = figures.unarmed_figures(
        figures.unarmed_spans(w.timeline, ses.origin, end), end - ses.origin
    )
    return report
