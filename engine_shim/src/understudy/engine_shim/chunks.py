"""The grid a prompt is computed on: where its chunks start.

A prompt runs in chunks, each one matrix product per weight, and a
position's keys, values and logits are the bits of the product its chunk was
(`adapters.llama_model`). A continuation that reuses sealed blocks computes
again from a chunk's start, so a prompt's chunks must be the same every
time: the grid depends on nothing but ``first``, never on the prompt's
length or on where a computation starts.

The grid: 0, ``first``, 2·first, 4·first, ... doubling up to WIDEST·first,
then every WIDEST·first. Narrow chunks first, so that a short prompt (a
chat's system prompt) is reused in steps of ``first``; wide ones after,
because a product's speed grows with its rows. SmolLM2, 1,024 positions, one
core (OpenBLAS's AVX-512 kernels, an idle machine, 2026-12-02): chunks of 64,
128 and 256 took 2.6, 2.0 and 1.7 s, the whole prompt as one product 1.7 s.
"""

from __future__ import annotations

from typing import Final

__all__ = ["WIDEST", "end_after", "start_before"]

WIDEST: Final = 4
"""The widest chunk, in ``first`` chunks: a power of two, so that doubling
from ``first`` lands on it."""


def start_before(position: int, first: int) -> int:
    """The grid's last chunk start at or before ``position``."""
    if position < 0 or first < 1:
        raise ValueError(f"no chunk starts before position {position} (first chunk {first})")
    widest = WIDEST * first
    if position >= widest:
        return position - position % widest
    if position < first:
        return 0
    start = first
    while 2 * start <= position:  # first, 2·first, ... below widest
        start *= 2
    return start


def end_after(start: int, first: int) -> int:
    """Where the chunk that starts at ``start`` (a chunk start) ends."""
    if start_before(start, first) != start:
        raise ValueError(f"{start} is not a chunk start (first chunk {first})")
    if start == 0:
        return first
    return start + min(start, WIDEST * first)
