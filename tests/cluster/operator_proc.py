"""The operator as a subprocess against the cluster (kopf, out of cluster), for one namespace."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def operator(
    cluster: Any, namespace: str, image: str, resync_s: float = 3, metrics_port: int = 0
) -> Iterator[Path]:
    """Run ``understudy operator run -n NAMESPACE``; yield its log file."""
    env = {**cluster.env, "UNDERSTUDY_OPERATOR_RESYNC_S": str(resync_s), "PYTHONUNBUFFERED": "1"}
    logs = cluster.cluster_dir / "logs" if cluster.ours else Path(tempfile.mkdtemp())
    path = logs / f"operator-{namespace}.log"
    with path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "understudy.operator.cli",
                "operator",
                "run",
                "--namespace",
                namespace,
                "--metrics-port",
                str(metrics_port),
                "--health-port",
                "0",
                "--image",
                image,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            yield path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
