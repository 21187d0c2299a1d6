"""The local runner runs the pod the operator renders (docs/pod.md).

Its processes are the rendered containers, in the same order, each command
read back by the components' own parsers equal to the rendered one with only
the pod's directory, ports and programs made local; the environment likewise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest
from commands import parse

from understudy.operator import render
from understudy.tools import local
from understudy.wire.engines import DEFAULT_MODELS, EngineAdapter
from understudy.wire.respawn import SPARE_IMPORTS

ROOT = Path(__file__).resolve().parents[2]
RUN = Path("/dev/shm/us-contract")
PORTS = {"serve_port": 18500, "status_port": 18504, "lock_metrics_port": 18512}
CONFIGS = {
    "default": local.LocalConfig(dir=RUN, **PORTS),
    "reference-two-shadows": local.LocalConfig(dir=RUN, engine="reference", shadows=2, **PORTS),
    "synthetic-no-shadow-two-devices": local.LocalConfig(
        dir=RUN, engine="synthetic", shadows=0, devices=(0, 1), **PORTS
    ),
    "vllm-own-python": local.LocalConfig(
        dir=RUN,
        engine="vllm",
        engine_python="/opt/vllm/bin/python",
        engine_args=("--max-num-seqs", "4"),
        model="/models/smollm2",
        hold_s=12,
        hang_after_s=1.5,
        migration_limit=2,
        reconnect_window_s=3,
        **PORTS,
    ),
}


def _local_ports(cfg: local.LocalConfig) -> dict[int, int]:
    """docs/pod.md's ports, and the local runner's options that stand for them."""
    return {
        8000: cfg.serve_port,
        9101: cfg.lock_metrics_port,
        9102: cfg.gms_metrics_port,
        8090: cfg.front_status_port,
        **{8100 + i: cfg.status_port + i for i in range(cfg.shadows + 1)},
    }


def _localized(value: Any, cfg: local.LocalConfig) -> Any:
    """A parsed value of the pod, as the local pod must have it."""
    ports = _local_ports(cfg)
    if isinstance(value, list):
        return [_localized(v, cfg) for v in value]
    if isinstance(value, int) and value in ports:
        return ports[value]
    if isinstance(value, str) and value.startswith("/run/understudy"):
        return str(cfg.dir) + value.removeprefix("/run/understudy")
    head, colon, port = str(value).rpartition(":")
    if isinstance(value, str) and colon and port.isdigit() and int(port) in ports:  # HOST:PORT
        return f"{head}:{ports[int(port)]}"
    return value


def _rendered(cfg: local.LocalConfig) -> list[dict[str, Any]]:
    spec = render.pod_spec(local.instance(cfg), render.RenderConfig())
    return [*spec["initContainers"], *spec["containers"]]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_local_processes_are_the_rendered_containers(name: str) -> None:
    cfg = CONFIGS[name]
    rendered = _rendered(cfg)
    ours = local.containers(cfg)
    assert [c.name for c in ours] == [c["name"] for c in rendered]
    for c, r in zip(ours, rendered, strict=True):
        want = [
            {k: _localized(v, cfg) for k, v in args.items()}
            for args in parse([*r["command"], *r["args"]])
        ]
        assert parse(c.argv) == want, c.name
        # The container's program, and its child's, run by a local python:
        # the engines' child by the engines' own.
        is_engine = c.name.startswith("engine-")
        child = c.argv[c.argv.index("--") + 1]
        assert c.argv[0] == sys.executable
        assert child == (cfg.engine_python or sys.executable if is_engine else sys.executable)
        port = _local_ports(cfg)[r["ports"][0]["containerPort"]]
        assert c.status_port == (port if is_engine else None)
        if is_engine:  # the runner probes the engines as the pod declares it
            for ours, theirs in ((c.startup, r["startupProbe"]), (c.liveness, r["livenessProbe"])):
                assert ours is not None
                assert (ours.port, ours.path) == (port, theirs["httpGet"]["path"])
                assert (ours.period_s, ours.timeout_s, ours.failures) == (
                    theirs["periodSeconds"],
                    theirs["timeoutSeconds"],
                    theirs["failureThreshold"],
                )
            assert c.liveness.grace_s == r["livenessProbe"]["terminationGracePeriodSeconds"]
        else:  # a sidecar: the runner checks its start itself
            assert c.startup is None and c.liveness is None


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_local_environment_is_the_rendered_one(name: str) -> None:
    cfg = CONFIGS[name]
    for c, r in zip(local.containers(cfg), _rendered(cfg), strict=True):
        env = dict(c.env)
        for e in r.get("env", []):
            if "value" in e:
                value = _localized(e["value"], cfg)
                if e["name"].endswith("_PORT"):
                    value = str(_local_ports(cfg)[int(e["value"])])
                assert env.pop(e["name"]) == value, (c.name, e["name"])
            else:  # the downward API: the local pod's name and namespace
                assert env.pop(e["name"]) == "local", (c.name, e["name"])
        # Beside it, only what makes the engines' python find this checkout,
        # and the spare's imports, which yield to the Active engine only where
        # a pod's processes share one autogroup (wire.respawn.SPARE_IMPORTS).
        if c.name.startswith("engine-"):
            assert env.pop(SPARE_IMPORTS) == "1"
        if cfg.engine_python and c.name.startswith("engine-"):
            assert env.pop("UNDERSTUDY_VLLM_PYTHON") == cfg.engine_python
            env.pop("PYTHONPATH", None)
        assert env == {}, c.name


def test_the_options_reach_the_pod() -> None:
    cfg = CONFIGS["vllm-own-python"]
    by_name = {c.name: c for c in local.containers(cfg)}
    front = parse(by_name[render.FRONT].argv)[1]
    assert (front["hold"], front["hang_after"], front["migration_limit"]) == (12, 1.5, 2)
    assert parse(by_name[render.LOCKSERVER].argv)[1]["reconnect_window"] == 3
    assert parse(by_name[render.GMS].argv)[1]["backend"] == "host"
    env = by_name[render.PRIMARY].env
    assert env["UNDERSTUDY_ENGINE_ADAPTER"] == "vllm"
    assert env["UNDERSTUDY_MODEL"] == "/models/smollm2"
    assert env["UNDERSTUDY_ENGINE_ARGS"] == '["--max-num-seqs", "4"]'
    default = local.containers(CONFIGS["default"])[-1].env
    assert default["UNDERSTUDY_MODEL"] == DEFAULT_MODELS[EngineAdapter.LLAMA]


def test_the_pod_refuses_what_a_gpuinstance_refuses() -> None:
    with pytest.raises(ValueError, match="holdSeconds"):
        local.instance(local.LocalConfig(hold_s=0.5))
    with pytest.raises(ValueError, match="devices"):
        local.instance(local.LocalConfig(devices=(1,)))


def test_the_local_runner_spells_no_command_line_flag() -> None:
    """Every flag comes from the rendered pod: none is written in the runner."""
    for path in ("tools/src/understudy/tools/local.py", "tools/src/understudy/tools/pod.py"):
        tree = ast.parse((ROOT / path).read_text())
        flags = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and n.value.startswith("--")
            and n.value[2:3].isalpha()
        ]
        assert flags == [], path
