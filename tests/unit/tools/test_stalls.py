"""A stream's stall at a kill and its own time between tokens, from made-up
token times: which streams a kill caught, which interval is the stall (a token
that was in flight at the kill does not hide it), what is left as the TPOT;
and how the drill carries them from a client's stream to its summary."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from understudy.tools.drill_load import Kind, _answer
from understudy.tools.drill_result import Report, Round, headline, render, to_json
from understudy.tools.series import RECENT, Sample, Tally
from understudy.tools.stalls import IN_FLIGHT_S, Stall, stream_times

# A stream that gets a token every 0.1 s from 10.0 to 11.0, and 0.6 s of
# silence from 10.5: where a kill at 10.55 falls.
STEADY = [10.0, 10.1, 10.2, 10.3, 10.4, 10.5, 11.1, 11.2, 11.3]


def _pairs(stalls: Iterable[Stall]) -> list[tuple[int, float]]:
    """(kill, stall) rounded to a microsecond: the sums above are not exact."""
    return [(x.kill, round(x.stall_s, 6)) for x in stalls]


def test_a_kill_between_two_tokens_is_that_streams_stall() -> None:
    got = stream_times(STEADY, [10.55])
    assert _pairs(got.stalls) == [(0, 0.6)]
    assert sorted(got.between_s) == pytest.approx([0.1] * 7)


@pytest.mark.parametrize(
    "kills",
    [[], [9.0], [11.3], [12.0], [9.0, 12.0]],
    ids=["no kill", "before its first token", "at its last", "after it", "around it"],
)
def test_a_stream_not_between_two_tokens_at_a_kill_is_not_caught(kills: list[float]) -> None:
    # not caught, so it lends no TPOT either: the TPOT is the caught streams'
    got = stream_times(STEADY, kills)
    assert got.stalls == () and got.between_s == ()


def test_a_token_in_flight_at_the_kill_does_not_hide_the_stall() -> None:
    # the dying engine's last token reaches the client 10 ms after the kill:
    # the pause is the interval after it
    tokens = [10.0, 10.1, 10.2, 10.31, 11.0, 11.1]
    got = stream_times(tokens, [10.3])
    assert _pairs(got.stalls) == [(0, 0.69)]
    assert sorted(got.between_s) == pytest.approx([0.1, 0.1, 0.1])  # 10.2 -> 10.31 is the kill's
    # a token later than the in-flight allowance is the new engine's: the
    # stall is the pause before it
    late = [10.0, 10.1, 10.3 + IN_FLIGHT_S + 0.01, 10.5]
    assert _pairs(stream_times(late, [10.3]).stalls) == [(0, 0.26)]


def test_each_kill_a_stream_lives_through_is_its_own_stall() -> None:
    tokens = [0.0, 0.1, 0.9, 1.0, 1.1, 2.0, 2.1]
    kills = [-5.0, 0.5, 1.5, 9.0]  # the drill's every kill, in order
    got = stream_times(tokens, kills)
    assert _pairs(got.stalls) == [(1, 0.8), (2, 0.9)]
    assert sorted(got.between_s) == pytest.approx([0.1, 0.1, 0.1, 0.1])


@given(
    st.lists(st.floats(0.001, 2.0), min_size=1, max_size=30),
    st.lists(st.floats(-1.0, 40.0), max_size=6),
)
def test_stalls_and_the_rest_are_the_streams_intervals(steps: list[float], at: list[float]) -> None:
    tokens = list(itertools.accumulate(steps))
    kills = sorted(at)
    got = stream_times(tokens, kills)
    caught = [k for k, t in enumerate(kills) if tokens[0] <= t < tokens[-1]]
    assert [s.kill for s in got.stalls] == caught
    intervals = [b - a for a, b in itertools.pairwise(tokens)]
    for s in got.stalls:
        # at least the interval the kill fell in, at most the stream's longest
        inside = next(b - a for a, b in itertools.pairwise(tokens) if a <= kills[s.kill] < b)
        assert inside <= s.stall_s <= max(intervals)
    if caught:
        assert len(got.between_s) < len(intervals)
        assert all(v in intervals for v in got.between_s)
    else:
        assert got.between_s == ()


def test_the_tally_reads_each_streams_tokens_once_and_lets_them_go() -> None:
    tally = Tally()
    streams = [
        Sample(9.9, 11.4, True, "d", kind="chat-stream", tokens=tuple(STEADY)),
        Sample(10.0, 10.4, True, "d", kind="chat-stream", tokens=(10.1, 10.2, 10.3)),  # done
        Sample(10.0, 10.6, True, "e", kind="chat"),  # not a stream
    ]
    tally.add(streams, [10.55])
    assert _pairs(tally.stalls) == [(0, 0.6)]
    assert sorted(tally.between) == pytest.approx([0.1] * 7)
    assert all(s.tokens == () for s in streams)  # a long drill keeps no token times
    assert tally.requests == 3
    # the answered ones' durations, the last RECENT of them (the drill's kill phase)
    assert list(tally.recent_s) == pytest.approx([1.5, 0.4, 0.6])
    tally.add([Sample(0.0, 2.0, False, error="x")] + [Sample(0.0, 0.25, True, "d")] * 60, [])
    assert list(tally.recent_s) == [0.25] * RECENT


def test_the_summary_and_its_text_lead_with_the_stall_against_the_tpot() -> None:
    stalls = [Stall(0, 0.30), Stall(0, 0.50), Stall(1, 0.40)]
    rounds = [
        Round(1, "engine-primary", 11, 1, kill_at_s=1.0, gap_s=4.0),
        Round(2, "engine-shadow-1", 12, 2, kill_at_s=5.0, gap_s=5.0),
    ]
    report = Report(rounds=rounds, stalls=stalls, between=[0.1, 0.2, 0.25], clients=8)
    s = report.summary()
    assert s["streams_caught"] == 3
    assert (s["stall_s"]["p50"], s["stall_s"]["p99"], s["stall_s"]["max"]) == (0.4, 0.5, 0.5)
    assert (s["tpot_s"]["p50"], s["tpot_s"]["max"]) == (0.2, 0.25)
    assert s["gap_s"]["max"] == 5.0  # kept, under its own key, for the chaos tests' bounds
    assert headline(s) == (
        "a stream's stall at a kill (its last token before -> first after): "
        "p50 400.0, p99 500.0, max 500.0 ms; the same streams' time between tokens: "
        "p50 200.0, p99 250.0, max 250.0 ms (3 streams caught in 2 kills)"
    )
    text = render(report).splitlines()
    assert text[1] == f"drill: {headline(s)}"
    rows = [line.split("  ")[0] for line in text[4:]]
    assert rows[:2] == ["a stream's stall at a kill", "the same streams' time between tokens"]
    assert "longest time with no request completed" in rows
    assert "client-observed" not in "\n".join(text)
    assert json.loads(json.dumps(to_json(report)))["summary"]["stall_s"]["n"] == 3


def test_a_drill_without_streams_says_so() -> None:
    s = Report(rounds=[Round(1, "a", 1, 1)]).summary()
    assert headline(s) == "no stream was caught by a kill between two of its tokens"
    assert headline({"kills": 3}) == "this drill did not time its streams' tokens"


def test_a_streams_tokens_are_the_events_that_carry_text() -> None:
    # a chat stream: the role's event, two words, the finish, the usage, [DONE]
    events = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "An"}}]},
        {"choices": [{"delta": {"content": " understudy"}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    data += b"data: [DONE]\n\n"
    kind = Kind("chat-stream", "/v1/chat/completions", {}, streaming=True)
    answer, tokens = _answer(kind, data, [1.0, 1.1, 1.3, 1.4, 1.5, 1.6])
    assert json.loads(answer) == ["An understudy", "length"]
    assert tokens == (1.1, 1.3)
    assert _answer(kind, data)[1] == ()  # no arrival times read: none to give
