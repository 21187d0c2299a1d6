"""The grid a prompt is computed on (`chunks`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from understudy.engine_shim import chunks


def grid(first: int, until: int) -> list[int]:
    starts = [0]
    while starts[-1] <= until:
        starts.append(chunks.end_after(starts[-1], first))
    return starts


def test_the_grid_doubles_to_the_widest_chunk_then_steps_by_it() -> None:
    assert grid(64, 1100) == [0, 64, 128, 256, 512, 768, 1024, 1280]
    assert grid(1, 10) == [0, 1, 2, 4, 8, 12]


@given(st.integers(1, 300), st.integers(0, 5000))
def test_a_position_lies_in_the_chunk_that_starts_before_it(first: int, position: int) -> None:
    start = chunks.start_before(position, first)
    assert start <= position < chunks.end_after(start, first)
    assert start in grid(first, position)
    # a chunk is never wider than WIDEST first chunks, and a start is a fixed point
    assert chunks.end_after(start, first) - start <= chunks.WIDEST * first
    assert chunks.start_before(start, first) == start


def test_what_is_not_a_chunk_start_is_refused() -> None:
    with pytest.raises(ValueError, match="not a chunk start"):
        chunks.end_after(320, 64)  # a multiple of 64, not a start past 256
    with pytest.raises(ValueError, match="no chunk starts"):
        chunks.start_before(-1, 64)
    with pytest.raises(ValueError, match="no chunk starts"):
        chunks.start_before(5, 0)
