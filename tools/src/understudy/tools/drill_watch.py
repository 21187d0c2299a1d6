"""The drill's watcher: a thread that polls every engine's ``/state`` and
records what the drill judges safety and re-arming by (split-brain, epochs,
the Standby count over time, when each engine was first seen in Standby)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from understudy.tools import figures
from understudy.tools.drill_target import Target


class Watcher(threading.Thread):
    """Polls every engine's /state; records Active engines and checks safety.

    It also keeps ``timeline``: ``(monotonic time, Standby count)`` at every
    change, from which the drill computes how long the pod had no shadow
    (``figures.unarmed_spans``)."""

    def __init__(self, target: Target, period: float = 0.01) -> None:
        super().__init__(name="drill-watcher", daemon=True)
        self.target = target
        self.period = period
        self.stop = threading.Event()
        self.latest: list[dict[str, Any]] = []
        self.split_brain: list[dict[str, Any]] = []
        self.epoch_regressions: list[dict[str, Any]] = []
        self.timeline: list[tuple[float, int]] = []
        # engine id -> (container name, when it was first seen in Standby): the
        # re-arm is read from here, not from when the drill got round to looking
        self.standby_seen: dict[str, tuple[str, float]] = {}
        self.max_epoch = -1
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stop.is_set():
            engines = self.target.engines()
            now = time.monotonic()
            with self.lock:
                self.latest = engines
                self._check(engines, now)
            time.sleep(self.period)

    def _check(self, engines: list[dict[str, Any]], now: float) -> None:
        active = [e for e in engines if e.get("state") == "Active"]
        if figures.split_brain(engines):
            self.split_brain.append(
                {
                    "at": time.time(),
                    "active": [
                        {k: e.get(k) for k in ("name", "pid", "epoch", "asked_at", "granted_at")}
                        for e in active
                    ],
                }
            )
        for e in active:
            epoch = e.get("epoch") or 0
            if epoch < self.max_epoch:
                self.epoch_regressions.append(
                    {"name": e.get("name"), "epoch": epoch, "max_seen": self.max_epoch}
                )
            self.max_epoch = max(self.max_epoch, epoch)
        for e in engines:
            if e.get("state") == "Standby" and e.get("engine_id"):
                self.standby_seen.setdefault(e["engine_id"], (e.get("name") or "", now))
        standbys = sum(1 for e in engines if e.get("state") == "Standby")
        if not self.timeline or self.timeline[-1][1] != standbys:
            self.timeline.append((now, standbys))

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.latest)

    def until(self, cond: Callable[[list[dict[str, Any]]], Any], timeout: float) -> Any:
        """The first truthy ``cond(engines)`` within ``timeout``, else None."""
        return wait(lambda: cond(self.snapshot()), timeout)


def wait(cond: Callable[[], Any], timeout: float, period: float = 0.005) -> Any:
    """The first truthy ``cond()`` within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(period)
    return None
