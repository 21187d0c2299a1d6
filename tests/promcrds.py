"""The prometheus-operator CRDs (hack/monitoring/crds) and offline validation against them.

kubernetes-validate knows only built-in kinds; a ServiceMonitor, PodMonitor or
PrometheusRule is checked here against the openAPIV3Schema of its CRD, the
schema the apiserver itself applies. Strictly: an object schema that lists its
properties and neither preserves unknown fields nor declares
``additionalProperties`` rejects any other field. The apiserver would prune
such a field silently (a typo such as ``podMetricEndpoints`` becomes a monitor
with no endpoints), which is worse than a rejection.
"""

from __future__ import annotations

import copy
import functools
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "hack" / "monitoring" / "crds"
GROUP = "monitoring.coreos.com"


@functools.cache
def crd_dir() -> Path:
    """Where the pinned CRDs are (downloaded through the Go module proxy on first use)."""
    out = subprocess.run([str(SCRIPT)], capture_output=True, text=True, check=True, timeout=600)
    return Path(out.stdout.strip().splitlines()[-1])


def crd_path(plural: str) -> Path:
    return crd_dir() / f"{GROUP}_{plural}.yaml"


class _Loader(yaml.SafeLoader):
    """PyYAML reads a bare ``=`` (an enum value in these CRDs) as YAML 1.1's
    obsolete "value" type, which it cannot construct: it is the string "="."""


_Loader.add_constructor("tag:yaml.org,2002:value", yaml.SafeLoader.construct_yaml_str)


@functools.cache
def _crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, for every CRD of the group."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(crd_dir().glob(f"{GROUP}_*.yaml")):
        crd = yaml.load(path.read_text(), Loader=_Loader)  # _Loader is a SafeLoader
        kind = crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            if v.get("served"):
                schema = _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
                out[(f"{GROUP}/{v['name']}", kind)] = schema
    return out


def _strict(schema: Any) -> Any:
    """Close every object schema that lists properties (see the module docstring)."""
    if isinstance(schema, dict):
        for value in schema.values():
            _strict(value)
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for item in schema:
            _strict(item)
    return schema


def kinds() -> set[tuple[str, str]]:
    return set(_crds())


def validate(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError unless OBJ fits its CRD's schema."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    schema = _crds().get(key)
    if schema is None:
        raise LookupError(f"no CRD of {GROUP} serves {key}")
    # The schema says only "metadata: object"; the apiserver checks these two.
    meta = obj.get("metadata") or {}
    if not meta.get("name") or not isinstance(meta.get("labels", {}), dict):
        raise jsonschema.ValidationError(f"bad metadata: {meta}")
    jsonschema.Draft7Validator(schema).validate(obj)
