"""What a drill's rounds say beyond each round: failovers it did not cause."""

from __future__ import annotations

from understudy.tools.drill_result import Report, Round, render, unplanned_failovers


def _round(i: int, epoch: int, new: int, **kw: object) -> Round:
    r = Round(i, "engine", 100 + i, epoch, new_active="next", new_epoch=new)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_each_round_starting_where_the_last_took_over_is_planned() -> None:
    rounds = [_round(1, 5, 6), _round(2, 6, 7), _round(3, 7, 8)]
    assert unplanned_failovers(rounds) == 0
    assert "did not cause" not in render(Report(rounds=rounds))


def test_a_lock_that_moved_between_rounds_is_counted_and_shown() -> None:
    rounds = [_round(1, 5, 6), _round(2, 7, 8), _round(3, 8, 9)]
    assert unplanned_failovers(rounds) == 1
    assert Report(rounds=rounds).summary()["unplanned_failovers"] == 1
    assert "failovers the drill did not cause: 1" in render(Report(rounds=rounds))


def test_a_scenario_that_killed_more_or_a_failed_round_proves_nothing() -> None:
    assert (
        unplanned_failovers([_round(1, 5, 6, also_killed="engine-shadow-1"), _round(2, 8, 9)]) == 0
    )
    assert unplanned_failovers([_round(1, 5, 0, error="no new Active"), _round(2, 8, 9)]) == 0


def test_a_fleet_drill_compares_a_pod_only_with_itself() -> None:
    a1 = _round(1, 1, 2, whole_pod=True, killed="pod-0", new_active="pod-0")
    b1 = _round(2, 1, 2, whole_pod=True, killed="pod-1", new_active="pod-1")
    a2 = _round(3, 2, 3, whole_pod=True, killed="pod-0", new_active="pod-0")
    assert unplanned_failovers([a1, b1, a2]) == 0  # another pod, then pod-0 as it came back
    a3 = _round(4, 4, 5, whole_pod=True, killed="pod-0", new_active="pod-0")
    assert unplanned_failovers([a2, a3]) == 1  # pod-0 died again between the rounds
