"""Draw docs/state-machines.md from the transition tables the code runs.

    python docs/make_state_diagrams.py           # rewrite docs/state-machines.md
    python docs/make_state_diagrams.py --check   # exit 1 if the file is stale

The diagrams come from each core's ``TRANSITIONS`` (through
``understudy.wire.machine.mermaid``), so they cannot drift from the code;
tests/unit/test_state_diagrams.py fails when the committed file is stale.
This script lives here, not in a component, because it reads all the
components and none of them may depend on all the others.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

from understudy.engine_shim import fsm as engine
from understudy.front import fsm as front
from understudy.front import pods
from understudy.gms import fsm as gms
from understudy.lockserver import fsm as lock
from understudy.operator import lifecycle
from understudy.respawner import restart
from understudy.wire.machine import mermaid

OUT = Path(__file__).with_name("state-machines.md")
COMMAND = "python docs/make_state_diagrams.py"


class Section(NamedTuple):
    title: str
    module: str
    about: str
    diagram: str


def sections() -> list[Section]:
    return [
        Section(
            "Lock server",
            "lockserver/src/understudy/lockserver/fsm.py",
            "The pod's lock. The connection is the lock: a holder's disconnect frees it. "
            "After a restart with a persisted holder, a reconnect window keeps the lock "
            "for that holder.",
            mermaid(lock.TRANSITIONS, initial=lock.Phase.INIT),
        ),
        Section(
            "GMS weights session",
            "gms/src/understudy/gms/fsm/weights.py",
            "One connection to a GPU Memory Service, under the allocation lock over the "
            "weights' layout. NONE means no such session (not connected yet, or gone). For "
            "a request the event is the request's message class; a request the phase does "
            "not take is refused.",
            mermaid(gms.weights.TRANSITIONS, initial=gms.Phase.NONE),
        ),
        Section(
            "GMS KV pool session",
            "gms/src/understudy/gms/fsm/kv.py",
            "A connection that asked for the device's KV pool, from PENDING: the lock's "
            "record is read, then the pool is mapped, or waited for until an older "
            "holder's connection ends. A refusal or an expired wait leaves it PENDING. "
            "Any connection may map the pool read-only as it is (KvPeek: a standby's view, "
            "KV_READING), without the lock.",
            mermaid(gms.kv.TRANSITIONS, initial=gms.Phase.PENDING),
        ),
        Section(
            "Engine",
            "engine_shim/src/understudy/engine_shim/fsm.py",
            "One engine process. There is no way back: a dead engine is restarted as a "
            "new process, which starts in INIT again.",
            mermaid(engine.TRANSITIONS, initial=engine.State.INIT, final=[engine.State.DEAD]),
        ),
        Section(
            "Respawner",
            "respawner/src/understudy/respawner/restart.py",
            "A container's init (`understudy respawn`): a child that said it started and "
            "died is started again at once; one that died before that is backed off, and "
            "after a few failures in a row the respawner exits, which hands the container "
            "to kubelet.",
            mermaid(
                restart.TRANSITIONS, initial=restart.Phase.STARTING, final=[restart.Phase.DONE]
            ),
        ),
        Section(
            "Front door routing",
            "front/src/understudy/front/fsm.py",
            "Where the pod's front door sends requests: the engine that holds the lock, "
            "under the newest epoch seen. While WAITING, requests are held. An event is "
            "judged against the state first (`kind`); an edge names the event and, in "
            "brackets, what it meant.",
            mermaid(front.TRANSITIONS, initial=front.Phase.WAITING),
        ),
        Section(
            "Front door poison isolation",
            "front/src/understudy/front/fsm.py",
            "Which requests may go to an engine (docs/poison.md): all while OPEN; after a "
            "request's second death beside others it runs alone (CLEARING until nothing else "
            "is out, then ALONE); a death while it runs alone names it the poison. An edge "
            "names the event and, in brackets, what it meant (`blame`).",
            mermaid(front.ISOLATION, initial=front.Isolation.OPEN),
        ),
        Section(
            "Gateway pod",
            "front/src/understudy/front/pods.py",
            "One pod as the fleet gateway sees it (docs/gateway.md): READY pods take "
            "requests; a DEAD pod's requests move to others, token-exact, and only an "
            "answer to a probe sent after its death revives it, under a new generation; a "
            "pod listed as terminating is LEAVING (nothing new, its requests finish there "
            "until its grace ends) and, dead then, stays dead while it is listed so. An "
            "event is judged against the pod first (`kind`); an edge names the event and, "
            "in brackets, what it meant.",
            mermaid(pods.TRANSITIONS, initial=pods.Phase.NEW),
        ),
        Section(
            "GpuInstance replica",
            "operator/src/understudy/operator/lifecycle.py",
            "One replica of a GpuInstance, as the operator sees it. The planner's checks "
            "report what they saw of the replica's pod (Bound, Unbound, PodLost, ...) and "
            "the table's handlers decide: a failure holds the phase until its retry limit, "
            "waiting holds it until the phase's budget runs out. Reset, Drain and Delete "
            "are the planner's own decisions. A report about another attempt's pod is "
            "dropped before the table.",
            mermaid(
                lifecycle.TRANSITIONS,
                initial=lifecycle.P.PENDING,
                final=lifecycle.TERMINAL,
            ),
        ),
    ]


def render() -> str:
    out = [
        "# State machines",
        "",
        f"<!-- Generated by `{COMMAND}` from the TRANSITIONS tables; do not edit. -->",
        "",
        "Every core has `step(state, event, now) -> (state, actions)` and one table,",
        "`(phase, event) -> Entry(handler, targets)`, read by",
        "`understudy.wire.machine.run_step`. An edge `A --> B : Event` means the",
        "handler for `Event` in `A` may lead to `B`; a pair with no edge raises",
        "`InvalidTransition` and changes nothing.",
    ]
    for s in sections():
        out += ["", f"## {s.title}", "", f"`{s.module}`. {s.about}", "", "```mermaid"]
        out.append(s.diagram.rstrip("\n"))
        out.append("```")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is stale; run: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
