"""The status's history: what is news, and its bound."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from understudy.operator import lifecycle as lc
from understudy.operator import status
from understudy.operator.api import ReplicaPhase as P
from understudy.operator.conditions import Reason

V = lc.Verdict
WAITING = lc.HistoryEntry(1.0, 0, 1, lc.Check.BIND, V.SKIPPED, None, P.SCHEDULED, "waiting")


def test_repeated_waiting_is_not_news() -> None:
    e = WAITING
    assert status.accepted([], [e, e]) == [e]
    assert status.accepted([e], [replace(e, time=2.0)]) == []
    other = replace(e, message="other")
    assert status.accepted([e], [other]) == [other]
    again = replace(e, attempt=2)  # the same wait for a new attempt is news
    assert status.accepted([e], [again]) == [again]
    elsewhere = replace(e, replica=1)  # and so is another replica's
    assert status.accepted([e], [elsewhere]) == [elsewhere]


def test_a_transition_is_always_news() -> None:
    moved = replace(WAITING, reason=Reason.BOUND, verdict=V.SUCCESS, phase=P.STARTING)
    assert status.accepted([WAITING], [moved, moved]) == [moved, moved]


entries = st.builds(
    lc.HistoryEntry,
    time=st.floats(0, 100),
    replica=st.integers(0, 2),
    attempt=st.integers(0, 2),
    check=st.sampled_from(list(lc.Check)),
    verdict=st.sampled_from(list(V)),
    reason=st.sampled_from([None, Reason.BOUND, Reason.EXPIRED]),
    phase=st.sampled_from(list(P)),
    message=st.sampled_from(["a", "b"]),
)


@given(st.lists(st.lists(entries, max_size=6), max_size=20), st.integers(1, 10))
def test_the_history_keeps_the_last_news_within_its_limit(
    passes: list[list[lc.HistoryEntry]], limit: int
) -> None:
    hist: tuple[lc.HistoryEntry, ...] = ()
    for batch in passes:
        news = status.accepted(hist, batch)
        hist = status.append_history(hist, batch, limit)
        assert len(hist) <= limit
        if news:  # the newest news is always kept, in order
            assert list(hist[-min(len(news), limit) :]) == news[-limit:]
