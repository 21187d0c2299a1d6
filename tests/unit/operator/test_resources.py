"""Resources per role: the Active engine's requests, a standby's, one set of limits."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from understudy.operator import render, resources
from understudy.operator.api import EngineAdapter, GpuInstance
from understudy.operator.observe import pod_view

CFG = render.RenderConfig()


def make(**spec: Any) -> GpuInstance:
    return GpuInstance.from_body(
        {
            "metadata": {"name": "x", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"source": "builtin:tiny-llama"}, **spec},
        }
    )


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", Fraction(1)),
        (2, Fraction(2)),
        ("500m", Fraction(1, 2)),
        ("1Gi", Fraction(2**30)),
        ("1.5Gi", Fraction(3 * 2**29)),
        ("1e3", Fraction(1000)),
        ("2E", Fraction(2 * 10**18)),
        ("128974848", Fraction(128974848)),
        ("129e6", Fraction(129 * 10**6)),
        ("100u", Fraction(1, 10**4)),
    ],
)
def test_quantities_are_read_by_value(text: int | str, value: Fraction) -> None:
    assert resources.quantity(text) == value


@pytest.mark.parametrize("text", ["", "1 core", "Gi", "1Gb", "1.2.3"])
def test_a_wrong_quantity_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        resources.quantity(text)


@given(st.integers(0, 2**40), st.sampled_from(["", "Ki", "Mi", "Gi", "k", "M", "m"]))
def test_the_canonical_forms_of_one_value_are_satisfied(n: int, suffix: str) -> None:
    """The API server prints ``1024Mi`` as ``1Gi``: the same request, no resize."""
    value = resources.quantity(f"{n}{suffix}")
    plain = str(value.numerator) if value.denominator == 1 else f"{n}{suffix}"
    assert resources.satisfied({"memory": plain}, {"memory": f"{n}{suffix}"})


def test_satisfied_checks_only_the_requests_it_is_given() -> None:
    have = {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}
    assert resources.satisfied(have, {"cpu": "1000m", "memory": "1024Mi"})
    assert not resources.satisfied(have, {"cpu": "50m"})
    assert not resources.satisfied({"cpu": "1"}, {"memory": "1Gi"})
    assert not resources.satisfied({"cpu": "bogus"}, {"cpu": "1"})


@pytest.mark.parametrize("adapter", list(EngineAdapter))
def test_every_adapter_has_standby_defaults(adapter: EngineAdapter) -> None:
    """A measured one (docs/sizing.md), or the largest for one not measured yet."""
    defaults = resources.standby_defaults(adapter)
    assert set(defaults) == {"memory"}
    inst = make(engine={"adapter": adapter.value, "resources": {"requests": {"memory": "8Gi"}}})
    # The CPU request is the Active's: its weight when it serves (resources.py).
    cpu = resources.ACTIVE_DEFAULTS["cpu"]
    assert resources.standby_requests(inst.spec) == {"cpu": cpu, **defaults}


def test_the_active_gets_engine_resources_and_a_standby_the_adapter_default() -> None:
    inst = make(
        engine={
            "adapter": "vllm",
            "resources": {"requests": {"cpu": 4, "memory": "32Gi"}, "limits": {"memory": "48Gi"}},
        }
    )
    active = resources.for_role(inst.spec, active=True)
    standby = resources.for_role(inst.spec, active=False)
    assert active.requests == {"cpu": "4", "memory": "32Gi"}
    assert standby.requests == {"cpu": "4", **resources.standby_defaults(EngineAdapter.VLLM)}
    # One set of limits: any engine can serve the moment it takes the lock.
    assert active.limits == standby.limits == {"memory": "48Gi"}


def test_standby_resources_override_the_default_per_resource() -> None:
    inst = make(
        engine={"adapter": "llama", "resources": {"requests": {"cpu": 1, "memory": "2Gi"}}},
        failover={"standbyResources": {"requests": {"memory": "700Mi"}}},
    )
    assert resources.standby_requests(inst.spec) == {"cpu": "1", "memory": "700Mi"}


def test_a_default_never_exceeds_the_active_requests_nor_the_limits() -> None:
    small = make(engine={"adapter": "vllm", "resources": {"requests": {"memory": "1Gi"}}})
    assert resources.standby_requests(small.spec)["memory"] == "1Gi"
    capped = make(engine={"resources": {"limits": {"cpu": "20m", "memory": "128Mi"}}})
    assert resources.active_requests(capped.spec) == {"cpu": "20m", "memory": "128Mi"}
    assert resources.standby_requests(capped.spec) == {"cpu": "20m", "memory": "128Mi"}
    bare = make()  # nothing given: the Active defaults, a standby below them
    assert resources.active_requests(bare.spec) == dict(resources.ACTIVE_DEFAULTS)


@pytest.mark.parametrize("shadows", [1, 2, 4])
def test_the_primary_is_rendered_active_and_the_shadows_standbys(shadows: int) -> None:
    inst = make(
        engine={"resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": 2}}},
        failover={"shadows": shadows, "standbyResources": {"requests": {"cpu": "25m"}}},
    )
    pod = render.render_pod(inst, 0, 1, None, CFG)
    engines = pod["spec"]["containers"]
    assert len(engines) == shadows + 1
    assert engines[0]["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}
    for c in engines[1:]:
        assert c["resources"]["requests"] == {"cpu": "25m", "memory": "192Mi"}
    for c in engines:
        assert c["resources"]["limits"] == {"cpu": 2}
        assert c["resources"]["claims"] == [{"name": render.CLAIM_NAME}]
    # What the observer reads back is what the render wrote.
    view = pod_view(pod)
    assert view.requests[render.PRIMARY] == {"cpu": "1", "memory": "1Gi"}
    assert view.requests[render.shadow_name(1)] == {"cpu": "25m", "memory": "192Mi"}


# ---------------------------------------------------------------- samples

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
SMALLEST = re.compile(r"^# Smallest node: (\d+) CPUs?, (\d+) GiB allocatable", re.MULTILINE)


def _pod_requests(pod: dict[str, Any], resource: str) -> Fraction:
    """What kube-scheduler reserves for the pod: its containers and its sidecars."""
    spec = pod["spec"]
    return sum(
        (
            resources.quantity(c["resources"]["requests"].get(resource, 0))
            for c in [*spec["containers"], *spec["initContainers"]]
        ),
        Fraction(0),
    )


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_sample_renders_valid_objects_that_fit_the_node_its_comment_names(
    path: Path,
) -> None:
    """The CUDA sample cannot run here: rendering and validation are its check."""
    text = path.read_text()
    inst = GpuInstance.from_body(yaml.safe_load(text))
    for obj in render.render_all(inst, CFG):
        kubernetes_validate.validate(obj, "1.36.0", strict=True)
    m = SMALLEST.search(text)
    assert m is not None, f"{path.name} does not say the smallest node it fits"
    pod = render.render_pod(inst, 0, 1, None, CFG)
    assert _pod_requests(pod, "cpu") <= int(m.group(1))
    assert _pod_requests(pod, "memory") <= int(m.group(2)) * 2**30
