"""Which replicas to add and which to retire: scale and rollout in one rule (pure).

Skyward's reconciler turns a desired count into provisions and drains; a
Deployment's rolling update replaces old pods surge-first. Both are one
question here, asked every pass: given the replicas (each *updated* or not,
*available* or not, *leaving* or not), the count wanted and the rollout
budget, which new replica indices start and which replicas leave?

* **Add** replicas of the current spec up to the count. While replicas of an
  older spec remain, up to ``max_surge`` more may exist than the count, so
  the replacement starts *before* the old replica goes.
* **Retire** replicas of an older spec only as far as availability allows:
  at most ``live - (count - max_unavailable) - unavailable updated`` of
  them (the Deployment controller's ``maxScaledDown``), so with the default
  ``max_surge=1, max_unavailable=0`` an old replica leaves only once its
  replacement is available.
* **Scale down**: updated replicas beyond the count leave.
* Victims in both cases follow the scheduler's removal ranking (not
  available first, then older spec, then the highest index).
* New replicas take the lowest free indices; an index stays taken until its
  replica has left for good (its pod name is the index), so a new pod never
  collides with a draining one.

Replicas that are leaving (draining, terminating) count for nothing: not
toward the count, not toward the surge (as in a Deployment; their devices
free up as they terminate, and kube-scheduler waits for them).

"Available" is decided by the caller: in the Service's endpoints and every
engine container ready (the pod's Ready, not merely Running).

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from understudy.operator.scheduler.ranking import removal_order


@dataclass(frozen=True, slots=True)
class Member:
    index: int
    updated: bool  # its pod has the current spec (or it has no pod yet)
    available: bool  # serving through the Service and fully armed
    leaving: bool = False  # draining or terminating


@dataclass(frozen=True, slots=True)
class Budget:
    count: int
    max_surge: int = 1
    max_unavailable: int = 0


@dataclass(frozen=True, slots=True)
class Moves:
    add: tuple[int, ...] = ()
    retire: tuple[int, ...] = ()


def free_indices(taken: set[int], n: int) -> tuple[int, ...]:
    out: list[int] = []
    i = 0
    while len(out) < n:
        if i not in taken:
            out.append(i)
        i += 1
    return tuple(out)


def moves(members: Sequence[Member], budget: Budget) -> Moves:
    live = [m for m in members if not m.leaving]
    old = [m for m in live if not m.updated]
    new = [m for m in live if m.updated]
    count = max(0, budget.count)

    # Scale the current spec up to the count; with old replicas around, at
    # most max_surge above it in total.
    ceiling = count + (budget.max_surge if old else 0)
    n_add = max(0, min(count - len(new), ceiling - len(live)))
    add = free_indices({m.index for m in members}, n_add)

    retire: list[Member] = []
    # Scale down: updated replicas beyond the count.
    if len(new) > count:
        retire += removal_order(new)[: len(new) - count]
    # Replace old replicas while enough stay available.
    if old:
        min_available = max(0, count - budget.max_unavailable)
        new_unavailable = sum(1 for m in new if not m.available and m not in retire)
        allowed = len(live) - min_available - new_unavailable - len(retire)
        retire += removal_order(old)[: max(0, allowed)]
    return Moves(add=add, retire=tuple(m.index for m in retire))
