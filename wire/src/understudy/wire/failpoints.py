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
  as a crash);
- ``kill``: SIGKILL the process itself (what a kill -9 from outside does, at
  exactly this point);
- ``return``: :func:`hit` returns True, and the code at the point does the
  harm that point is named for (gofail's ``return``: a block corrupted on
  purpose, say); unarmed, or armed otherwise, it returns False;
- ``return(TEXT)``: the same, with a value for the code at the point, which
  reads it with :func:`value` (``engine.poison=return(POISON)``: the request
  whose prompt holds POISON is the one that kills its engine).

Any action may end in ``@N``: the point lets its first N-1 hits pass and acts
from the N-th on (``kv.seal.torn=kill@40``: die in the 40th seal-log write,
in the middle of a stream rather than at its first write).

Off and free unless set: the environment is read once, at import; with
nothing armed, :func:`hit` returns at its first test of a module global. An
unknown point or action is an error at import, so a typo cannot quietly test
nothing.

Every point is listed in :data:`POINTS` with where it sits and what a test
proves with it; ``tests/unit/wire/test_failpoints.py`` fails for a listed point that no
test arms or no code hits, and for a hit of an unlisted name. This module
lives in ``wire`` (it imports nothing of ours) because its points are on
more than one component's path: an engine's (its main loop, its KV pool,
its adapters) and the front's.
"""

from __future__ import annotations

import os
import re
import signal
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
    "gms.remap.mapped": "a GMS client's remap (an engine's wake), its layout mapped and the "
    "session not yet counted as mapped: a server that dies there is still reported to "
    "on_lost once the remap ends, so the engine never serves from a session nobody "
    "watches, and a waking engine gives the weights back to the next GMS (sleep)",
    "gms.readopt": "Active engine, before it gives its weights back to a restarted GMS: "
    "a re-adoption that fails ends the engine, and the pod falls back to a reload",
    "kv.seal.torn": "the KV pool's seal log, between the two halves of a record: a death "
    "there leaves a torn record, and the next engine reads the log up to it and adopts "
    "what it says (kill)",
    "kv.block.corrupt": "the KV pool, as the next engine adopts it: a sealed block's bytes "
    "are changed under its seal (memory corrupted between two holders), and the engine "
    "finds the checksum wrong and recomputes the block instead of serving it (return)",
    "front.accept.copy": "the front, at a connection's accept, before its copy goes to "
    "the lock server: the connection is in the front's descriptor table alone (shared "
    "with its witness), and a front killed there leaves it to the witness, which gives "
    "it to the lock server for the next front (kill)",
    "front.accept.record": "the front, at a connection's accept, after its copy went to "
    "the lock server and before its record exists: a front killed there leaves the "
    "connection held with no record, and the next front answers it from its first byte "
    "(kill)",
    "conns.hold.queued": "the front's copies of its connections, as one is sent to the "
    "lock server: it waits in the front's queue, as behind a keeper that stopped reading, "
    "and every message after it too; a front killed then leaves the connection to its "
    "witness, under another id, and the next front finds its record by its socket "
    "(return)",
    "front.accept.header": "the front, as a connection's record is created (at its "
    "accept), between the file and its header: a front killed there leaves an empty "
    "record, which the next front takes as one of a connection nothing was read from, "
    "and answers it from its first byte (kill)",
    "front.record.compact": "the front, as it cuts an idle connection's record back to "
    "its header, between the cut and the new header: a front killed there leaves the old "
    "bases and no records, and the next front takes the socket's own counts as the bases "
    "and reads the client's next request (kill)",
    "engine.poison": "the OpenAI surface, as an engine starts a request: armed "
    "return(MARKER), the engine SIGKILLs itself on every request whose prompt holds "
    "MARKER, as a request that crashes whichever engine serves it would (a poison "
    "request), and serves every other request as usual",
}

_ACTION = re.compile(
    r"^(raise|hang|kill|return(?:\(([^()]+)\))?|sleep\((\d+(?:\.\d+)?)\)|exit\((\d+)\))"
    r"(?:@(\d+))?$"
)


class FailpointError(RuntimeError):
    """Raised by a point armed with ``raise``."""


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # raise, hang, sleep, exit, kill, return
    arg: float = 0.0
    nth: int = 1  # acts from this hit on
    text: str = ""  # return(TEXT): what value() gives the code at the point


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
                f"{ENV}: {name}: {action!r} is not raise, hang, kill, return, "
                "return(TEXT), sleep(SECONDS) or exit(CODE), with an optional @N"
            )
        kind = action.split("(")[0].split("@")[0]
        arg = float(match.group(3) or match.group(4) or 0.0)
        nth = int(match.group(5) or 1)
        if nth < 1:
            raise ValueError(f"{ENV}: {name}: @{nth}: hits count from 1")
        armed[name] = Action(kind, arg, nth, match.group(2) or "")
    return armed


_armed: dict[str, Action] = parse(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}
_count = threading.Lock()


def _acting(name: str) -> Action | None:
    """The action of ``name`` if this hit acts (armed, and past its ``@N``)."""
    action = _armed.get(name)
    if action is None:
        return None
    if action.nth > 1:
        with _count:
            _hits[name] = seen = _hits.get(name, 0) + 1
        if seen < action.nth:
            return None
    return action


def crash() -> None:
    """SIGKILL this process here (the ``kill`` action; also for a point's code
    that decides, from its ``value``, that this is where it dies)."""
    os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()  # the signal is on its way


def value(name: str) -> str | None:
    """The point ``name`` where its code wants a value: the TEXT of a point
    armed ``return(TEXT)`` ("" for a plain ``return``) when this hit acts,
    else None; any other action is taken here, as :func:`hit` takes it."""
    if not _armed:
        return None
    action = _acting(name)
    if action is None:
        return None
    if action.kind == "return":
        return action.text
    if action.kind == "raise":
        raise FailpointError(f"failpoint {name} (raise)")
    if action.kind == "sleep":
        time.sleep(action.arg)
    elif action.kind == "hang":
        threading.Event().wait()
    elif action.kind == "kill":
        crash()
    else:  # exit
        os._exit(int(action.arg))
    return None


def hit(name: str) -> bool:
    """The failpoint ``name``: nothing unless armed (see the module). True only
    for a point armed with ``return`` (the caller then does the harm)."""
    if not _armed:
        return False
    return value(name) is not None


def armed() -> Mapping[str, Action]:
    """What this process armed (for its start-up log line)."""
    return dict(_armed)
