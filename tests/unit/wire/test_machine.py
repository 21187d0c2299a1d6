"""The shared step helper and diagram renderer, on a toy machine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import pytest

from understudy.wire.machine import Entry, InvalidTransition, mermaid, run_step


class Light(enum.Enum):
    OFF = "off"
    ON = "on"
    BROKEN = "broken"


@dataclass(frozen=True, slots=True)
class Lamp:
    phase: Light = Light.OFF
    flips: int = 0
    since: float = 0.0


@dataclass(frozen=True, slots=True)
class Flip:
    pass


@dataclass(frozen=True, slots=True)
class Smash:
    pass


def _flip(s: Lamp, e: Flip, now: float) -> tuple[Lamp, list[str]]:
    to = Light.ON if s.phase is Light.OFF else Light.OFF
    return replace(s, phase=to, flips=s.flips + 1, since=now), [f"flip@{now:g}"]


def _smash(s: Lamp, e: Smash, now: float) -> tuple[Lamp, list[str]]:
    return replace(s, phase=Light.BROKEN), []


def _lying(s: Lamp, e: Smash, now: float) -> tuple[Lamp, list[str]]:
    return replace(s, phase=Light.ON), ["lie"]  # not among its entry's targets


TABLE = {
    (Light.OFF, Flip): Entry(_flip, frozenset({Light.ON})),
    (Light.ON, Flip): Entry(_flip, frozenset({Light.OFF})),
    (Light.ON, Smash): Entry(_smash, frozenset({Light.BROKEN})),
    (Light.OFF, Smash): Entry(_lying, frozenset({Light.BROKEN, Light.OFF})),
}


class LampError(InvalidTransition):
    pass


def phase_of(s: Lamp, e: object) -> Light:
    return s.phase


def test_a_legal_pair_runs_its_handler() -> None:
    new, actions = run_step(TABLE, phase_of, Lamp(), Flip(), 2.5)
    assert new == Lamp(Light.ON, flips=1, since=2.5) and actions == ["flip@2.5"]


def test_a_miss_raises_the_given_error_naming_the_key() -> None:
    with pytest.raises(LampError, match="Flip is not accepted in phase broken") as info:
        run_step(TABLE, phase_of, Lamp(Light.BROKEN), Flip(), 1.0, error=LampError)
    assert (info.value.phase, info.value.kind) == (Light.BROKEN, Flip)


def test_a_handler_leaving_its_targets_raises_instead_of_returning() -> None:
    with pytest.raises(InvalidTransition, match="Smash in phase off led to on, not to off, broken"):
        run_step(TABLE, phase_of, Lamp(), Smash(), 1.0)


def test_a_key_function_replaces_the_event_class() -> None:
    table = {(Light.OFF, "flip"): Entry(_flip, frozenset({Light.ON}))}
    new, _ = run_step(table, phase_of, Lamp(), "flip", 0.0, kind_of=str)
    assert new.phase is Light.ON
    with pytest.raises(InvalidTransition):
        run_step(table, phase_of, Lamp(), "smash", 0.0, kind_of=str)


def test_mermaid_lists_every_target_in_declaration_order() -> None:
    assert mermaid(TABLE, initial=Light.OFF, final=[Light.BROKEN]) == (
        "stateDiagram-v2\n"
        "    [*] --> OFF\n"
        "    OFF --> ON : Flip\n"
        "    ON --> OFF : Flip\n"
        "    ON --> BROKEN : Smash\n"
        "    OFF --> OFF : Smash\n"
        "    OFF --> BROKEN : Smash\n"
        "    BROKEN --> [*]\n"
    )
