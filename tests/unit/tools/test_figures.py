"""The drill's figures, on records made up here: every number below is worked
out by hand from the records, not from the code under test."""

from __future__ import annotations

from typing import Any

import pytest

from understudy.tools import figures
from understudy.tools.series import Sample


def ok(start: float, end: float) -> Sample:
    return Sample(start, end, True, "d")


def bad(start: float, end: float) -> Sample:
    return Sample(start, end, False, error="HTTP 503")


def engine(name: str, state: str, epoch: int = 0, **kw: Any) -> dict[str, Any]:
    return {"name": name, "state": state, "epoch": epoch, "engine_id": f"{name}-1", **kw}


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    assert figures.percentile(values, 50) == 50.0
    assert figures.percentile(values, 99) == 99.0
    assert figures.percentile(values, 100) == 100.0
    assert figures.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert figures.percentile([7.0], 99) == 7.0


def test_stats() -> None:
    assert figures.stats([]) is None
    assert figures.stats([0.2, 0.1, 0.4, 0.3]) == {
        "n": 4,
        "p50": 0.2,
        "p95": 0.4,
        "p99": 0.4,
        "max": 0.4,
        "min": 0.1,
    }


CLEAN = {
    "kills": 3,
    "failovers_ok": 3,
    "failed_requests": 0,
    "wrong_answers": 0,
    "split_brain": 0,
    "epoch_regressions": 0,
    "serving_violations": 0,
}


@pytest.mark.parametrize(
    "change",
    [
        {"failovers_ok": 2},
        {"failed_requests": 1},
        {"wrong_answers": 1},
        {"split_brain": 1},
        {"epoch_regressions": 1},
        {"serving_violations": 1},
    ],
)
def test_verdict_fails_on_any_loss(change: dict[str, int]) -> None:
    assert figures.verdict(CLEAN)
    assert not figures.verdict({**CLEAN, **change})


def test_armed_needs_one_active_a_standby_and_every_engine_started() -> None:
    a, b, c = engine("a", "Active", 3), engine("b", "Standby"), engine("c", "Init")
    assert figures.armed([a, b]) == (a, [b])
    assert figures.armed([a, b, c]) == (a, [b])  # a third engine still loading is fine
    assert figures.armed([a]) is None  # no shadow
    assert figures.armed([a, engine("b", "Active", 4)]) is None
    assert figures.armed([a, {**b, "started": False}]) is None
    assert figures.armed([]) is None


def test_settled_needs_every_other_engine_a_started_standby() -> None:
    a, b = engine("a", "Active", 3), engine("b", "Standby")
    assert figures.settled([a, b]) is a
    assert figures.settled([a, b, engine("c", "Init")]) is None
    assert figures.settled([a, {**b, "started": False}]) is None
    assert figures.settled([b]) is None


def test_successor_is_active_under_a_newer_epoch() -> None:
    old, new = engine("a", "Active", 3), engine("b", "Active", 4)
    assert figures.successor([old], 3) is None
    assert figures.successor([old, new], 3) is new
    assert figures.successor([engine("b", "Waking", 4)], 3) is None


def test_rearm_is_when_the_killed_containers_next_engine_was_first_seen_in_standby() -> None:
    seen = {
        "a-1": ("a", 1.0),  # the killed engine itself, before the kill
        "b-1": ("b", 12.0),  # another container
        "a-2": ("a", 13.5),  # the killed container's next engine
        "a-3": ("a", 20.0),  # and the one after (a later round)
    }
    assert figures.rearm_s(seen, "a", "a-1", t_kill=12.0) == 1.5
    assert figures.rearm_s(seen, "a", "a-2", t_kill=19.0) == 1.0
    assert figures.rearm_s(seen, "a", "a-3", t_kill=21.0) is None


def test_rearmed_is_a_new_process_of_the_killed_container() -> None:
    same = engine("a", "Standby")  # engine_id a-1: the killed process itself
    assert not figures.rearmed([same], "a", "a-1")
    assert figures.rearmed([{**same, "engine_id": "a-2"}], "a", "a-1")
    assert not figures.rearmed([engine("a", "Init", engine_id="a-2")], "a", "a-1")
    assert not figures.rearmed([engine("b", "Standby", engine_id="b-2")], "a", "a-1")


def test_wake_from_the_new_engines_stamps() -> None:
    w = figures.wake({"waking_at": 100.25, "active_at": 100.5}, 100.0)
    assert w == figures.Wake(0.25, 0.25, 0.5)
    assert figures.wake({"waking_at": 100.25}, 100.0) is None
    assert figures.wake({}, 100.0) is None


# Requests around a kill at t=10: completions at 9.9, 10.02, then a hole until
# 10.3 (a request held through the failover), then 10.35; one failure at 10.1.
AROUND = [
    ok(9.0, 9.9),
    ok(9.5, 10.02),
    bad(9.8, 10.1),
    ok(9.95, 10.3),  # started before the kill, held, then served
    ok(10.2, 10.35),  # the first request started after the kill
    ok(10.31, 10.4),
]


def test_first_served_is_the_first_request_started_after_the_kill() -> None:
    assert figures.first_served(AROUND, 10.0) == AROUND[4]
    assert figures.first_served(AROUND, 11.0) is None
    assert figures.first_served([bad(10.5, 10.6)], 10.0) is None


