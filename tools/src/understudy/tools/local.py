"""The whole pod as local processes: ``understudy local up`` / ``down``.

The pod is the one the operator renders (docs/pod.md): ``instance`` makes a
GpuInstance of the options, ``render`` renders its pod, and ``tools.pod``
turns its containers into processes, with the pod's directory, ports and
programs made local (``places``). No container or command is spelled here.
The supervisor plays kubelet:

- sidecars first, each gated by its startup check (the lock server answers
  ``status``; every GMS socket answers; the front answers ``/live``), then
  the engines. The front owns the serving port; engines listen on Unix
  sockets in the directory, only while Active;
- a container that exits is restarted with kubelet's CrashLoopBackOff (at
  once, then 10 s doubling to 5 min between starts, forgotten after 10 min
  of running; ``--max-backoff`` lowers the cap as kubelet's
  ``maxContainerRestartPeriod`` does). An engine container runs, as in the
  pod, ``understudy respawn --spare -- … engine run``, which restarts a dead
  engine in place at once (docs/pod.md), so an engine's death is not a
  container exit; the restarted engine rejoins as the new standby by
  importing the committed weights;
- engine probes as the rendered pod declares them: ``/startup`` every two
  seconds until it passes, then ``/live`` every second, five failures in a
  row → SIGTERM, then SIGKILL after the liveness probe's
  ``terminationGracePeriodSeconds`` (one second) — that is how a hung
  (SIGSTOPped) engine gets replaced.

``local.json`` in the directory records the supervisor, every container's pid
and ports; ``understudy drill`` and ``local down`` read it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from understudy.gms.client import GmsError, query_state
from understudy.lockserver import client as lock_client
from understudy.operator import api, render
from understudy.operator.api import GpuInstance
from understudy.tools import backoff, checkout, pod
from understudy.wire.engines import DEFAULT_MODELS, EngineAdapter
from understudy.wire.obs import log_event
from understudy.wire.respawn import SPARE_IMPORTS

log = logging.getLogger("understudy.local")

DEFAULT_DIR = Path(os.environ.get("XDG_RUNTIME_DIR") or "/dev/shm") / "understudy-local"
STATE_FILE = "local.json"


@dataclass(frozen=True, slots=True)
class LocalConfig:
    dir: Path = DEFAULT_DIR
    engine: str = "llama"
    model: str = ""
    engine_args: tuple[str, ...] = ()
    # The python the engines run with ("": this one); a vllm engine needs the
    # vLLM venv's (tools.checkout).
    engine_python: str = ""
    shadows: int = 1
    devices: tuple[int, ...] = (0,)
    # GMS's memory: "host" (memfd; any machine) or "cuda" (CUDA VMM on the
    # claim's GPUs: the whole pod on a GPU machine; gpu_problem says why not).
    gms_backend: str = "host"
    serve_port: int = 8000
    status_port: int = 8100
    lock_metrics_port: int = 9101
    gms_metrics_port: int = 9102
    front_status_port: int = 9103
    hold_s: float = 30.0
    hang_after_s: float = 1.0
    migration_limit: int = 8
    reconnect_window_s: float = 10.0
    startup_budget_s: float = 600.0
    wake_timeout_s: float = 30.0
    remap_timeout_s: float = 30.0
    max_backoff_s: float = 300.0


@dataclass
class Container:
    name: str
    argv: list[str]
    env: dict[str, str]
    status_port: int | None = None  # engines only
    # An engine's probes, as the pod declares them (sidecars: None).
    startup: pod.HttpProbe | None = None
    liveness: pod.HttpProbe | None = None
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    exited_at: float | None = None
    last_exit: int | None = None
    startup_passed: bool = False
    live_failures: int = 0
    next_probe: float = 0.0
    kill_deadline: float | None = None
    log_path: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    backoff: backoff.Backoff = field(default_factory=backoff.Backoff)
    restart_at: float | None = None
    # Exits since the container last passed its startup check: a container
    # that keeps failing before it ever starts is reported, not waited out.
    failures: int = 0
    last_error: str | None = None


def instance(cfg: LocalConfig) -> GpuInstance:
    """The GpuInstance whose pod runs here (a ValueError names a setting it refuses)."""
    if cfg.devices != tuple(range(len(cfg.devices))):
        # Inside a pod the claim's devices are 0..N-1, and the pod is what runs here.
        raise ValueError(f"devices {cfg.devices}: a pod's devices are 0..N-1")
    adapter = EngineAdapter(cfg.engine)
    return GpuInstance.from_body(
        {
            "metadata": {"name": "local", "namespace": "local", "uid": "local"},
            "spec": {
                "model": {"source": cfg.model or DEFAULT_MODELS[adapter]},
                "engine": {"adapter": adapter.value, "args": list(cfg.engine_args)},
                "gpus": {"count": len(cfg.devices)},
                "gms": {"backend": cfg.gms_backend},
                "failover": {
                    "enabled": cfg.shadows > 0,
                    "shadows": max(1, cfg.shadows),
                    "holdSeconds": cfg.hold_s,
                    "hangAfterSeconds": cfg.hang_after_s,
                    "migrationLimit": cfg.migration_limit,
                    "lockReconnectWindowSeconds": cfg.reconnect_window_s,
                    "startupBudgetSeconds": cfg.startup_budget_s,
                    "wakeTimeoutSeconds": cfg.wake_timeout_s,
                    "remapTimeoutSeconds": cfg.remap_timeout_s,
                },
            },
        }
    )


def gpu_problem(devices: tuple[int, ...]) -> str | None:
    """Why GMS cannot run on CUDA on ``devices`` here (None: it can), asked of
    the driver in a child process, as the GMS container will ask it, so that
    this process never loads a driver."""
    code = (
        "import sys\n"
        "from understudy.gms.backends.cuda_vmm import CudaVmmBackend\n"
        "for d in sys.argv[1:]:\n"
        "    CudaVmmBackend(int(d))\n"
    )
    argv = [sys.executable, "-c", code, *map(str, devices)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return "no GPU found: the CUDA driver did not answer in 120 s"
    if out.returncode == 0:
        return None
    lines = out.stderr.strip().splitlines()
    last = lines[-1].rpartition("BackendUnavailable: ")[2] if lines else f"exit {out.returncode}"
    return f"no GPU found for --gms-backend cuda (devices {devices}): {last[:300]}"


def places(cfg: LocalConfig, inst: GpuInstance) -> pod.Places:
    """Where the pod of ``inst`` lives here: ``cfg``'s directory, ports and pythons."""
    engines = range(inst.spec.shadow_count + 1)
    return pod.Places(
        dir=cfg.dir,
        ports={
            inst.spec.serving_port: cfg.serve_port,
            api.LOCKSERVER_METRICS_PORT: cfg.lock_metrics_port,
            api.GMS_METRICS_PORT: cfg.gms_metrics_port,
            api.FRONT_STATUS_PORT: cfg.front_status_port,
            **{render.status_port(i): cfg.status_port + i for i in engines},
        },
        python=sys.executable,
        engine_python=cfg.engine_python or sys.executable,
        # The pod's processes share one autogroup here, so a spare's imports
        # at nice 10 yield to the Active engine (wire.respawn.SPARE_IMPORTS).
        engine_env={
            **(checkout.engine_env(cfg.engine_python) if cfg.engine_python else {}),
            SPARE_IMPORTS: "1",
        },
    )


