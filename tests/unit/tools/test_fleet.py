"""``local up --pods N``: each pod's directory and ports, and its mark on every process."""

from __future__ import annotations

import sys
from pathlib import Path

from understudy.tools.fleet import gateway_metrics_port, marked, pod_address, pod_configs
from understudy.tools.local import LocalConfig, places
from understudy.tools.local import instance as make_instance


def test_each_pod_has_its_own_directory_and_ports_none_shared() -> None:
    cfg = LocalConfig(
        dir=Path("/tmp/h9-f"),
        shadows=2,
        serve_port=18950,
        status_port=18960,
        lock_metrics_port=18970,
        gms_metrics_port=18971,
        front_status_port=18972,
    )
    pods = pod_configs(cfg, 3)
    assert [p.dir.name for p in pods] == ["pod-0", "pod-1", "pod-2"]
    ports = [cfg.serve_port, gateway_metrics_port(cfg, 3)]
    for p in pods:
        ports += list(places(p, make_instance(p)).ports.values())
    assert len(ports) == len(set(ports)) == 2 + 3 * (4 + 3)  # serve, lock, GMS, front; 3 engines
    assert pod_address(pods[1]) == "http://127.0.0.1:18952?status=18975&name=pod-1"


def test_every_python_of_a_pod_carries_its_directory() -> None:
    cfg = LocalConfig(dir=Path("/tmp/h9-f/pod-0"))
    py = sys.executable
    argv = [
        py,
        "-m",
        "understudy.cli",
        "respawn",
        "--",
        py,
        "-m",
        "understudy.cli",
        "engine",
        "run",
    ]
    mark = ["-X", "understudy_pod=/tmp/h9-f/pod-0"]
    assert marked(argv, cfg) == [py, *mark, *argv[1:5], py, *mark, *argv[6:]]
