"""The lock server's durable failover tally: counting, and its JSON form."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from understudy.lockserver import tally
from understudy.lockserver.tally import HANDOVER_BUCKETS, Tally


def test_grants_count_by_kind() -> None:
    t = tally.granted(Tally(), resumed=False, reissued=False, handover=False, handover_s=None)
    t = tally.granted(t, resumed=True, reissued=False, handover=False, handover_s=None)
    t = tally.granted(t, resumed=False, reissued=True, handover=False, handover_s=None)
    t = tally.granted(t, resumed=False, reissued=False, handover=True, handover_s=0.002)
    assert (t.grants, t.resumed_grants, t.reissues, t.handovers) == (3, 1, 1, 1)
    assert sum(t.handover.counts) == 1 and t.handover.total == pytest.approx(0.002)


def test_handover_lands_in_its_bucket_and_cumulates() -> None:
    t = Tally()
    for s in (0.0004, 0.001, 0.07, 45.0):
        t = tally.granted(t, resumed=False, reissued=False, handover=True, handover_s=s)
    cum = dict(t.handover.cumulative())
    assert cum["0.0005"] == 1  # 0.4 ms
    assert cum["0.001"] == 2  # le is inclusive, as in Prometheus
    assert cum["0.05"] == 2 and cum["0.075"] == 3
    assert cum["30.0"] == 3 and cum["+Inf"] == 4
    assert list(cum)[-1] == "+Inf" and len(cum) == len(HANDOVER_BUCKETS) + 1


def test_windows_by_reason() -> None:
    t = tally.window_closed(tally.window_closed(Tally(), "expired"), "expired")
    t = tally.window_closed(t, "reclaimed")
    assert t.window_count("expired") == 2 and t.window_count("reclaimed") == 1
    assert t.window_count("holder_gone") == 0


@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.booleans(),
            st.booleans(),
            st.none() | st.floats(0, 100, allow_nan=False),
        ),
        max_size=30,
    ),
    st.lists(st.sampled_from(tally.WINDOW_REASONS), max_size=5),
)
def test_json_round_trip(
    grants: list[tuple[bool, bool, bool, float | None]], windows: list[str]
) -> None:
    t = Tally()
    for resumed, reissued, handover, seconds in grants:
        t = tally.granted(
            t, resumed=resumed, reissued=reissued, handover=handover, handover_s=seconds
        )
    for reason in windows:
        t = tally.window_closed(t, reason)
    for _, _, _, seconds in grants:
        t = tally.rearmed(t, (seconds or 0) * 10)
    assert tally.from_json(json.loads(json.dumps(tally.to_json(t)))) == t


def test_other_bucket_bounds_drop_only_the_histogram() -> None:
    t = tally.granted(Tally(), resumed=False, reissued=False, handover=True, handover_s=0.01)
    doc = tally.to_json(t)
    doc["handover_seconds"] = {"bounds": [1, 2], "counts": [0, 1, 0], "sum": 1.5}
    back = tally.from_json(doc)
    assert back.handovers == 1 and sum(back.handover.counts) == 0


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"grants": "1"},
        {"reissues": True},
        {"windows_closed": []},
        {"handover_seconds": {"bounds": list(HANDOVER_BUCKETS), "counts": [1], "sum": 0}},
        {
            "handover_seconds": {
                "bounds": list(HANDOVER_BUCKETS),
                "counts": [0] * (len(HANDOVER_BUCKETS) + 1),
                "sum": -1,
            }
        },
    ],
)
def test_not_a_tally_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        tally.from_json(bad)


def test_rearm_is_its_own_histogram() -> None:
    t = tally.rearmed(tally.rearmed(Tally(), 4.2), 9000)
    cum = dict(t.rearm.cumulative())
    assert cum["4.0"] == 0 and cum["5.0"] == 1 and cum["1800.0"] == 1 and cum["+Inf"] == 2
    assert sum(t.handover.counts) == 0 and t.rearm.total == pytest.approx(9004.2)
