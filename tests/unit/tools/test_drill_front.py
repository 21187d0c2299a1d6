"""The front drill's verdict, from recorded requests (pure)."""

from __future__ import annotations

from understudy.tools.drill_front import _judge
from understudy.tools.series import Sample


def _round(t: float, in_flight: float, back: bool = True, idle: float = 0) -> dict[str, object]:
    return {
        "t_kill": t, "killed": [1], "back": back, "in_flight": in_flight, "idle": idle,
        "front_start_s": 0.05,
    }  # fmt: skip


def ok(start: float, end: float) -> Sample:
    return Sample(start, end, True, "d", kind="k")


def failed(end: float, error: str = "RemoteDisconnected") -> Sample:
    return Sample(end - 0.5, end, False, error=error, kind="k")


def test_failures_within_the_reported_losses_pass_and_each_is_its_kills():
    samples = [ok(0, 1), failed(10.001), failed(10.002), ok(9.9, 10.2), ok(10.01, 10.3),
               failed(20.001), ok(20.05, 20.4)]  # fmt: skip
    r = _judge([_round(10, 2), _round(20, 3)], samples, 0)
    assert r["passed"]
    assert [(x["failed"], x["refused"]) for x in r["rounds"]] == [(2, 0), (1, 0)]
    # The gap: the first answer to a request sent after the kill.
    assert [round(x["gap_s"], 3) for x in r["rounds"]] == [0.3, 0.4]


def test_a_refused_connection_more_failures_than_reported_or_no_front_fail():
    refused = _judge([_round(10, 1)], [failed(10.1, "ConnectionRefusedError"), ok(10.2, 10.3)], 0)
    assert not refused["passed"] and refused["refused"] == 1
    more = _judge([_round(10, 1)], [failed(10.1), failed(10.1), ok(10.2, 10.3)], 0)
    assert not more["passed"]
    gone = _judge([_round(10, 0, back=False)], [ok(1, 2)], 0)
    assert not gone["passed"]
    before = _judge([_round(10, 0)], [failed(5), ok(10.2, 10.3)], 0)
    assert not before["passed"] and before["failed"] == 1


def test_a_failure_on_a_connection_that_was_idle_at_the_death_is_allowed_for():
    """A client that sent its next request on a kept-alive connection the
    dying front had not read yet: the front counted it idle, not busy."""
    two = [failed(10.1), failed(10.1), ok(10.2, 10.3)]
    r = _judge([_round(10, 1, idle=1)], two, 0)
    assert r["passed"] and r["reported_idle"] == 1
    assert not _judge([_round(10, 1, idle=0)], two, 0)["passed"]


def test_answers_that_differ_or_two_active_engines_fail():
    differ = [ok(0, 1), Sample(1, 2, True, "other", kind="k")]
    assert not _judge([_round(10, 0)], differ, 0)["passed"]
    assert not _judge([_round(10, 0)], [ok(0, 1)], 1)["passed"]
