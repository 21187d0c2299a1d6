"""rollout.moves: scale and surge-first replacement, by example and by property."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from understudy.operator.rollout import Budget, Member, Moves, moves
from understudy.operator.scheduler import keep_score, removal_order


def m(index: int, *, updated: bool = True, available: bool = True, leaving: bool = False) -> Member:
    return Member(index, updated=updated, available=available, leaving=leaving)


def test_scale_up_takes_the_lowest_free_indices_and_skips_leaving_ones() -> None:
    got = moves([m(0), m(1, leaving=True), m(3)], Budget(4))
    assert got == Moves(add=(2, 4))


def test_scale_down_retires_the_not_serving_then_the_highest() -> None:
    assert moves([m(0), m(1), m(2), m(3)], Budget(2)).retire == (3, 2)
    assert moves([m(0), m(1, available=False), m(2)], Budget(2)).retire == (1,)


def test_one_replica_rollout_is_surge_first() -> None:
    # The old pod serves; the replacement is created before anything leaves.
    assert moves([m(0, updated=False)], Budget(1)) == Moves(add=(1,))
    # The replacement is not available yet: the old one stays.
    assert moves([m(0, updated=False), m(1, available=False)], Budget(1)) == Moves()
    # It is: the old one leaves.
    assert moves([m(0, updated=False), m(1)], Budget(1)) == Moves(retire=(0,))


def test_max_unavailable_without_surge_replaces_in_place() -> None:
    b = Budget(2, max_surge=0, max_unavailable=1)
    assert moves([m(0, updated=False), m(1, updated=False)], b) == Moves(retire=(1,))
    assert moves([m(0, updated=False), m(1, leaving=True)], b) == Moves(add=(2,))


def test_old_replicas_that_do_not_serve_go_first() -> None:
    members = [m(0, updated=False), m(1, updated=False, available=False), m(2), m(3)]
    assert moves(members, Budget(3)).retire == (1,)


def test_scale_down_during_a_rollout() -> None:
    members = [m(0, updated=False), m(1), m(2)]
    assert sorted(moves(members, Budget(1)).retire) == [0, 2]


def test_removal_order_is_status_then_freshness_then_highest_index() -> None:
    members = [m(0), m(1, updated=False), m(2, available=False), m(3), m(4, available=False)]
    assert [x.index for x in removal_order(members)] == [4, 2, 1, 3, 0]
    assert keep_score(m(0)) > keep_score(m(0, updated=False)) > keep_score(m(0, available=False))


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[Member], Budget]:
    indices = draw(st.lists(st.integers(0, 12), unique=True, max_size=10))
    members = [
        Member(
            i,
            updated=draw(st.booleans()),
            available=draw(st.booleans()),
            leaving=draw(st.booleans()),
        )
        for i in indices
    ]
    surge = draw(st.integers(0, 3))
    unavailable = draw(st.integers(0 if surge else 1, 3))
    return members, Budget(draw(st.integers(1, 8)), surge, unavailable)


@settings(max_examples=500)
@given(fleets())
def test_invariants_of_one_step(fleet: tuple[list[Member], Budget]) -> None:
    members, b = fleet
    got = moves(members, b)
    live = [x for x in members if not x.leaving]
    new = [x for x in live if x.updated]
    old = [x for x in live if not x.updated]
    retired = {x.index for x in live if x.index in got.retire}
    # Never a taken index, never a leaving replica, nothing twice.
    assert not set(got.add) & {x.index for x in members}
    assert set(got.retire) == retired and len(got.retire) == len(retired)
    # Surge bound: with old replicas around, at most count + maxSurge live.
    if old:
        assert len(live) + len(got.add) - len(got.retire) <= max(len(live), b.count + b.max_surge)
    # Availability: unless scaling down, a rollout keeps count - maxUnavailable
    # replicas available (or all that were, if fewer).
    if len(new) <= b.count:
        kept = sum(1 for x in live if x.available and x.index not in retired)
        before = sum(1 for x in live if x.available)
        assert kept >= min(before, b.count - b.max_unavailable)
    # Victims follow the ranking: no kept replica of its kind ranks below a victim.
    for group in (new, old):
        victims = [x for x in group if x.index in retired]
        kept_group = [x for x in group if x.index not in retired]
        for v in victims:
            for k in kept_group:
                assert (keep_score(v), -v.index) <= (keep_score(k), -k.index)


@settings(max_examples=200)
@given(fleets())
def test_a_rollout_converges(fleet: tuple[list[Member], Budget]) -> None:
    """Added replicas become available next step, retired ones leave: all updated, count live."""
    members, b = fleet
    members = [x for x in members if not x.leaving]
    for _ in range(4 * (len(members) + b.count) + 4):
        got = moves(members, b)
        settled = all(x.available for x in members)
        if got == Moves() and settled:
            break
        members = [Member(x.index, x.updated, True) for x in members if x.index not in got.retire]
        members += [Member(i, updated=True, available=False) for i in got.add]
    assert len(members) == b.count and all(x.updated for x in members)
