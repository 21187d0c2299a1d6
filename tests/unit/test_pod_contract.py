"""The pod the operator renders and the local runner's processes agree
(docs/pod.md): same engine environment, same sidecar commands."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from understudy.operator import render
from understudy.operator.api import GpuInstance
from understudy.tools import local

SAMPLE = Path(__file__).resolve().parents[2] / "manifests/samples/gpuinstance-reference.yaml"


def _instance() -> GpuInstance:
    return GpuInstance.model_validate(yaml.safe_load(SAMPLE.read_text()))


def _local_config(inst: GpuInstance) -> local.LocalConfig:
    f = inst.spec.failover
    return local.LocalConfig(
        dir=Path("/run/understudy"),
        engine=inst.spec.engine.adapter.value,
        model=inst.spec.model.source,
        shadows=f.shadows,
        devices=tuple(range(inst.spec.gpus.count)),
        serve_port=inst.spec.serving_port,
        front_status_port=8090,
        hold_s=f.hold_seconds,
        hang_after_s=f.hang_after_seconds,
        migration_limit=f.migration_limit,
        reconnect_window_s=f.lock_reconnect_window_seconds,
        startup_budget_s=f.startup_budget_seconds,
        wake_timeout_s=f.wake_timeout_seconds,
        remap_timeout_s=f.remap_timeout_seconds,
    )


def _num(v: str) -> str:
    try:
        return f"{float(v):g}"
    except ValueError:
        return v


def test_engine_environment_is_the_same_in_pod_and_local_runner():
    inst = _instance()
    pod = render.render_pod(inst, 0, 1, None, render.RenderConfig())
    cfg = _local_config(inst)
    engines = [c for c in pod["spec"]["containers"] if c["name"].startswith("engine-")]
    assert len(engines) == 1 + inst.spec.failover.shadows
    for i, c in enumerate(engines):
        rendered = {e["name"]: _num(e["value"]) for e in c["env"] if "value" in e}
        role = "primary" if i == 0 else "shadow"
        ours = {k: _num(v) for k, v in local.engine_env(cfg, role, c["name"], i).items()}
        for downward in ("POD_NAME", "POD_NAMESPACE"):
            ours.pop(downward)
        assert rendered == ours, c["name"]


def test_sidecar_commands_are_the_same():
    inst = _instance()
    pod = render.render_pod(inst, 0, 1, None, render.RenderConfig())
    sidecars = {c["name"]: c for c in pod["spec"]["initContainers"]}
    for c in local.containers(_local_config(inst))[:3]:
        rendered = sidecars[c.name]
        argv = [*rendered.get("command", []), *rendered.get("args", [])]
        # Locally: [python, -m, understudy.cli, ...]; in the pod: [understudy, ...]
        # (and a command run under the respawner: this python, the pod's).
        ours = ["understudy", *c.argv[c.argv.index("understudy.cli") + 1 :]]
        ours = ["python" if a == sys.executable else a for a in ours]
        assert [_num(a) for a in argv] == [_num(a) for a in ours], c.name
