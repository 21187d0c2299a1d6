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


def test_no_failure_passes_and_the_gap_is_each_kills():
    samples = [ok(0, 1), ok(9.9, 10.2), ok(10.01, 10.3), ok(20.05, 20.4)]
    r = _judge([_round(10, 0), _round(20, 0)], samples, 0)
    assert r["passed"]
    assert [(x["failed"], x["refused"]) for x in r["rounds"]] == [(0, 0), (0, 0)]
    # The gap: the first answer to a request sent after the kill.
    assert [round(x["gap_s"], 3) for x in r["rounds"]] == [0.3, 0.4]


def test_any_failure_fails_even_one_the_next_front_reported_lost():
    """The connections outlive the front (issue 30): a request inside the
    dying front is finished by the next one, so none may fail, reported
    lost or not (a connection not kept is a failure too)."""
    reported = _judge([_round(10, 2, idle=1)], [failed(10.1), ok(10.2, 10.3)], 0)
    assert not reported["passed"] and reported["rounds"][0]["failed"] == 1
    # each failure says when, against its kill, and where (the client's side)
    where = Sample(9.8, 10.1, False, error="ConnectionResetError", kind="k", detail="sending")
    told = _judge([_round(10, 0)], [where], 0)["rounds"][0]["failures"]
    assert told == ["ConnectionResetError sending: -0.200..+0.100 s"]
    refused = _judge([_round(10, 1)], [failed(10.1, "ConnectionRefusedError"), ok(10.2, 10.3)], 0)
    assert not refused["passed"] and refused["refused"] == 1
    gone = _judge([_round(10, 0, back=False)], [ok(1, 2)], 0)
    assert not gone["passed"]
    before = _judge([_round(10, 0)], [failed(5), ok(10.2, 10.3)], 0)
    assert not before["passed"] and before["failed"] == 1


def test_answers_that_differ_or_two_active_engines_fail():
    differ = [ok(0, 1), Sample(1, 2, True, "other", kind="k")]
    assert not _judge([_round(10, 0)], differ, 0)["passed"]
    assert not _judge([_round(10, 0)], [ok(0, 1)], 1)["passed"]
