"""The handlers' Requeue: one delayed pass per instance, the earliest asked for."""

from __future__ import annotations

import asyncio

from understudy.operator.handlers import Requeue


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
    assert len(fired) == 2
    assert Requeue.MIN_DELAY_S - 0.05 <= fired[0] < 0.6
    assert 0.55 <= fired[1] < 0.8


async def test_close_cancels_pending_wake_ups() -> None:
    fired: list[str] = []

    async def fire() -> None:
        fired.append("x")

    rq = Requeue()
    rq.after("a", 0.5, fire)
    await rq.close()
    await asyncio.sleep(0.7)
    assert fired == []
