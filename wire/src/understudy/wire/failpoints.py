"""Named fault-injection points, off unless set (after etcd's gofail and TiKV's fail-rs).

A failpoint is a named place on a real code path where a test makes that path
fail, so process-level tests exercise the real error handling (an engine
whose init raises must exit at once; a wake that hangs must end at the wake
timeout) without a fake build. The code marks the place::

    failpoints.hit("engine.init")

and a test arms it through the environment of the process under test::

    UNDERSTUDY_FAILPOINTS="engine.init=raise;engine.wake=sleep(2)"

Actions:

- ``raise``: raise :class:`FailpointError` (an ordinary exception: the path's
  own error handling takes it);
- ``hang``: block the calling thread for ever;
- ``sleep(S)``: block it for S seconds, then carry on;
- ``exit(N)``: end the process at once with code N (``os._exit``: no cleanup,
  as a crash).

Off and free unless set: the environment is read once, at import; with
nothing armed, :func:`hit` returns at its first test of a module global. An
unknown point or action is an error at import, so a typo cannot quietly test
nothing.

Every point is listed in :data:`POINTS` with where it sits and what a test
proves with it; ``tests/unit/wire/test_failpoints.py`` fails for a listed
point that no test arms or no code hits, and for a hit of an unlisted name.
This module lives in ``wire`` because every component imports wire.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

ENV: Final = "UNDERSTUDY_FAILPOINTS"

# name -> where it sits, and what arming it shows.
POINTS: Final[Mapping[str, str]] = {
    "engine.init": "engine main loop, before the weights are loaded or imported: "
    "an init error ends the engine at once, and a respawned engine that cannot "
    "start is backed off",
    "engine.wake": "engine main loop, before the weights are remapped: a wake that "
    "hangs ends at the wake timeout",
}

_ACTION = re.compile(r"^(raise|hang|sleep\((\d+(?:\.\d+)?)\)|exit\((\d+)\))$")


class FailpointError(RuntimeError):
    """Raised by a point armed with ``raise``."""


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # raise, hang, sleep, exit
    arg: float = 0.0


def parse(spec: str) -> dict[str, Action]:
    """``name=action;name=action`` -> the armed points. ValueError on anything else."""
    armed: dict[str, Action] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, sep, action = (x.strip() for x in item.partition("="))
        if not sep or name not in POINTS:
            known = ", ".join(sorted(POINTS))
            raise ValueError(f"{ENV}: {item!r} names no failpoint (known: {known})")
        match = _ACTION.match(action)
        if match is None:
            raise ValueError(
                f"{ENV}: {name}: {action!r} is not raise, hang, sleep(SECONDS) or exit(CODE)"
            )
        kind = action.split("(")[0]
        arg = float(match.group(2) or match.group(3) or 0.0)
        armed[name] = Action(kind, arg)
    return armed


_armed: dict[str, Action] = parse(os.environ.get(ENV, ""))


def hit(name: str) -> None:
    """The failpoint ``name``: nothing unless armed (see the module)."""
    if not _armed:
        return
    action = _armed.get(name)
    if action is None:
        return
    if action.kind == "raise":
        raise FailpointError(f"failpoint {name} (raise)")
    if action.kind == "sleep":
        time.sleep(action.arg)
    elif action.kind == "hang":
        threading.Event().wait()
    else:  # exit
        os._exit(int(action.arg))


def armed() -> Mapping[str, Action]:
    """What this process armed (for its start-up log line)."""
    return dict(_armed)
