"""Scale-down ranking: which replicas leave first (Sokovan / GPUStack), pure.

When fewer replicas are wanted, or a rollout retires replicas of an older
spec, the existing replicas are scored and the lowest scores leave first:

* **status**: a replica that serves (in the Service's endpoints and fully
  armed) is worth keeping; removing one that does not serve costs no
  capacity;
* **freshness**: a replica of the current spec is worth more than one a
  rollout has yet to replace;
* ties go to the **highest index** first (Skyward's "highest ID first"), so
  scale-down is predictable and replica 0 leaves last.

A placement scorer (GPUStack reuses binpack/spread in reverse) is left out
on purpose: it would let a replica's node decide which index leaves, and
the order "not serving, then outdated, then highest index" is the one the
rollout and the autoscaler's property tests rely on.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

STATUS_WEIGHT = 100
FRESHNESS_WEIGHT = 10


class Incumbent(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def available(self) -> bool: ...
    @property
    def updated(self) -> bool: ...


def keep_score(r: Incumbent) -> int:
    """Higher: keep longer."""
    return STATUS_WEIGHT * r.available + FRESHNESS_WEIGHT * r.updated


T = TypeVar("T", bound=Incumbent)


def removal_order(replicas: Iterable[T]) -> list[T]:
    """Victims first: lowest keep score, then the highest index."""
    return sorted(replicas, key=lambda r: (keep_score(r), -r.index))
