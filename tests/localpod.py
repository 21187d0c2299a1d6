"""A whole local pod (``understudy local up``) for process-level tests."""

from __future__ import annotations

import http.client
import json
import random
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from procs import Proc, understudy, wait_for


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int) -> int:
    for _ in range(200):
        # Below Linux's ephemeral range (32768-60999): a port chosen free there
        # can be taken by any outgoing connection before our process binds it.
        base = random.randrange(20000, 32000, 16)
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port block")


def http_json(port: int, path: str, body: Any = None, timeout: float = 3.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data.decode(errors="replace")


class LocalPod:
    def __init__(self, *extra: str, shadows: int = 1, engine: str = "reference") -> None:
        # /dev/shm: short Unix socket paths, and tmpfs like the pod's emptyDir
        self.dir = Path(tempfile.mkdtemp(prefix="us-", dir="/dev/shm"))
        base = free_port_block(16)
        self.serve_port = base
        self.status_port = base + 4
        self.front_port = base + 14  # --metrics-port + 2
        self.shadows = shadows
        self.proc = Proc(
            understudy(
                "local",
                "up",
                "--dir",
                str(self.dir),
                "--engine",
                engine,
                "--shadows",
                str(shadows),
                "--port",
                str(base),
                "--status-port",
                str(self.status_port),
                "--metrics-port",
                str(base + 12),
                "--reconnect-window",
                "2",
                "--remap-timeout",
                "10",
                *extra,
            ),
            log=self.dir / "supervisor.out",
        )

    @property
    def status_ports(self) -> list[int]:
        return [self.status_port + i for i in range(self.shadows + 1)]

    def engines(self) -> list[dict[str, Any]]:
        out = []
        for port in self.status_ports:
            try:
                out.append(http_json(port, "/state", timeout=1)[1])
            except OSError:
                out.append({"state": "Unreachable", "port": port})
        return out

    def by_state(self, state: str) -> list[dict[str, Any]]:
        return [e for e in self.engines() if e.get("state") == state]

    def armed(self) -> dict[str, Any] | None:
        """One Active engine, the others Standby, and the runner's startup probe
        passed on all of them (so its liveness probe is watching)."""
        try:
            containers = self.local_state()["containers"]
        except (OSError, ValueError):
            return None
        if not all(containers[n]["started"] for n in containers if n.startswith("engine-")):
            return None
        engines = self.engines()
        active = [e for e in engines if e.get("state") == "Active"]
        if len(active) == 1 and all(
            e.get("state") == "Standby" for e in engines if e is not active[0]
        ):
            return active[0]
        return None

    def wait_armed(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            return wait_for(self.armed, timeout, 0.05, what="pod armed (one Active, rest Standby)")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.diagnostics()}") from None

    def diagnostics(self) -> str:
        """What a failed wait needs: engine states and the tail of every log."""
        out = [f"engines: {self.engines()}"]
        for path in sorted([self.dir / "supervisor.out", *(self.dir / "logs").glob("*.log")]):
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-15:]
                out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def embed(self, text: str = "the same question, every time") -> str:
        status, body = http_json(
            self.serve_port, "/v1/embeddings", {"input": text, "encoding_format": "base64"}
        )
        assert status == 200, body
        return body["data"][0]["embedding"]

    def local_state(self) -> dict[str, Any]:
        return json.loads((self.dir / "local.json").read_text())

    def pid(self, container: str) -> int:
        return self.local_state()["containers"][container]["pid"]

    def process(self, container: str) -> int:
        """The process the container runs: under its respawner, the child (a
        death of it is restarted in place, the container's pid stays)."""
        from understudy.tools.drill_target import container_process

        return container_process(self.pid(container))

    def front_pid(self) -> int | None:
        """The front's own process (its container's is the respawner); None
        while no front answers its status port."""
        try:
            return int(http_json(self.front_port, "/state", timeout=2)[1]["pid"])
        except (OSError, ValueError, KeyError, http.client.HTTPException):
            return None

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the front's /metrics (0 when the series does not exist yet)."""
        status, text = http_json(self.front_port, "/metrics")
        assert status == 200
        want = name + (
            "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        )
        for line in str(text).splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def log(self, container: str) -> str:
        return (self.dir / "logs" / f"{container}.log").read_text(errors="replace")

    def close(self) -> None:
        # The supervisor's own stop (Supervisor.down) waits up to 5 s for the
        # containers' SIGTERM, then SIGKILLs what is left and waits for it: a
        # SIGKILL of the supervisor at 5 s (Proc.stop's default) raced that,
        # and left a draining engine container (its respawner and spare)
        # running with no pod.
        self.proc.stop(wait_s=20.0)
        shutil.rmtree(self.dir, ignore_errors=True)
