"""The handlers' Requeue: one delayed pass per instance, the earliest asked for.

Timing is the subject here, so the tests run in fake loop time (looptime):
a sleep of 1.2 s takes no real time, and the times asserted are exact.
"""

from __future__ import annotations

import asyncio

import pytest

from understudy.operator.handlers import Requeue


@pytest.mark.looptime
async def test_the_earliest_wake_up_wins_and_fires_once() -> None:
    fired: list[float] = []
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def fire() -> None:
        fired.append(loop.time() - start)

    rq = Requeue()
    rq.after("a", 0.8, fire)
    rq.after("a", 5.0, fire)  # later: ignored
    rq.after("a", 0.6, fire)  # earlier: replaces
    rq.after("b", 0.0, fire)  # clamped to the minimum delay
    await asyncio.sleep(1.2)
    await rq.close()
    assert fired == [pytest.approx(Requeue.MIN_DELAY_S), pytest.approx(0.6)]


@pytest.mark.looptime
async def test_close_cancels_pending_wake_ups() -> None:
    fired: list[str] = []

    async def fire() -> None:
        fired.append("x")

    rq = Requeue()
    rq.after("a", 0.5, fire)
    await rq.close()
    await asyncio.sleep(0.7)
    assert fired == []
