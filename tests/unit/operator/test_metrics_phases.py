"""understudy_operator_instances: GpuInstances per phase, as last reconciled."""

from __future__ import annotations

import prometheus_client as prom

from understudy.operator.metrics import PhaseBook


def _count(phase: str) -> float | None:
    return prom.REGISTRY.get_sample_value("understudy_operator_instances", {"phase": phase})


def test_phases_are_counted_moved_and_forgotten() -> None:
    book = PhaseBook()
    assert _count("Running") == 0 and _count("Pending") == 0  # every phase has a series
    book.record(("ns", "a"), "Running")
    book.record(("ns", "b"), "Running")
    book.record(("other", "a"), "Degraded")
    assert (_count("Running"), _count("Degraded")) == (2, 1)
    book.record(("ns", "b"), "Degraded")  # a phase change moves the instance
    assert (_count("Running"), _count("Degraded")) == (1, 2)
    book.forget(("ns", "a"))
    book.forget(("ns", "a"))  # twice is harmless
    assert (_count("Running"), _count("Degraded")) == (0, 2)
