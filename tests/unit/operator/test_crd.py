"""The CRD is generated from api.py, equals its copies, and rejects invalid GpuInstances.

Rejection is tested against the CRD's *schema* (OpenAPI structural schema,
defaults applied as the API server does, then every CEL rule evaluated), not
only the pydantic model. The CEL evaluator here is the `common-expression-
language` package: a stopgap until tests/cluster/test_operator_crd.py runs the
same cases against a real kube-apiserver.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pydantic
import pytest
import yaml
from resource_cases import PATTERN, WRONG_RESOURCES

from understudy.operator import crd
from understudy.operator.api import GpuInstance
from understudy.operator.resources import quantity

cel = pytest.importorskip("cel", reason="common-expression-language (CEL stopgap) not installed")

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))


def test_generated_crd_equals_manifest_and_chart_copies() -> None:
    generated = crd.crd_yaml()
    assert (ROOT / "manifests" / "crd.yaml").read_text() == generated, (
        "manifests/crd.yaml is stale: understudy operator crd > manifests/crd.yaml"
    )
    chart_copy = ROOT / "charts" / "understudy" / "crds" / "gpuinstances.understudy.dev.yaml"
    assert chart_copy.read_text() == generated


@pytest.mark.parametrize("version", ["1.34.0", "1.35.0", "1.36.0", "1.37.0"])
def test_crd_is_a_valid_crd(version: str) -> None:
    kubernetes_validate.validate(crd.generate_crd(), version, strict=True)


def test_printer_columns() -> None:
    cols = crd.generate_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in cols] == ["Ready", "Phase", "Active", "Replicas", "Failovers", "Age"]


def test_scale_subresource_points_at_the_replica_count() -> None:
    version = crd.generate_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas.desired",
        "statusReplicasPath": ".status.currentReplicas",
        "labelSelectorPath": ".status.selector",
    }
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["currentReplicas"]["type"] == "integer"
    assert status["selector"]["type"] == "string"


# ----------------------------------------------------------- offline apiserver


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = crd.generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting, as the API server does it (outside in)."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _to_jsonschema(schema: Any) -> Any:
    if isinstance(schema, dict):
        if schema.get("x-kubernetes-int-or-string"):
            text = {k: v for k, v in schema.items() if k in ("pattern", "maxLength")}
            return {"anyOf": [{"type": "integer"}, {"type": "string", **text}]}
        out = {k: _to_jsonschema(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if schema.get("type") == "object" and "properties" in schema:
            out["additionalProperties"] = False  # pruning, made visible
        return out
    if isinstance(schema, list):
        return [_to_jsonschema(v) for v in schema]
    return schema


def _compare(a: float, b: float) -> int:
    return (a > b) - (a < b)


# Kubernetes' CEL quantity library, as far as the rules use it (a method call
# is a function of its receiver here). Values become floats: exact enough to
# order the quantities of these tests.
QUANTITY_LIB = {"quantity": lambda text: float(quantity(text)), "compareTo": _compare}


def _cel_errors(schema: dict[str, Any], value: Any, old: Any, path: str) -> list[str]:
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue  # transition rules run on update only
        variables = {"self": value}
        if transition:
            variables["oldSelf"] = old
        ctx = cel.Context(variables=variables, functions=QUANTITY_LIB)
        if cel.evaluate(rule["rule"], ctx) is not True:
            errors.append(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                prev = old.get(name) if isinstance(old, dict) else None
                errors += _cel_errors(sub, value[name], prev, f"{path}.{name}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, None, f"{path}[{i}]")
    return errors


def admit(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """What an API server would say: [] when admitted, else the messages."""
    schema = _schema()
    obj = apply_defaults(schema, copy.deepcopy(obj))
    old = apply_defaults(schema, copy.deepcopy(old)) if old is not None else None
    validator = jsonschema.Draft7Validator(_to_jsonschema(schema))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
    if errors:
        return errors
    return _cel_errors(schema, obj, old, "")


def _base(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "GpuInstance",
        "metadata": {"name": "x", "namespace": "default"},
        "spec": {"model": {"source": "builtin:all-MiniLM-L6-v2"}, **spec},
    }


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_are_admitted_and_parse(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert admit(doc) == []
    GpuInstance.from_body(doc)


def test_defaults_are_materialised() -> None:
    obj = apply_defaults(_schema(), _base())
    spec = obj["spec"]
    assert spec["gpus"] == {"count": 1, "deviceClassName": "gpu.understudy.dev", "exclusive": True}
    assert spec["failover"]["shadows"] == 1 and spec["failover"]["enabled"] is True
    assert spec["replicas"] == {"min": 1}
    assert spec["servingPort"] == 8000 and spec["gms"]["backend"] == "cuda"
    assert spec["autoscaling"]["enabled"] is False
    assert spec["rollout"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert spec["drain"] == {"timeoutSeconds": 30, "settleSeconds": 2, "gracePeriodSeconds": 30}
    # The API server's defaults agree with the model's.
    model = GpuInstance.from_body(obj)
    assert model.spec == GpuInstance.from_body(_base()).spec


INVALID = {
    "no model": ({"model": None}, "model"),
    "zero gpus": ({"gpus": {"count": 0}}, "minimum"),
    "bad adapter": ({"engine": {"adapter": "tgi"}}, "is not one of"),
    "bad backend": ({"gms": {"backend": "rocm"}}, "is not one of"),
    "bad strategy": ({"placement": {"strategy": "random"}}, "is not one of"),
    "unknown field": ({"gpus": {"cuont": 2}}, "Additional properties"),
    "indices count": ({"gpus": {"count": 2, "indices": [0]}}, "exactly gpus.count"),
    "indices repeat": ({"gpus": {"count": 2, "indices": [1, 1]}}, "must not repeat"),
    "max below min": ({"replicas": {"min": 3, "max": 2}}, "at least replicas.min"),
    "desired above min (fixed)": ({"replicas": {"min": 1, "desired": 2}}, "at most replicas.max"),
    "desired above max": ({"replicas": {"min": 1, "desired": 5, "max": 4}}, "at most replicas.max"),
    "port on status port": ({"servingPort": 8101}, "engine status port"),
    "port on metrics port": ({"servingPort": 9101}, "sidecar metrics port"),
    "indices with replicas": (
        {"gpus": {"count": 1, "indices": [0]}, "replicas": {"min": 2, "max": 2}},
        "single replica",
    ),
    "shadows zero": ({"failover": {"shadows": 0}}, "minimum"),
    "autoscaling without max": ({"autoscaling": {"enabled": True}}, "needs replicas.max"),
    "no surge, no unavailable": (
        {"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
        "cannot both be 0",
    ),
    "bad toleration operator": (
        {"placement": {"tolerations": [{"key": "k", "operator": "In"}]}},
        "is not one of",
    ),
    "gateway replicas zero": ({"gateway": {"replicas": 0}}, "minimum"),
    "gateway hold zero": ({"gateway": {"holdSeconds": 0}}, "minimum"),
    "gateway unknown field": ({"gateway": {"hold": 5}}, "Additional properties"),
    "gateway secret without key": ({"gateway": {"apiKeySecret": {"name": "k"}}}, "'key'"),
    "gateway secret bad name": (
        {"gateway": {"apiKeySecret": {"name": "Keys!", "key": "k"}}},
        "does not match",
    ),
    "gateway request above limit": (
        {"gateway": {"resources": {"requests": {"cpu": 2}, "limits": {"cpu": 1}}}},
        "must not exceed its limit",
    ),
    # jsonschema's word for a string that misses its pattern (as one form of int-or-string)
    **{k: (spec, "not valid" if m == PATTERN else m) for k, (spec, m) in WRONG_RESOURCES.items()},
}


@pytest.mark.parametrize("case", sorted(INVALID), ids=str)
def test_invalid_instances_are_rejected_by_schema_and_cel(case: str) -> None:
    change, expected = INVALID[case]
    obj = _base(**change)
    if change.get("model", 0) is None:
        del obj["spec"]["model"]
    errors = admit(obj)
    assert errors, f"{case} was admitted"
    assert any(expected in e for e in errors), errors


def test_the_gateway_is_opt_in_and_an_empty_section_takes_the_defaults() -> None:
    """Without ``gateway`` the API server adds none; ``gateway: {}`` gets every default."""
    assert "gateway" not in apply_defaults(_schema(), _base())["spec"]
    assert GpuInstance.from_body(_base()).spec.gateway is None
    obj = apply_defaults(_schema(), _base(gateway={}))
    assert obj["spec"]["gateway"] == {"replicas": 2, "resources": {}, "holdSeconds": 30}
    assert admit(_base(gateway={})) == []
    keyed = _base(gateway={"replicas": 3, "apiKeySecret": {"name": "keys", "key": "api-keys"}})
    assert admit(keyed) == []
    # The API server's defaults agree with the model's.
    assert GpuInstance.from_body(obj).spec == GpuInstance.from_body(_base(gateway={})).spec


def test_the_model_refuses_what_the_schema_refuses_with_the_field_named() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"gateway\.replicas"):
        GpuInstance.from_body(_base(gateway={"replicas": 0}))
    with pytest.raises(pydantic.ValidationError, match=r"gateway\.apiKeySecret\.key"):
        GpuInstance.from_body(_base(gateway={"apiKeySecret": {"name": "keys"}}))


def test_resources_within_limits_are_admitted() -> None:
    fits = {
        "engine": {
            "resources": {
                "requests": {"cpu": 1, "memory": "1Gi"},
                "limits": {"cpu": "1000m", "memory": "1Gi"},
            }
        },
        "failover": {"standbyResources": {"requests": {"cpu": "50m", "memory": "1024Mi"}}},
        "gms": {"resources": {"requests": {"memory": "64Mi"}, "limits": {"memory": "1e9"}}},
    }
    assert admit(_base(**fits)) == []
    # A standby may ask for what the limits do not bound.
    assert admit(_base(failover={"standbyResources": {"requests": {"cpu": 8}}})) == []


def test_valid_elastic_replicas_are_admitted() -> None:
    assert admit(_base(replicas={"min": 2, "desired": 3, "max": 4})) == []
    assert admit(_base(replicas={"min": 2, "desired": 1})) == []
    assert admit(_base(servingPort=8102, failover={"shadows": 1})) == []
    assert (
        admit(
            _base(
                replicas={"min": 1, "max": 4},
                autoscaling={"enabled": True, "targetPressure": 2},
                rollout={"maxSurge": 0, "maxUnavailable": 1},
            )
        )
        == []
    )


@pytest.mark.parametrize(
    ("field", "old", "new", "message"),
    [
        ("deviceClassName", "gpu.understudy.dev", "gpu.nvidia.com", "deviceClassName is immutable"),
        ("exclusive", True, False, "exclusive is immutable"),
    ],
)
def test_immutable_fields(field: str, old: Any, new: Any, message: str) -> None:
    before = _base(gpus={field: old})
    after = _base(gpus={field: new})
    assert admit(after, before) == [f".spec.gpus.{field}: gpus.{field} is immutable"]
    assert message in admit(after, before)[0]
    assert admit(before, before) == []
    # Mutable fields may change.
    assert admit(_base(gpus={"count": 2}), _base(gpus={"count": 1})) == []
