"""kubelet's restart back-off for a container that keeps exiting (pure).

kubelet restarts a container that exited at once the first time, then waits
10 s, 20 s, 40 s, … capped at 5 minutes between starts (CrashLoopBackOff);
a container that stayed up long enough starts over with no delay. Same
rules here, time passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Policy:
    initial_s: float = 10.0
    max_s: float = 300.0
    # kubelet forgets a container's back-off once it has been quiet for twice
    # the cap; with the default cap that is ten minutes of running.
    reset_after_s: float = 600.0

    @classmethod
    def capped(cls, max_s: float) -> Policy:
        """kubelet's ``maxContainerRestartPeriod``: a lower cap, with the
        initial delay and the reset shrunk to match."""
        return cls(min(10.0, max_s), max_s, max(2 * max_s, 1.0))


@dataclass(frozen=True, slots=True)
class Backoff:
    delay_s: float = 0.0  # what the next exit costs; 0 until the first exit
    last_start: float | None = None


def exited(b: Backoff, policy: Policy, now: float) -> tuple[Backoff, float]:
    """A container exited at ``now``: the new record and when it may start again."""
    if b.last_start is None or now - b.last_start >= policy.reset_after_s or b.delay_s == 0:
        # First exit, or it ran long enough: restart at once, back-off armed.
        return Backoff(policy.initial_s, now), now
    start = max(now, b.last_start + b.delay_s)
    return Backoff(min(2 * b.delay_s, policy.max_s), start), start


def started(b: Backoff, now: float) -> Backoff:
    """Record a start (the back-off clock runs from the last start)."""
    return Backoff(b.delay_s, now)
