"""The built-in autoscaler: desired replicas from request pressure (pure).

Skyward's split: this module is the policy, a pure function of what was
observed; the reconciler that turns a count into pods and drains is
``rollout.py`` plus the lifecycle. The policy is the HPA's, restated for
one metric:

* **pressure** is what every pod's front reports on ``/pressure``: requests
  being served plus requests held waiting for an Active engine. Per replica
  it is ``None`` when unknown (the front did not answer, the pod is not up
  yet);
* the **raw recommendation** is ``ceil(total / target)``, clamped to
  ``[min, max]``. Unknown replicas count as idle when that argues for
  growing and as exactly on target when that argues for shrinking, so a
  replica that cannot be read never causes a scale-down (the HPA treats
  missing pods the same way); with no replica known there is no
  recommendation and the count holds;
* **stabilisation**: every change of the raw recommendation is recorded
  with its time. A scale-up goes to the *lowest* recommendation of the last
  ``up_window`` seconds, a scale-down to the *highest* of the last
  ``down_window`` seconds. Hence no flapping: after a scale-up to N at t the
  count stays >= N until ``t + down_window``, and after a scale-down to M it
  stays <= M until ``t + up_window``;
* **idle**: no pressure at all recommends ``min``, so an idle instance
  returns to ``min`` one down-window after its load ended (Skyward's
  scale-to-min on idle, with the window as its idle timeout).

Only changes of the raw recommendation are recorded, and a recommendation
holds until the next one; the value in force when a window opens counts
for that window. The record is bounded (:data:`MAX_RECOMMENDATIONS`): past
the bound the two oldest entries merge into one that keeps both the lowest
and the highest value (the up-window reads the lows, the down-window the
highs), so a merge can only make either window more cautious, never break
the no-flapping guarantee. The record is persisted in the GpuInstance's
status, so the windows survive an operator restart.

Core module: no I/O imports; ``now`` is seconds (any clock; the shell uses
wall-clock time because the record is persisted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

MAX_RECOMMENDATIONS = 64


@dataclass(frozen=True, slots=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target: int  # pressure per replica aimed at (>= 1)
    up_window: float = 0.0
    down_window: float = 300.0

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True, slots=True)
class Recommendation:
    """Raw recommendations from ``time`` until the next entry: between ``low`` and ``high``.

    ``low == high`` unless older entries were merged to bound the record.
    """

    time: float
    low: int
    high: int


@dataclass(frozen=True, slots=True)
class State:
    """Recorded raw recommendations, oldest first, one entry per change."""

    recommendations: tuple[Recommendation, ...] = ()
    last_scale: float | None = None


class Reason(StrEnum):
    SCALE_UP = "ScaleUp"
    SCALE_DOWN = "ScaleDown"
    IDLE = "Idle"  # scale-down to min: no pressure
    STABLE = "Stable"
    STABILIZING = "Stabilizing"  # the raw recommendation differs, a window holds the count
    PRESSURE_UNKNOWN = "PressureUnknown"
    OUT_OF_BOUNDS = "OutOfBounds"  # the count was outside [min, max]


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    current: int
    raw: int | None
    pressure: int | None  # total known pressure
    reason: Reason
    message: str

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def recommend(policy: Policy, pressures: Sequence[int | None], current: int) -> int | None:
    """The raw recommendation, or None when no replica's pressure is known."""
    known = [p for p in pressures if p is not None]
    if not known:
        return None
    unknown = len(pressures) - len(known)
    total = sum(known)
    grow = _ceil_div(total, policy.target)  # unknown replicas idle
    shrink = _ceil_div(total + unknown * policy.target, policy.target)  # unknown on target
    if grow > current:
        raw = grow
    elif shrink < current:
        raw = shrink
    else:
        raw = current
    return policy.clamp(raw)


def _window(recs: Sequence[Recommendation], now: float, width: float) -> list[Recommendation]:
    """The entries in force at some time in ``[now - width, now]``."""
    start = now - width
    inside = [r for r in recs if r.time > start]
    before = [r for r in recs if r.time <= start]
    return [*before[-1:], *inside]


def _record(state: State, raw: int, now: float, keep: float) -> tuple[Recommendation, ...]:
    recs = list(state.recommendations)
    if not recs or (recs[-1].low, recs[-1].high) != (raw, raw):
        recs.append(Recommendation(now, raw, raw))
    # Drop what no window can see any more, but keep the entry in force at
    # the oldest window's start.
    start = now - keep
    while len(recs) > 1 and recs[1].time <= start:
        recs.pop(0)
    while len(recs) > MAX_RECOMMENDATIONS:
        a, b = recs[0], recs[1]
        recs[:2] = [Recommendation(a.time, min(a.low, b.low), max(a.high, b.high))]
    return tuple(recs)


def decide(
    policy: Policy, state: State, pressures: Sequence[int | None], current: int, now: float
) -> tuple[State, Decision]:
    """One autoscaling step: the new state and the decided replica count."""
    total_known = sum(p for p in pressures if p is not None)
    any_known = any(p is not None for p in pressures)
    pressure = total_known if any_known else None
    clamped = policy.clamp(current)
    if clamped != current:
        decision = Decision(
            clamped,
            current,
            None,
            pressure,
            Reason.OUT_OF_BOUNDS,
            f"{current} replicas outside [{policy.min_replicas}, {policy.max_replicas}]",
        )
        return State(state.recommendations, now), decision
    raw = recommend(policy, pressures, current)
    if raw is None:
        decision = Decision(
            current, current, None, None, Reason.PRESSURE_UNKNOWN, "no replica's pressure known"
        )
        return state, decision
    recs = _record(state, raw, now, max(policy.up_window, policy.down_window))
    up = min(r.low for r in _window(recs, now, policy.up_window))
    down = max(r.high for r in _window(recs, now, policy.down_window))
    desired = current
    desired = max(desired, up)
    desired = min(desired, down)
    per = f"pressure {total_known} for target {policy.target}/replica"
    if desired > current:
        reason, message = Reason.SCALE_UP, f"{per}: {current} -> {desired}"
    elif desired < current:
        idle = total_known == 0 and all(p is not None for p in pressures)
        reason = Reason.IDLE if idle and desired == policy.min_replicas else Reason.SCALE_DOWN
        message = f"{per}: {current} -> {desired}"
    elif raw != current:
        window = policy.up_window if raw > current else policy.down_window
        reason = Reason.STABILIZING
        message = f"{per}: recommends {raw}, held at {current} by the {window:g} s window"
    else:
        reason, message = Reason.STABLE, f"{per}: {current}"
    last = now if desired != current else state.last_scale
    return State(recs, last), Decision(desired, current, raw, pressure, reason, message)
