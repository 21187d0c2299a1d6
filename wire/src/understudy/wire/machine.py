"""One shape for every state machine: a transition table and the step that reads it.

Each pure core (the lock server, GMS, the engine shim, the operator's replica
lifecycle) exposes ``step(state, event, now) -> (state, actions)`` and a
``TRANSITIONS`` table: ``(phase, event kind) -> Entry(handler, targets)``. The
handler computes the new state and the actions; ``targets`` are the phases it
may lead to. :func:`run_step` is the only reader of a table. A pair that is not
in it raises :class:`InvalidTransition`, and so does a handler that lands
outside its declared targets; either way nothing is returned, so the caller
keeps the state it had. :func:`mermaid` draws a table, which is how the
diagrams in ``docs/`` stay in step with the code.

Pure: no I/O, no clock, no logging; time comes in as ``now``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

StateT = TypeVar("StateT")
EventT = TypeVar("EventT")
ActionT = TypeVar("ActionT")
PhaseT = TypeVar("PhaseT", bound=Hashable)


class InvalidTransition(Exception):
    """An event the current phase does not accept, or a handler that broke the table.

    Always a bug in the caller or the core, never the peer's fault. Components
    subclass it (GMS's is also a ``LocalGmsError``); ``phase`` and ``kind`` name
    the table key that failed, when there is one.
    """

    def __init__(self, message: str, phase: object = None, kind: object = None) -> None:
        super().__init__(message)
        self.phase = phase
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Entry(Generic[StateT, ActionT, PhaseT]):
    """One row of a transition table.

    ``handler(state, event, now) -> (state, actions)``. Its event parameter is
    typed ``Any`` because a handler may take the one event class its key names
    (the table lookup is what guarantees that class), which a ``Callable`` over
    the whole event union would not admit.
    """

    handler: Callable[[StateT, Any, float], tuple[StateT, list[ActionT]]]
    targets: frozenset[PhaseT]


def run_step(
    table: Mapping[tuple[PhaseT, Any], Entry[StateT, ActionT, PhaseT]],
    phase_of: Callable[[StateT, EventT], PhaseT],
    state: StateT,
    event: EventT,
    now: float,
    *,
    kind_of: Callable[[EventT], Hashable] = type,
    error: type[InvalidTransition] = InvalidTransition,
) -> tuple[StateT, list[ActionT]]:
    """Look up ``(phase_of(state, event), kind_of(event))`` and apply its entry.

    ``phase_of`` takes the event too because a machine may judge an event by
    part of its state (GMS judges it by the phase of the event's session).
    ``kind_of`` defaults to the event's class. Raises ``error`` (a subclass of
    :class:`InvalidTransition`) on a miss, or if the handler's result is not in
    a phase the entry declares.
    """
    phase = phase_of(state, event)
    kind = kind_of(event)
    entry = table.get((phase, kind))
    if entry is None:
        raise error(f"{name(kind)} is not accepted in phase {name(phase)}", phase, kind)
    new, actions = entry.handler(state, event, now)
    after = phase_of(new, event)
    if after not in entry.targets:  # the table is the contract; the handler broke it
        allowed = ", ".join(name(p) for p in _ordered(entry.targets))
        raise error(
            f"{name(kind)} in phase {name(phase)} led to {name(after)}, not to {allowed}",
            phase,
            kind,
        )
    return new, actions


def name(x: object) -> str:
    """How a phase or an event kind is called in messages and diagrams."""
    if isinstance(x, type):
        return x.__name__
    if isinstance(x, enum.Enum):
        return str(x.value) if isinstance(x.value, str) else x.name
    return str(x)


def _ordered(phases: Iterable[Any]) -> list[Any]:
    """Declaration order for enum members (a frozenset's order varies between runs)."""

    def key(p: Any) -> tuple[int, str]:
        if isinstance(p, enum.Enum):
            return list(type(p)).index(p), ""
        return 0, name(p)

    return sorted(phases, key=key)


def _node(p: object) -> str:
    return p.name if isinstance(p, enum.Enum) else name(p)


def mermaid(
    table: Mapping[tuple[PhaseT, Any], Entry[Any, Any, PhaseT]],
    *,
    initial: PhaseT | None = None,
    final: Iterable[PhaseT] = (),
) -> str:
    """A ``stateDiagram-v2`` of ``table``: ``phase --> target : Event`` for every target.

    Edges come in table order, targets in declaration order, so the text only
    changes when the table does. ``initial`` and ``final`` add ``[*]`` edges.
    """
    lines = ["stateDiagram-v2"]
    if initial is not None:
        lines.append(f"    [*] --> {_node(initial)}")
    for (phase, kind), entry in table.items():
        for target in _ordered(entry.targets):
            lines.append(f"    {_node(phase)} --> {_node(target)} : {name(kind)}")
    for p in _ordered(final):
        lines.append(f"    {_node(p)} --> [*]")
    return "\n".join(lines) + "\n"
