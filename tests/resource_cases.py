"""GpuInstance resources that admission refuses, and what it says (unit and cluster tiers).

The unit tier checks them against the CRD's schema with a CEL evaluator
that imitates Kubernetes' quantity library; the cluster tier against
kube-apiserver itself.
"""

from __future__ import annotations

from typing import Any

# A quantity the schema's pattern refuses: each validator words that its own way.
PATTERN = "<pattern>"

WRONG_RESOURCES: dict[str, tuple[dict[str, Any], str]] = {
    "not a quantity": ({"engine": {"resources": {"requests": {"cpu": "1 core"}}}}, PATTERN),
    "request over its limit": (
        {"engine": {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}},
        "a resource request must not exceed its limit",
    ),
    "standby over the limits": (
        {
            "engine": {"resources": {"limits": {"cpu": 2}}},
            "failover": {"standbyResources": {"requests": {"cpu": "2500m"}}},
        },
        "failover.standbyResources.requests must not exceed engine.resources.limits",
    ),
}
