"""A GpuInstance as the API server hands it to the operator, for the
operator's unit tests: one namespace, uid and generation, the host GMS."""

from __future__ import annotations

from typing import Any

from understudy.operator.api import GpuInstance


def make(source: str = "builtin:all-MiniLM-L6-v2", /, **spec: Any) -> GpuInstance:
    body = {
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "GpuInstance",
        "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {"model": {"source": source}, "gms": {"backend": "host"}, **spec},
    }
    return GpuInstance.from_body(body)
