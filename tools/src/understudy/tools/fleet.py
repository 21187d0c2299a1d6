"""Several local pods behind the fleet gateway: ``understudy local up --pods N``.

Each pod is the one ``local`` runs (the rendered pod, supervised as kubelet
would, restarted with its back-off), in a directory of its own,
``DIR/pod-I``, with that pod's own ``local.json``; every process of a pod
has that directory in its command line (``marked``), so a test can kill a
whole pod as a node's loss would. The gateway (``understudy gateway``) serves ``--port`` and
reads the pods from ``DIR/pods.json`` (the local stand-in for the
EndpointSlices it watches in a cluster). ``DIR/local.json`` names the pods,
their directories and the gateway's pid.

Ports follow the options without overlapping: pod I serves on
``--port + 1 + I``, its engines' status ports start at ``--status-port + I
* engines``, its lock server, GMS and front status ports at
``--metrics-port + 3 * I``; the gateway's metrics port comes after the last
pod's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from understudy.tools.local import (
    STATE_FILE,
    LocalConfig,
    Supervisor,
    probe,
    run_until_signalled,
    wait_serving,
)
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.local")

PODS_FILE = "pods.json"
_GATEWAY_RESTART_S = 1.0


def pod_configs(cfg: LocalConfig, n: int) -> list[LocalConfig]:
    """The pods' own settings: ``cfg`` with each pod's directory and ports."""
    engines = cfg.shadows + 1
    return [
        replace(
            cfg,
            dir=cfg.dir / f"pod-{i}",
            serve_port=cfg.serve_port + 1 + i,
            status_port=cfg.status_port + i * engines,
            lock_metrics_port=cfg.lock_metrics_port + 3 * i,
            gms_metrics_port=cfg.gms_metrics_port + 3 * i,
            front_status_port=cfg.front_status_port + 3 * i,
        )
        for i in range(n)
    ]


def gateway_metrics_port(cfg: LocalConfig, n: int) -> int:
    return cfg.lock_metrics_port + 3 * n


def pod_address(c: LocalConfig) -> str:
    """A pod as the gateway's list names it (``front.pods.parse_pod``)."""
    return f"http://127.0.0.1:{c.serve_port}?status={c.front_status_port}&name={c.dir.name}"


def marked(argv: list[str], cfg: LocalConfig) -> list[str]:
    """``argv`` with its pod's directory in the command line of every python
    it starts (``-X``, which Python keeps and ignores), the respawned child's
    after ``--`` too: an engine's own options name no directory (its
    environment does), and a test kills a pod by its directory, as a node's
    loss would."""
    pythons = {sys.executable, cfg.engine_python or sys.executable}
    out: list[str] = []
    for arg in argv:
        out.append(arg)
        if arg in pythons:
            out += ["-X", f"understudy_pod={cfg.dir}"]
    return out


class Fleet:
    """N pods' supervisors and the gateway, in one process."""

    def __init__(self, cfg: LocalConfig, n: int) -> None:
        self.cfg = cfg
        self.configs = pod_configs(cfg, n)
        self.pods = [Supervisor(c) for c in self.configs]
        for sup in self.pods:
            for c in sup.containers:
                c.argv = marked(c.argv, sup.cfg)
        self.metrics_port = gateway_metrics_port(cfg, n)
        self.gateway: subprocess.Popen[bytes] | None = None
        self._gateway_exited: float | None = None

    def _start_gateway(self) -> None:
        logs = self.cfg.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "understudy.cli", "gateway",
            "--pods-file", str(self.cfg.dir / PODS_FILE),
            "--host", "127.0.0.1",
            "--port", str(self.cfg.serve_port),
            "--metrics-port", str(self.metrics_port),
            "--hold", str(self.cfg.hold_s),
            "--migration-limit", str(self.cfg.migration_limit),
        ]  # fmt: skip
        with open(logs / "gateway.log", "ab") as logf:
            self.gateway = subprocess.Popen(
                argv,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._gateway_exited = None
        log_event(log, "gateway_started", pid=self.gateway.pid, port=self.cfg.serve_port)

    def up(self) -> None:
        self.cfg.dir.mkdir(parents=True, exist_ok=True)
        pods = [pod_address(c) for c in self.configs]
        (self.cfg.dir / PODS_FILE).write_text(json.dumps(pods, indent=1) + "\n")
        self._start_gateway()
        self._save()
        for sup in self.pods:
            sup.up()
        self._save()

    def tick(self) -> None:
        for sup in self.pods:
            sup.tick()
        assert self.gateway is not None
        if self.gateway.poll() is None:
            return
        now = time.monotonic()
        if self._gateway_exited is None:
            self._gateway_exited = now
            log_event(log, "gateway_exited", logging.WARNING, code=self.gateway.returncode)
        elif now - self._gateway_exited >= _GATEWAY_RESTART_S:
            self._start_gateway()
            self._save()

    def run_forever(self) -> None:
        run_until_signalled(self)

    def down(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.terminate()
        for sup in self.pods:
            sup.down()
        if self.gateway is not None:
            try:
                self.gateway.wait(10)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait(5)
        with contextlib.suppress(FileNotFoundError):
            (self.cfg.dir / STATE_FILE).unlink()
        log_event(log, "fleet_stopped", dir=str(self.cfg.dir))

    def _save(self) -> None:
        state: dict[str, Any] = {
            "supervisor_pid": os.getpid(),
            "dir": str(self.cfg.dir),
            "serve_url": f"http://127.0.0.1:{self.cfg.serve_port}",
            "gateway": {
                "pid": self.gateway.pid if self.gateway else None,
                "metrics_url": f"http://127.0.0.1:{self.metrics_port}",
                "pods_file": str(self.cfg.dir / PODS_FILE),
            },
            "pods": {
                c.dir.name: {
                    "dir": str(c.dir),
                    "serve_url": f"http://127.0.0.1:{c.serve_port}",
                    "front_status_url": f"http://127.0.0.1:{c.front_status_port}",
                }
                for c in self.configs
            },
        }
        fd, tmp = tempfile.mkstemp(dir=self.cfg.dir, prefix=".local.")
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, self.cfg.dir / STATE_FILE)


def wait_fleet(cfg: LocalConfig, n: int, timeout: float) -> bool:
    """Until every pod is armed and the gateway has a pod to route to."""
    deadline = time.monotonic() + timeout
    for c in pod_configs(cfg, n):
        ports = [c.status_port + i for i in range(c.shadows + 1)]
        if not wait_serving(c.serve_port, ports, deadline - time.monotonic(), c.dir):
            return False
    port = gateway_metrics_port(cfg, n)
    while time.monotonic() < deadline:
        if probe(port, "/ready", 0.5):
            return True
        time.sleep(0.1)
    return False
