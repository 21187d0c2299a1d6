"""The GpuInstance CRD, generated from the pydantic models of ``api.py``.

pydantic's JSON Schema is turned into a Kubernetes *structural* schema:
``$ref`` inlined, ``Optional`` (``anyOf`` with null) collapsed to the type,
``int | str`` to ``x-kubernetes-int-or-string``, titles dropped, the CEL rules
declared in ``api.py`` kept as ``x-kubernetes-validations``. Optional nested
objects of the spec default to ``{}`` so the API server materialises their
defaults. ``understudy operator crd`` prints it; ``manifests/crd.yaml`` and the
chart's copy must equal it (tests/unit/operator/test_crd.py).

Core module: no I/O imports.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from understudy.operator import api

CRD_NAME = f"{api.PLURAL}.{api.GROUP}"

_KEEP_SCALAR = (
    "type",
    "description",
    "default",
    "enum",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "x-kubernetes-validations",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
)

# The scale subresource: `kubectl scale`, an HPA or KEDA read and write the
# replica count through /scale. The selector is the pods' instance label, so
# an HPA on resource metrics finds the replica pods.
SCALE: dict[str, str] = {
    "specReplicasPath": ".spec.replicas.desired",
    "statusReplicasPath": ".status.currentReplicas",
    "labelSelectorPath": ".status.selector",
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {
        "name": "Active",
        "type": "string",
        "jsonPath": ".status.active",
        "description": "Replicas with an Active engine / replicas",
    },
    {
        "name": "Replicas",
        "type": "integer",
        "jsonPath": ".status.currentReplicas",
        "description": "Replicas that exist and are not leaving",
    },
    {"name": "Failovers", "type": "integer", "jsonPath": ".status.failovers"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _overlay(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s keys on top of ``base``'s, with the CEL rules of both kept."""
    merged = {**base, **over}
    rules = [*base.get("x-kubernetes-validations", []), *over.get("x-kubernetes-validations", [])]
    if rules:
        merged["x-kubernetes-validations"] = rules
    return merged


def _structural(node: dict[str, Any], defs: dict[str, Any], *, in_spec: bool) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        outer = {k: v for k, v in node.items() if k != "$ref"}
        return _structural(_overlay(target, outer), defs, in_spec=in_spec)
    if "anyOf" in node:
        return _union(node, defs, in_spec=in_spec)
    out = _scalars(node)
    if node.get("type") == "object":
        out.update(_object(node, defs, in_spec=in_spec))
    if node.get("type") == "array" and "items" in node:
        out["items"] = _structural(node["items"], defs, in_spec=in_spec)
    return out


def _union(node: dict[str, Any], defs: dict[str, Any], *, in_spec: bool) -> dict[str, Any]:
    """``Optional[X]`` collapses to ``X``; ``int | str`` is int-or-string; nothing else fits."""
    options = [o for o in node["anyOf"] if o.get("type") != "null"]
    outer = {k: v for k, v in node.items() if k != "anyOf"}
    if outer.get("default", 0) is None:
        del outer["default"]
    types = sorted(o.get("type", "") for o in options)
    if types == ["integer", "string"]:
        # The string's own bounds (a quantity's pattern) apply to the string form.
        text = next(o for o in options if o.get("type") == "string")
        bounds = {k: v for k, v in _scalars(text).items() if k != "type"}
        return {**bounds, **_scalars(outer), "x-kubernetes-int-or-string": True}
    if len(options) != 1:
        raise ValueError(f"cannot express a union in a structural schema: {node}")
    return _structural(_overlay(options[0], outer), defs, in_spec=in_spec)


def _object(node: dict[str, Any], defs: dict[str, Any], *, in_spec: bool) -> dict[str, Any]:
    """An object's ``properties`` and ``additionalProperties``, each made structural."""
    out: dict[str, Any] = {}
    props = node.get("properties")
    if props is not None:
        required = set(node.get("required", []))
        out["properties"] = {
            name: _property(sub, defs, in_spec=in_spec, optional=name not in required)
            for name, sub in props.items()
        }
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = _structural(extra, defs, in_spec=in_spec)
    return out


def _property(
    sub: dict[str, Any], defs: dict[str, Any], *, in_spec: bool, optional: bool
) -> dict[str, Any]:
    """One property; an optional nested object of the spec defaults to ``{}``.

    The API server only applies the defaults inside an object that exists, so
    without ``default: {}`` an omitted section would never get its fields' defaults.
    A section whose model default is ``None`` (``gateway``) is opt-in: absent
    means off, so it gets no default.
    """
    child = _structural(sub, defs, in_spec=in_spec)
    if (
        in_spec
        and optional
        and sub.get("default", {}) is not None
        and child.get("type") == "object"
        and "properties" in child
        and "default" not in child
    ):
        child["default"] = {}
    return child


def _scalars(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: node[k] for k in _KEEP_SCALAR if k in node}
    if "x-kubernetes-validations" in out:
        # A copy per use: a model used twice (resources of the engine and of
        # GMS) would otherwise share its rules, which YAML prints as aliases.
        out["x-kubernetes-validations"] = [dict(r) for r in out["x-kubernetes-validations"]]
    if "required" in out:
        out["required"] = sorted(out["required"])
    return out


def _schema_of(model: type[BaseModel], *, in_spec: bool) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    top = {k: v for k, v in raw.items() if k != "$defs"}
    return _structural(top, defs, in_spec=in_spec)


def spec_schema() -> dict[str, Any]:
    return _schema_of(api.GpuInstanceSpec, in_spec=True)


def status_schema() -> dict[str, Any]:
    schema = _schema_of(api.GpuInstanceStatus, in_spec=False)
    props = schema["properties"]
    props["conditions"]["x-kubernetes-list-type"] = "map"
    props["conditions"]["x-kubernetes-list-map-keys"] = ["type"]
    props["replicas"]["x-kubernetes-list-type"] = "map"
    props["replicas"]["x-kubernetes-list-map-keys"] = ["index"]
    # Status is written only by the operator; required keys would make a partial
    # merge patch fail, so none are declared at the top.
    schema.pop("required", None)
    return schema


def generate_crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a plain dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {
                "app.kubernetes.io/name": "understudy",
                "app.kubernetes.io/component": "crd",
            },
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["understudy"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A model served by hot-standby engines on GPUs.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = "# Generated by `understudy operator crd` from operator/api.py. Do not edit.\n"


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(generate_crd(), sort_keys=False, width=100)
