"""The gateway's pod core: each pod's machine, the fleet, and which pod (no event loop)."""

from __future__ import annotations

import typing
from dataclasses import replace

import pytest

from understudy.front import pods
from understudy.front.fsm import Watchdog
from understudy.front.pods import (
    Broke,
    Dead,
    Fleet,
    Kind,
    Leaving,
    Listing,
    Overdue,
    Phase,
    Pod,
    Probed,
    Routed,
    Silent,
    Terminating,
    Unrouted,
    step,
)

A = Listing("a", "127.0.0.1", 18900, 18903)
B = Listing("b", "127.0.0.1", 18910, 18913)


def pod(phase: Phase, li: Listing = A, **kw: typing.Any) -> Pod:
    return Pod(li, phase, **kw)


# One event of each kind, for a pod that died at t=5.
EVENTS: dict[Kind, pods.Event] = {
    Kind.READY: Probed("a", True, sent_at=6.0),
    Kind.UNREADY: Probed("a", False, sent_at=6.0),
    Kind.BEFORE_DEATH: Probed("a", True, sent_at=4.0),
    Kind.GONE: Probed("a", True, sent_at=6.0),  # to a pod listed as terminating
    Kind.BROKE: Broke("a", "reset"),
    Kind.SILENT: Silent("a", 1.2),
    Kind.TERMINATING: Terminating("a", until=27.0),
    Kind.OVERDUE: Overdue("a"),
}


def test_the_events_cover_every_kind() -> None:
    assert set(EVENTS) == set(Kind)


# Only a dead pod has a past for a probe to predate, or is gone for good.
DEAD_ONLY = (Kind.BEFORE_DEATH, Kind.GONE)
PAIRS = [(ph, k) for ph in Phase for k in Kind if k not in DEAD_ONLY or ph is Phase.DEAD]


@pytest.mark.parametrize(("phase", "k"), PAIRS)
def test_every_phase_and_kind_lands_where_the_table_says_or_is_refused(
    phase: Phase, k: Kind
) -> None:
    li = replace(A, terminating=True) if k is Kind.GONE else A
    p = pod(phase, li, dead_at=5.0 if phase is Phase.DEAD else None)
    assert pods.kind(p, EVENTS[k]) is k
    entry = pods.TRANSITIONS.get((phase, k))
    if entry is None:
        with pytest.raises(pods.InvalidTransition):
            step(p, EVENTS[k], 7.0)
        return
    new, _ = step(p, EVENTS[k], 7.0)
    assert new.phase in entry.targets


def test_a_ready_probe_routes_a_new_pod_and_a_silent_one_dies() -> None:
    p, actions = step(pod(Phase.NEW), Probed("a", True, 1.0), 1.01)
    assert (p.phase, p.heard_at, actions) == (Phase.READY, 1.01, [Routed("a", 1)])
    p, actions = step(p, Silent("a", 1.5), 2.5)
    assert (p.phase, p.reason, p.dead_at) == (Phase.DEAD, "silent", 2.5)
    assert actions == [Dead("a", "silent")]


def test_a_dead_pod_comes_back_only_on_a_probe_sent_after_its_death() -> None:
    dead, _ = step(pod(Phase.READY), Broke("a", "refused"), 5.0)
    same, actions = step(dead, Probed("a", True, sent_at=4.9), 5.1)
    assert (same, actions) == (dead, [])
    back, actions = step(dead, Probed("a", True, sent_at=5.2), 5.3)
    assert (back.phase, back.generation, back.reason) == (Phase.READY, 2, "")
    assert actions == [Routed("a", 2)]


def test_an_unready_pod_takes_nothing_new_but_keeps_what_it_has() -> None:
    p, actions = step(pod(Phase.READY), Probed("a", False, 1.0), 1.0)
    assert (p.phase, actions) == (Phase.UNREADY, [Unrouted("a")])  # no Dead: nothing moves


def test_a_listing_that_leaves_or_moves_is_dead_and_a_new_one_starts_unheard() -> None:
    f = Fleet({"a": pod(Phase.READY), "b": pod(Phase.READY, B)})
    moved = replace(B, port=18920)
    f, actions = pods.listed(f, [moved], 1.0)
    assert actions == [Dead("a", "removed"), Dead("b", "removed")]
    assert f.pods == {"b": Pod(moved, Phase.NEW, generation=2)}


def test_an_event_for_a_pod_no_longer_listed_is_moot() -> None:
    f = Fleet({})
    assert pods.feed(f, Broke("a", "reset"), 1.0) == (f, [])


def test_pick_takes_the_ready_pod_with_fewest_in_flight_and_ties_in_turn() -> None:
    c = Listing("c", "127.0.0.1", 18930, 18933)
    f = Fleet({"a": pod(Phase.READY), "b": pod(Phase.READY, B), "c": pod(Phase.DEAD, c)})
    busy = {"a": 3, "b": 1, "c": 0}
    assert pods.pick(f, busy.__getitem__, 0) == f.pods["b"]
    even = {"a": 0, "b": 0, "c": 0}
    assert [pods.pick(f, even.__getitem__, t).name for t in range(4)] == ["a", "b", "a", "b"]  # type: ignore[union-attr]
    assert pods.pick(Fleet({"c": f.pods["c"]}), even.__getitem__, 0) is None
    assert pods.routable(f) == 2


