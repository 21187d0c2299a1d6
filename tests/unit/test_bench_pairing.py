"""``bench/``'s paired ratio: the order ``kv_failover.py`` runs its contexts in,
and the bootstrap interval ``_common.ratio_interval`` gives their ratio."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _common import percentile, ratio_interval
from kv_failover import schedule


def test_interleaved_runs_every_context_once_a_round_in_an_order_that_flips() -> None:
    got = schedule([16, 1000, 4000], 4, "interleaved")
    assert got[:3] == [(16, 0), (1000, 0), (4000, 0)]
    assert got[3:6] == [(4000, 1), (1000, 1), (16, 1)]
    assert sorted(got) == sorted((c, r) for c in (16, 1000, 4000) for r in range(4))


def test_blocked_runs_each_context_to_the_end() -> None:
    assert schedule([16, 4000], 2, "blocked") == [(16, 0), (16, 1), (4000, 0), (4000, 1)]


def test_the_interval_holds_the_ratio_and_is_a_function_of_the_data() -> None:
    rng = random.Random(3)
    pairs = [(0.13 + rng.gauss(0, 0.01), 0.10 + rng.gauss(0, 0.01)) for _ in range(16)]
    lo, hi = ratio_interval(pairs)
    point = percentile([a for a, _ in pairs], 50) / percentile([b for _, b in pairs], 50)
    assert lo <= point <= hi
    assert 1.0 < lo < hi < 1.7
    assert ratio_interval(pairs) == (lo, hi)


def test_pairs_resampled_whole_cancel_a_drift_both_sides_share() -> None:
    # Both sides slow down together over the run (the machine's other work):
    # the ratio is 1.3 throughout, and resampling whole pairs says so.
    pairs = [(1.3 * (0.1 + 0.01 * i), 0.1 + 0.01 * i) for i in range(16)]
    lo, hi = ratio_interval(pairs)
    assert lo == pytest.approx(1.3) and hi == pytest.approx(1.3)


def test_no_pairs_is_an_error() -> None:
    with pytest.raises(ValueError, match="no pairs"):
        ratio_interval([])
