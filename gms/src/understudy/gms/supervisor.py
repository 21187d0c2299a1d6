"""``understudy gms serve``: one server process per device, all in one container.

The supervisor starts ``python -m understudy.gms.cli server`` for every
device and then waits for the first child to exit (``wait -n``). Whatever the
reason, the others are stopped (SIGTERM, then SIGKILL after a grace period)
and the supervisor exits non-zero, so kubelet restarts the GMS container as a
whole: a GMS that lost one device's state must not keep serving the others.
SIGTERM and SIGINT are forwarded to the children; a shutdown asked for that
way exits 0 once they are gone. Once every device's server answers, the
supervisor tells its respawner it started (``respawn.notify_ready``), so a
later death of the GMS container's process is restarted at once. Children
ask the kernel for SIGTERM should the supervisor die (``PR_SET_PDEATHSIG``),
so none outlives it.

Metrics: children write to a shared ``PROMETHEUS_MULTIPROC_DIR`` and the
supervisor serves them on ``--metrics-port`` (see ``metrics``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import FrameType

from understudy.gms.config import SupervisorConfig, socket_path
from understudy.gms.messages import GmsError
from understudy.wire import respawn
from understudy.wire.obs import log_event
from understudy.wire.uds import prepare_socket_dir

log = logging.getLogger("understudy.gms.supervisor")


def child_command(config: SupervisorConfig, device: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "understudy.gms.cli",
        "server",
        "--socket",
        str(socket_path(config.socket_dir, device, config.tag)),
        "--device",
        str(device),
        "--tag",
        config.tag,
        "--backend",
        config.backend,
        "--parent-pid",
        str(os.getpid()),
        "--adopt-window",
        f"{config.adopt_window_s:g}",
    ]
    if config.granularity is not None:
        cmd += ["--granularity", str(config.granularity)]
    cmd += ["--lock-state", str(config.lock_state) if config.lock_state else "none"]
    return cmd


def _reap(children: dict[int, int], deadline: float) -> None:
    """Wait for ``children`` until ``deadline``, removing those that exit."""
    while children and time.monotonic() < deadline:
        pid, _status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.02)
        elif pid in children:
            del children[pid]


def _signal_all(children: dict[int, int], sig: int) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _start_children(
    config: SupervisorConfig, env: dict[str, str], children: dict[int, int]
) -> None:
    for device in config.devices:
        proc = subprocess.Popen(child_command(config, device), env=env)
        children[proc.pid] = device
        log_event(log, "child_started", device=device, pid=proc.pid)


def _all_answer(config: SupervisorConfig, children: dict[int, int], timeout: float = 60.0) -> bool:
    """Every device's server answers (False if a child died or time ran out:
    the wait for the first exit that follows says which)."""
    from understudy.gms.client import query_state

    deadline = time.monotonic() + timeout
    for device in config.devices:
        path = socket_path(config.socket_dir, device, config.tag)
        while True:
            try:
                query_state(path, 0.5)
                break
            except (GmsError, OSError):
                # A child that ended is only looked at (WNOWAIT): _first_exit reaps it.
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if ended is not None or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    return True


def _first_exit(children: dict[int, int], stopping: bool) -> int:
    """wait -n: the first child to exit ends the container; returns its code."""
    pid, status = os.waitpid(-1, 0)
    device = children.pop(pid, -1)
    code = os.waitstatus_to_exitcode(status)
    if stopping:
        log_event(log, "child_exited", device=device, pid=pid, code=code)
    else:
        log_event(log, "child_died", logging.ERROR, device=device, pid=pid, code=code)
    return code


def _stop_the_rest(children: dict[int, int], grace_s: float) -> None:
    """SIGTERM, then SIGKILL for those still there after ``grace_s``."""
    _signal_all(children, signal.SIGTERM)
    _reap(children, time.monotonic() + grace_s)
    if children:
        log_event(log, "child_kill", logging.WARNING, pids=",".join(map(str, children)))
        _signal_all(children, signal.SIGKILL)
        _reap(children, time.monotonic() + grace_s)


def run(config: SupervisorConfig) -> int:
    prepare_socket_dir(config.socket_dir)
    env = dict(os.environ)
    mp_dir: str | None = None
    if config.metrics_port is not None:
        mp_dir = tempfile.mkdtemp(prefix="understudy-gms-metrics-")
        env["PROMETHEUS_MULTIPROC_DIR"] = mp_dir
    children: dict[int, int] = {}  # pid -> device
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        log_event(log, "signal", signal=signal.Signals(signum).name, children=len(children))
        _signal_all(children, signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _start_children(config, env, children)
        if _all_answer(config, children):
            respawn.notify_ready()
        if mp_dir is not None and config.metrics_port is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = mp_dir
            from understudy.gms import metrics

            metrics.serve_multiprocess(config.metrics_port)
        code = _first_exit(children, stopping)
        _stop_the_rest(children, config.grace_s)
        if stopping:
            return 0
        return code if code > 0 else 1
    finally:
        _signal_all(children, signal.SIGKILL)
        for s, handler in old.items():
            signal.signal(s, handler)
        if mp_dir is not None:
            shutil.rmtree(mp_dir, ignore_errors=True)
