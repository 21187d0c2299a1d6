"""What each engine container reserves, by role (pure).

The Active engine serves; a standby sleeps. ``engine.resources.requests`` is
what the Active engine's container reserves, and
``failover.standbyResources.requests`` (with a default per adapter for every
resource it does not name) what every other engine's does. The limits are
``engine.resources.limits`` for all of them: any engine may take the lock and
serve at once, so a failover never waits on Kubernetes. After a failover the
operator moves the requests in place (``resize.py``); docs/sizing.md has the
figures the defaults come from.

Quantities are compared by value (:func:`quantity`): the API server prints a
quantity in its canonical form (``1000m`` comes back as ``1``), so a string
comparison would resize forever.

Core module: no I/O imports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction

from understudy.operator.api import EngineAdapter, GpuInstanceSpec, ResourceRequirements

# An engine container's requests when engine.resources names none.
ACTIVE_DEFAULTS: Mapping[str, str] = {"cpu": "100m", "memory": "256Mi"}

# A standby's memory request per adapter: what a standby container holds,
# its engine process, the respawner's spare and the respawner itself (RSS
# measured on local pods, docs/sizing.md). Never more than the Active
# engine's requests, nor than the limits.
#
# Its CPU request is the Active engine's unless failover.standbyResources
# names one. A sleeping engine uses 1-4 millicores, but a CPU request is also
# the container's weight when CPUs are contended, and the containers keep
# their weights through a failover while in-place resize cannot move them
# (Kubernetes 1.36 refuses every resize of a container that holds a DRA
# claim, docs/sizing.md). A small standby request then leaves the new Active
# at a standby's weight beside the restarted engine's start-up at the
# Active's: on the cluster's vLLM drill, the rounds that killed the primary
# stalled 10-19 s with no request completed (bound 10 s), against 1-8 s for
# the others.
STANDBY_DEFAULTS: Mapping[EngineAdapter, Mapping[str, str]] = {
    EngineAdapter.REFERENCE: {"memory": "192Mi"},  # ~175 MB measured
    EngineAdapter.LLAMA: {"memory": "256Mi"},  # ~200 MB (SmolLM2-135M)
    EngineAdapter.SYNTHETIC: {"memory": "192Mi"},  # ~150 MB
    # ~1.1 GB (tiny-llama): engine 567 MB + spare 527 MB, most of it torch's libraries
    EngineAdapter.TORCH: {"memory": "1152Mi"},
    EngineAdapter.VLLM: {"memory": "2Gi"},  # ~1.96 GB (SmolLM2 on vLLM-CPU)
}
# An adapter not measured yet: the largest standby above (the ones that
# import torch hold the most), still capped by the Active engine's requests.
UNMEASURED: Mapping[str, str] = STANDBY_DEFAULTS[EngineAdapter.VLLM]


def standby_defaults(adapter: EngineAdapter) -> Mapping[str, str]:
    return STANDBY_DEFAULTS.get(adapter, UNMEASURED)


_SUFFIX: Mapping[str, Fraction] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    **{
        s: Fraction(2 ** (10 * (i + 1))) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))
    },
}
_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:([eE][+-]?\d+)|([a-zA-Z]*))")


def quantity(value: int | str) -> Fraction:
    """A Kubernetes quantity's value (``"500m"`` -> 1/2, ``"1Gi"`` -> 2**30)."""
    m = _QUANTITY.fullmatch(str(value).strip())
    if m is None or (m.group(3) or "") not in _SUFFIX:
        raise ValueError(f"not a quantity: {value!r}")
    number = Fraction(m.group(1))
    if m.group(2):
        return number * Fraction(10) ** int(m.group(2)[1:])
    return number * _SUFFIX[m.group(3) or ""]


def _filled(
    defaults: Mapping[str, str], caps: Mapping[str, int | str], given: Mapping[str, int | str]
) -> dict[str, str]:
    """``given``, and each default it does not name, lowered to its cap where it has one."""
    out = {}
    for key, value in defaults.items():
        cap = caps.get(key)
        out[key] = value if cap is None or quantity(value) <= quantity(cap) else str(cap)
    return {**out, **{k: str(v) for k, v in given.items()}}


def active_requests(spec: GpuInstanceSpec) -> dict[str, str]:
    res = spec.engine.resources
    return _filled(ACTIVE_DEFAULTS, res.limits, res.requests)


def standby_requests(spec: GpuInstanceSpec) -> dict[str, str]:
    active = active_requests(spec)
    limits = spec.engine.resources.limits
    caps = {k: min(v, limits.get(k, v), key=quantity) for k, v in active.items()}
    given = spec.failover.standby_resources.requests
    # The CPU default is the Active's own (STANDBY_DEFAULTS says why).
    defaults = {"cpu": active["cpu"], **standby_defaults(spec.engine.adapter)}
    return _filled(defaults, caps, given)


def role_requests(spec: GpuInstanceSpec, *, active: bool) -> dict[str, str]:
    return active_requests(spec) if active else standby_requests(spec)


def for_role(spec: GpuInstanceSpec, *, active: bool) -> ResourceRequirements:
    """An engine container's requests (its role's) and limits (the Active engine's)."""
    requests = role_requests(spec, active=active)
    return ResourceRequirements(requests=requests, limits=dict(spec.engine.resources.limits))


def satisfied(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    """Whether ``have`` already requests every quantity of ``want`` (others are not ours)."""
    try:
        return all(k in have and quantity(have[k]) == quantity(v) for k, v in want.items())
    except ValueError:
        return False
