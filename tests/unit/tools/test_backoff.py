from hypothesis import given
from hypothesis import strategies as st

from understudy.tools.backoff import Backoff, Policy, exited, started

KUBELET = Policy()


def _crash_loop(policy: Policy, exits: int, runtime: float) -> list[float]:
    """Delays between an exit and the next start for a container that runs ``runtime`` s."""
    b, now, delays = started(Backoff(), 0.0), 0.0, []
    for _ in range(exits):
        now += runtime
        b, start = exited(b, policy, now)
        delays.append(start - now)
        now = start
        b = started(b, now)
    return delays


def test_kubelet_sequence_first_restart_immediate_then_doubling_to_five_minutes():
    # The clock runs from the previous start, as kubelet's does.
    assert _crash_loop(KUBELET, 8, 0.0) == [0, 10, 20, 40, 80, 160, 300, 300]
    assert _crash_loop(KUBELET, 3, 0.5) == [0, 9.5, 19.5]


def test_a_container_that_ran_ten_minutes_starts_over():
    b = started(Backoff(), 0.0)
    b, _ = exited(b, KUBELET, 1.0)
    b = started(b, 1.0)
    b, start = exited(b, KUBELET, 1.0 + 600.0)
    assert start == 601.0  # no wait
    assert b.delay_s == KUBELET.initial_s


def test_capped_policy_mirrors_max_container_restart_period():
    p = Policy.capped(1.0)
    assert (p.initial_s, p.max_s) == (1.0, 1.0)
    assert _crash_loop(p, 4, 0.0) == [0, 1.0, 1.0, 1.0]


@given(st.lists(st.floats(0.0, 1000.0), min_size=1, max_size=30))
def test_never_waits_longer_than_the_cap(runtimes: list[float]):
    b, now = started(Backoff(), 0.0), 0.0
    for r in runtimes:
        now += r
        b, start = exited(b, KUBELET, now)
        # start is last_start + delay: the subtraction may round a hair over.
        assert 0.0 <= start - now <= KUBELET.max_s + 1e-9
        now = start
        b = started(b, now)