def containers(cfg: LocalConfig) -> list[Container]:
    """The rendered pod's containers, to run here."""
    inst = instance(cfg)
    spec = render.pod_spec(inst, render.RenderConfig())
    return [
        Container(
            p.name,
            list(p.argv),
            dict(p.env),
            p.startup.port if p.startup else None,
            startup=p.startup,
            liveness=p.liveness,
        )
        for p in pod.processes(spec, places(cfg, inst))
    ]


def _http_get(port: int, path: str, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def probe(port: int, path: str, timeout: float = 1.0) -> bool:
    try:
        status, _ = _http_get(port, path, timeout)
    except (OSError, http.client.HTTPException):
        return False
    return status == 200


class Supervisor:
    def __init__(self, cfg: LocalConfig) -> None:
        self.cfg = cfg
        self.policy = backoff.Policy.capped(cfg.max_backoff_s)
        self.instance = instance(cfg)
        self.places = places(cfg, self.instance)
        self.containers = containers(cfg)
        self.stopping = False
        self.logs = cfg.dir / "logs"

    # ---------------------------------------------------------- processes --

    def _start(self, c: Container) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        c.log_path = self.logs / f"{c.name}.log"
        with open(c.log_path, "ab") as logf:
            c.proc = subprocess.Popen(
                c.argv,
                env={**os.environ, **c.env, "PYTHONUNBUFFERED": "1"},
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # A process group of its own (signalled whole), in the
                # supervisor's session: a session of its own would be an
                # autogroup of its own, and Linux shares the CPU equally
                # between autogroups, whatever the nice of their threads. A
                # restarting engine's start-up (at nice 10, docs/performance.md)
                # then took as much CPU as the Active engine that serves.
                process_group=0,
            )
        c.started_at = time.monotonic()
        c.backoff = backoff.started(c.backoff, c.started_at)
        c.restart_at = None
        c.exited_at = None
        c.startup_passed = c.startup is None
        c.live_failures = 0
        c.next_probe = c.started_at
        c.kill_deadline = None
        log_event(log, "container_started", container=c.name, pid=c.proc.pid, restarts=c.restarts)
        self._save()

    def _signal(self, c: Container, sig: int) -> None:
        if c.proc is not None and c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, sig)

    def _wait_startup(self, c: Container, timeout: float) -> None:
        """The sidecars' startup probes, which gate the next containers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if c.proc is not None and c.proc.poll() is not None:
                raise RuntimeError(
                    f"{c.name} exited with {c.proc.returncode} during startup: "
                    f"{last_error_line(c.log_path)} (log: {c.log_path})"
                )
            if self._started(c):
                return
            time.sleep(0.05)
        raise RuntimeError(f"{c.name} did not start within {timeout}s; see {c.log_path}")

    def _started(self, c: Container) -> bool:
        """The sidecar's startup probe, asked in-process: an exec probe's
        ``understudy`` start would cost every sidecar half a second."""
        if c.name == render.LOCKSERVER:
            try:
                lock_client.status(self._local(render.LOCK_SOCKET), timeout=0.5)
                return True
            except lock_client.LockError:
                return False
        if c.name == render.GMS:
            sockets = self._local(render.GMS_SOCKET_DIR)
            try:
                for d in self.cfg.devices:
                    query_state(sockets / f"gms_{d}_weights.sock", 0.5)
                return True
            except (GmsError, OSError):
                return False
        if c.name == render.FRONT:
            return probe(self.cfg.front_status_port, "/live")
        return True

    def _local(self, pod_path: str) -> Path:
        return Path(pod.local_value(pod_path, self.places))

    # ---------------------------------------------------------- the loop --

    def up(self) -> None:
        self.cfg.dir.mkdir(parents=True, exist_ok=True)
        for c in self.containers:
            self._start(c)
            if c.startup is None:  # a sidecar: the next container waits for it
                self._wait_startup(c, 30)
        log_event(
            log,
            "pod_started",
            serve=f"http://127.0.0.1:{self.cfg.serve_port}",
            dir=str(self.cfg.dir),
        )

    def tick(self) -> None:
        now = time.monotonic()
        for c in self.containers:
            assert c.proc is not None
            code = c.proc.poll()
            if code is not None:
                self._exited(c, code, now)
            elif c.kill_deadline is not None:
                if now >= c.kill_deadline:
                    self._signal(c, signal.SIGKILL)
            elif c.startup is not None and now >= c.next_probe:
                self._probe(c, c.startup, c.liveness, now)

    def _exited(self, c: Container, code: int, now: float) -> None:
        """A container whose process ended: recorded once, restarted after its back-off."""
        assert c.proc is not None
        if c.exited_at is None:
            # A container's end takes every process in it along, as
            # the container runtime does (its cgroup is torn down).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.exited_at, c.last_exit = now, code
            c.backoff, c.restart_at = backoff.exited(c.backoff, self.policy, now)
            if not c.startup_passed:
                c.failures += 1
            c.last_error = last_error_line(c.log_path)
            c.history.append({"exit": code, "at": time.time(), "pid": c.proc.pid})
            log_event(
                log,
                "container_exited",
                logging.WARNING,
                container=c.name,
                pid=c.proc.pid,
                code=code,
                restarts=c.restarts,
                restart_in_s=round(c.restart_at - now, 3),
                last_line=c.last_error,
            )
            self._save()
        assert c.restart_at is not None
        if now >= c.restart_at and not self.stopping:
            c.restarts += 1
            self._start(c)

    def _probe(
        self, c: Container, startup: pod.HttpProbe, liveness: pod.HttpProbe | None, now: float
    ) -> None:
        """kubelet's probes: startup until it passes, then liveness, whose
        failures end the container (SIGTERM, then SIGKILL after the grace).
        The startup probe's failures end nothing here: the engine ends itself
        at its startup budget, which the probe's threshold only mirrors."""
        assert c.proc is not None
        if not c.startup_passed:
            c.next_probe = now + startup.period_s
            c.startup_passed = probe(startup.port, startup.path, startup.timeout_s)
            if c.startup_passed:
                c.failures = 0
                self._save()  # the drill waits for it: liveness is watching now
            return
        if liveness is None:
            c.next_probe = math.inf
            return
        c.next_probe = now + liveness.period_s
        if probe(liveness.port, liveness.path, liveness.timeout_s):
            c.live_failures = 0
            return
        c.live_failures += 1
        if c.live_failures >= liveness.failures:
            log_event(
                log,
                "liveness_failed",
                logging.WARNING,
                container=c.name,
                pid=c.proc.pid,
                failures=c.live_failures,
            )
            self._signal(c, signal.SIGTERM)
            self._signal(c, signal.SIGCONT)  # a stopped process must see its SIGTERM
            c.kill_deadline = now + liveness.grace_s

    def run_forever(self) -> None:
        run_until_signalled(self)

    def down(self) -> None:
        self.stopping = True
        for c in reversed(self.containers):  # engines first, sidecars last
            self._signal(c, signal.SIGTERM)
            self._signal(c, signal.SIGCONT)
        deadline = time.monotonic() + 5
        for c in self.containers:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(c, signal.SIGKILL)
                c.proc.wait(5)
        with contextlib.suppress(FileNotFoundError):
            (self.cfg.dir / STATE_FILE).unlink()
        log_event(log, "pod_stopped", dir=str(self.cfg.dir))

    def _save(self) -> None:
        state = {
            "supervisor_pid": os.getpid(),
            "dir": str(self.cfg.dir),
            "serve_url": f"http://127.0.0.1:{self.cfg.serve_port}",
            "run_dir": str(self.cfg.dir),
            "front_status_url": f"http://127.0.0.1:{self.cfg.front_status_port}",
            "engine": self.cfg.engine,
            "model": self.instance.spec.model.source,
            "engine_args": list(self.cfg.engine_args),
            "engine_python": self.cfg.engine_python or sys.executable,
            "containers": {
                c.name: {
                    "pid": c.proc.pid if c.proc else None,
                    "running": c.exited_at is None,
                    "status_port": c.status_port,
                    "started": c.startup_passed and c.exited_at is None,
                    "restarts": c.restarts,
                    "last_exit": c.last_exit,
                    "failures": c.failures,
                    "last_error": c.last_error,
                    "back_off_s": (
                        round(max(0.0, c.restart_at - time.monotonic()), 3)
                        if c.restart_at is not None
                        else 0.0
                    ),
                    "log": str(c.log_path) if c.log_path else None,
                }
                for c in self.containers
            },
        }
        path = self.cfg.dir / STATE_FILE
        fd, tmp = tempfile.mkstemp(dir=self.cfg.dir, prefix=".local.")
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, path)