def test_client_gap_is_the_longest_hole_in_completions_after_the_kill() -> None:
    served = AROUND[4]
    # marks: 10.0 (kill), 10.02, 10.3, 10.35 -> holes .02, .28, .05
    assert figures.client_gap(AROUND, 10.0, served) == pytest.approx(0.28)
    # nothing completed between the kill and the first new request: the whole stretch
    assert figures.client_gap([ok(10.2, 10.7)], 10.0, ok(10.2, 10.7)) == pytest.approx(0.7)


def test_steady_gap_is_the_longest_wait_between_answers_in_the_window() -> None:
    answers = [ok(0.0, 1.0), ok(0.5, 2.5), bad(1.0, 3.0), ok(2.0, 3.2), ok(4.0, 9.0)]
    assert figures.steady_gap(answers, 0.0, 4.0) == pytest.approx(1.5)  # 1.0 -> 2.5
    assert figures.steady_gap(answers, 0.0, 10.0) == pytest.approx(5.8)  # 3.2 -> 9.0
    assert figures.steady_gap(answers, 2.0, 3.0) is None  # fewer than two answers


def test_failed_between_counts_failures_that_ended_in_the_window() -> None:
    assert figures.failed_between(AROUND, 10.0, 10.35) == 1
    assert figures.failed_between(AROUND, 10.11, 10.35) == 0
    assert figures.failed_between([*AROUND, bad(10.5, 10.6)], 10.0, 11.0) == 2


def test_longest_gap_counts_failures_at_the_end() -> None:
    assert figures.longest_gap([], 10.0) is None
    # kill at 10, answers at 10.1 and 10.2, then only failures until 12
    samples = [ok(9.9, 10.1), ok(10.0, 10.2), bad(10.2, 12.0)]
    assert figures.longest_gap(samples, 10.0) == pytest.approx(1.8)


def test_unarmed_spans_from_the_standby_timeline() -> None:
    # one Standby from the start, none between 12 and 15.5 and again from 20 on
    timeline = [(5.0, 1), (12.0, 0), (13.0, 0), (15.5, 1), (20.0, 0)]
    assert figures.unarmed_spans(timeline, 10.0, 21.0) == [(12.0, 15.5), (20.0, 21.0)]
    # a stretch that began before the drill counts from its start
    assert figures.unarmed_spans([(1.0, 0), (11.0, 2)], 10.0, 30.0) == [(10.0, 11.0)]
    assert figures.unarmed_spans([(1.0, 1)], 10.0, 30.0) == []
    assert figures.unarmed_spans([], 10.0, 30.0) == []


def test_unarmed_figures() -> None:
    got = figures.unarmed_figures([(12.0, 15.5), (20.0, 21.0)], 20.0)
    assert got == {
        "unarmed_s": 4.5,
        "unarmed_spans": 2,
        "unarmed_longest_s": 3.5,
        "unarmed_fraction": pytest.approx(0.225),
    }
    assert figures.unarmed_figures([], 0.0)["unarmed_fraction"] == 0.0


def test_engine_changes_count_restarts_reloads_and_readoptions() -> None:
    before = [
        {"name": "a", "engine_id": "a-1", "readoptions": 0, "weights": {"loaded": [0]}},
        {"name": "b", "engine_id": "b-1", "readoptions": 0, "weights": {"imported": [0]}},
    ]
    same = [{**before[0], "readoptions": 1}, before[1]]
    assert figures.engine_changes(before, same) == figures.EngineChanges(0, 0, 1)
    reloaded = [
        {"name": "a", "engine_id": "a-2", "weights": {"loaded": [0], "imported": []}},
        {"name": "b", "engine_id": "b-2", "weights": {"loaded": [], "imported": [0]}},
    ]
    assert figures.engine_changes(before, reloaded) == figures.EngineChanges(2, 1, 0)


def test_gaps_between_kills_stop_at_the_next_kill() -> None:
    done = [Sample(t, t + 0.01, True, "x") for t in (0.0, 0.1, 0.2, 1.5, 1.6, 5.0, 5.1)]
    # kill at 0.25: next answer at 1.51 (gap 1.26); kill at 4.0: next at 5.01
    gaps = figures.gaps_between_kills(done, [0.25, 4.0])
    assert [round(g, 2) for g in gaps if g is not None] == [1.26, 1.01]


def test_whole_waits_for_the_weights_to_be_given_back() -> None:
    active = {"name": "a", "state": "Active", "readopting": True}
    standby = {"name": "b", "state": "Standby"}
    assert figures.settled([active, standby]) is active
    assert figures.whole([active, standby]) is None
    assert figures.whole([{**active, "readopting": False}, standby]) is not None


def _active(epoch: int, granted_at: float, asked_at: float | None) -> dict[str, object]:
    e: dict[str, object] = {"state": "Active", "epoch": epoch, "granted_at": granted_at}
    if asked_at is not None:
        e["asked_at"] = asked_at
    return e


def test_split_brain_is_an_old_engine_active_after_the_new_grant() -> None:
    standby = {"state": "Standby", "epoch": 0}
    # One Active: nothing to judge.
    assert figures.split_brain([_active(5, 100.0, 101.0), standby]) == []
    # The old engine was asked before its successor's grant: its answer may
    # predate its death (a snapshot asks one engine after another).
    old, new = _active(5, 90.0, 99.9), _active(6, 100.0, 100.2)
    assert figures.split_brain([new, old, standby]) == []
    # Asked at or after the new grant and still Active: two at once.
    late = _active(5, 90.0, 100.0)
    assert figures.split_brain([new, late]) == [late, new]
    # Without the times, any two Active engines count.
    assert figures.split_brain([new, _active(5, 90.0, None)]) != []
