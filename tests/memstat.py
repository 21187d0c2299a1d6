"""This process's memory as the kernel reports it (``/proc/self/smaps_rollup``),
for the tests of what a standby gives back."""

from __future__ import annotations

from pathlib import Path


def smaps(name: str) -> int:
    """One field of smaps_rollup (``Rss``, ``LazyFree``, ...), in bytes."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {name} in /proc/self/smaps_rollup")


def working_set() -> int:
    """Resident memory less what the kernel may take back without asking
    (``LazyFree``: ``MADV_FREE``'d pages), as kubelet's working set counts it."""
    return smaps("Rss") - smaps("LazyFree")