def test_silence_is_judged_by_a_punctual_check_only() -> None:
    w = Watchdog(hang_after_s=1.0, check_s=0.1, stall_s=0.25)
    f = Fleet({"a": pod(Phase.READY, heard_at=10.0), "b": pod(Phase.NEW, B)})
    assert pods.silent(f, w, due=10.9, now=10.95) == []
    [silent] = pods.silent(f, w, due=11.1, now=11.12)
    assert silent.name == "a" and silent.silent_s == pytest.approx(1.12)
    assert pods.silent(f, w, due=11.1, now=11.5) == []  # the gateway itself stalled
    assert pods.stream_silent(w, 11.1, 11.12, quiet_since=10.0)
    assert not pods.stream_silent(w, 11.1, 11.12, quiet_since=None)


@pytest.mark.parametrize(
    ("text", "listing"),
    [
        (
            "http://127.0.0.1:18900?status=18903",
            Listing("127.0.0.1:18900", "127.0.0.1", 18900, 18903),
        ),
        ("10.0.0.7:8000", Listing("10.0.0.7:8000", "10.0.0.7", 8000, 8090)),
        ("http://h:1/?status=2&name=p0", Listing("p0", "h", 1, 2)),
    ],
)
def test_a_pod_address_reads_back(text: str, listing: Listing) -> None:
    assert pods.parse_pod(text) == listing


@pytest.mark.parametrize(
    "text",
    [
        "https://h:1",
        "http://h",
        "http://h:1/v1",
        "http://h:1?x=1",
        "http://h:1?status=0",
        "h:99999",
    ],
)
def test_a_bad_pod_address_is_refused(text: str) -> None:
    with pytest.raises(pods.PodListError):
        pods.parse_pod(text)


def test_a_pods_file_is_a_list_of_addresses_with_distinct_names() -> None:
    assert pods.parse_pods_file('["h:1?status=2"]') == [Listing("h:1", "h", 1, 2)]
    both = '["h:1?status=2", {"address": "h:3?status=4", "terminating": true}]'
    assert pods.parse_pods_file(both) == [
        Listing("h:1", "h", 1, 2),
        Listing("h:3", "h", 3, 4, terminating=True),
    ]
    bad_objects = ('[{"address": 1}]', '[{"address": "h:1", "terminating": "yes"}]')
    for bad in ("{}", "[1]", "not json", '["h:1", "h:1"]', *bad_objects):
        with pytest.raises(pods.PodListError):
            pods.parse_pods_file(bad)


def test_a_terminating_pod_takes_nothing_new_and_moves_what_it_has_at_its_grace_end() -> None:
    f = Fleet({"a": pod(Phase.READY, heard_at=1.0), "b": pod(Phase.READY, B, heard_at=1.0)})
    f, actions = pods.listed(f, [replace(A, terminating=True), B], 2.0, grace_s=20.0)
    assert actions == [Leaving("a", 22.0)]  # no Dead: nothing of it moves yet
    assert f.pods["a"].phase is Phase.LEAVING and f.pods["a"].listing.terminating
    assert pods.pick(f, {"a": 0, "b": 5}.__getitem__, 0) == f.pods["b"]
    # listed again (the file re-read): still leaving, by the same deadline
    f, actions = pods.listed(f, [replace(A, terminating=True), B], 3.0, grace_s=20.0)
    assert actions == [] and f.pods["a"].leave_by == 22.0
    f, actions = pods.feed(f, Probed("a", True, 4.0), 4.0)  # alive, and leaving
    assert actions == [] and f.pods["a"].phase is Phase.LEAVING and f.pods["a"].heard_at == 4.0
    assert pods.overdue(f, 21.9) == []
    [late] = pods.overdue(f, 22.0)
    f, actions = pods.feed(f, late, 22.0)
    assert actions == [Dead("a", "removed")] and f.pods["a"].phase is Phase.DEAD
    # Its front still answers until the kubelet stops it: it stays out (a
    # revival here routed new requests to it, and left "leaving" or "dead"
    # for a window as short as the grace plus one probe).
    f, actions = pods.feed(f, Probed("a", True, 22.1), 22.15)
    assert actions == [] and f.pods["a"].phase is Phase.DEAD and pods.routable(f) == 1
    # Listed as serving again (the rollout undone), the next answer revives it.
    f, _ = pods.listed(f, [A, B], 23.0, grace_s=20.0)
    f, actions = pods.feed(f, Probed("a", True, 23.1), 23.15)
    assert actions == [Routed("a", 2)] and pods.routable(f) == 2


def test_a_leaving_pod_that_breaks_or_falls_silent_dies_at_once() -> None:
    leaving = pod(Phase.LEAVING, heard_at=10.0, leave_by=30.0)
    p, actions = step(leaving, Broke("a", "reset"), 11.0)
    assert (p.phase, actions) == (Phase.DEAD, [Dead("a", "reset")])
    w = Watchdog(hang_after_s=1.0, check_s=0.1, stall_s=0.25)
    [silent] = pods.silent(Fleet({"a": leaving}), w, due=11.1, now=11.12)
    assert silent.name == "a"


def test_a_pod_first_listed_as_terminating_never_takes_a_request() -> None:
    f, actions = pods.listed(Fleet({}), [replace(A, terminating=True)], 1.0, grace_s=5.0)
    assert actions == [Leaving("a", 6.0)]
    f, _ = pods.feed(f, Probed("a", True, 1.1), 1.2)
    assert pods.routable(f) == 0
