"""The GMS server's core: two protocols over one state, each with its own table.

* ``weights``: the allocation lock over the weights' layout (RW, RO,
  RW_OR_RO, ADOPT; commit, abort, the layout hash; re-adoption after a
  restart).
* ``kv``: the KV pool, handed from one holder of the pod's lock to the next.
* ``sessions``: what both share: the state (sessions, allocations, the pool),
  the events a shell feeds and the actions it carries out.

Everything that changes GMS state lives in this package (as h11's
``_state.py``); the asyncio server only feeds events to :class:`Machine` and
carries out the returned actions. :func:`step` sends an event to the
protocol whose table has its (session phase, kind) pair: the tables share no
pair, so which protocol an event belongs to is the tables' to say, not the
shell's. An event neither takes is the lock's, whose step refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from understudy.gms.fsm import kv, weights
from understudy.gms.fsm.sessions import (
    Action,
    AdoptionOver,
    AdoptMemory,
    ArmAdoptionTimer,
    ArmTimer,
    Connected,
    CreateFailed,
    CreateMemory,
    Disconnected,
    Event,
    Expire,
    GmsState,
    GrantKv,
    InvalidTransition,
    KvPool,
    LockChecked,
    LockWord,
    Orphan,
    Phase,
    ReadLock,
    Received,
    Refused,
    ReleaseMemory,
    Reply,
    Result,
    SendExport,
    ServerInfo,
    Session,
    Transition,
    allocation_info,
    initial_state,
    kind_of,
    kv_report,
    lock_state,
    report,
    takes,
)
from understudy.gms.fsm.weights import GRANT_RULES, Decision, decide

__all__ = [
    "GRANT_RULES",
    "Action",
    "AdoptMemory",
    "AdoptionOver",
    "ArmAdoptionTimer",
    "ArmTimer",
    "Connected",
    "CreateFailed",
    "CreateMemory",
    "Decision",
    "Disconnected",
    "Event",
    "Expire",
    "GmsState",
    "GrantKv",
    "InvalidTransition",
    "KvPool",
    "LockChecked",
    "LockWord",
    "Machine",
    "Orphan",
    "Phase",
    "ReadLock",
    "Received",
    "Refused",
    "ReleaseMemory",
    "Reply",
    "Result",
    "SendExport",
    "ServerInfo",
    "Session",
    "Transition",
    "allocation_info",
    "decide",
    "initial_state",
    "kind_of",
    "kv",
    "kv_report",
    "lock_state",
    "report",
    "step",
    "weights",
]


def step(state: GmsState, event: Event, now: float) -> Result:
    """Apply one event, by the table of the protocol it belongs to.

    Raises ``Refused`` (a request the session's phase does not take: the
    peer's fault) or ``InvalidTransition`` (the shell's); the state is then
    unchanged.
    """
    core_step = kv.step if takes(kv.TRANSITIONS, state, event) else weights.step
    return core_step(state, event, now)


@dataclass(slots=True)
class Machine:
    """A mutable holder for shells: ``feed`` steps and keeps the new state."""

    state: GmsState

    def feed(self, event: Event, now: float) -> list[Action]:
        self.state, actions = step(self.state, event, now)
        return actions