def read_state(directory: Path) -> dict[str, Any]:
    path = directory / STATE_FILE
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no local pod in {directory} ({path} missing)") from None
    return data


def last_error_line(path: Path | None) -> str | None:
    """The last line of a container's log that says something, for a one-line report."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    # The container's init (the respawner) logs its own restarts and exit
    # last; what the process itself said last is the line worth reporting.
    lines = [
        ln.strip() for ln in tail.splitlines() if ln.strip() and " understudy.respawn " not in ln
    ]
    return lines[-1][:400] if lines else None


class Supervised(Protocol):
    """What ``run_until_signalled`` drives: one pod's supervisor, or a fleet's."""

    def up(self) -> None: ...
    def tick(self) -> None: ...
    def down(self) -> None: ...


def run_until_signalled(what: Supervised) -> None:
    """Bring ``what`` up and tick it until SIGTERM or SIGINT, then bring it down."""
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        what.up()
        while not stop:
            what.tick()
            time.sleep(0.02)
    finally:
        what.down()


class KeepsFailing(RuntimeError):
    """A container exited again and again before it ever started."""


# Two exits before a container ever passed its startup check: kubelet would
# now be in CrashLoopBackOff, and waiting longer only hides the reason.
FAILING_AFTER = 2


def failing_containers(directory: Path) -> list[str]:
    """One line per container of a local pod that keeps failing, with its last error."""
    try:
        state = read_state(directory)
    except (FileNotFoundError, ValueError):
        return []
    return [
        f"{name} keeps failing ({c['failures']} exits, last code {c['last_exit']}): "
        f"{c.get('last_error') or 'no output'} (log: {c.get('log')})"
        for name, c in state["containers"].items()
        if c.get("failures", 0) >= FAILING_AFTER
    ]


def wait_serving(
    serve_port: int, status_ports: list[int], timeout: float, directory: Path | None = None
) -> bool:
    """Until one engine is Active and every other is Standby (the pod is armed).

    With ``directory``, raises KeepsFailing as soon as a container of that
    local pod keeps failing instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if directory is not None and (failing := failing_containers(directory)):
            raise KeepsFailing("; ".join(failing))
        states = []
        for port in status_ports:
            try:
                status, body = _http_get(port, "/state", 0.5)
                states.append(json.loads(body)["state"] if status == 200 else None)
            except (OSError, ValueError, http.client.HTTPException):
                states.append(None)
        if states.count("Active") == 1 and states.count("Standby") == len(states) - 1:
            return True
        time.sleep(0.1)
    return False
