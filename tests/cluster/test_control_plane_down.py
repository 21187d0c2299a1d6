"""The control plane is not on the data path (issue 30).

The reference sample's pod is Ready and armed, and clients send requests
through the Service's ClusterIP. The test stops kube-apiserver with SIGSTOP,
so every API call hangs as it would for a control plane that cannot be
reached; SIGCONT undoes it. While the API server is stopped, the test kills
three processes from the node, one after another:

1. the Active engine (SIGKILL);
2. the front's process;
3. GMS's process.

After each kill it waits for the pod to re-arm. It reads the pod itself for
this (each engine's ``/state`` at the pod IP, the front's status port) and
never asks the API. Then it lets the API server go on and checks that it
answers ``/readyz``.

The data path needs nothing from the control plane:

- the Service's rules stay in kube-proxy's nftables;
- the pod's processes are respawned inside their containers, so the kubelet
  restarts nothing;
- a failover happens inside the pod.

What is asserted:

- No request failed, the front's death included: the lock server keeps a
  copy of every client connection, and the next front finishes each one
  (issue 30; test_e2e's front test asserts the same).
- Every answer is the one taken before the API server stopped.
- Each kill's gap stays under a bound.
- No container restarted, and the GpuInstance is Ready again afterwards.

This runs only on hack/cluster's own cluster, as root on its node, because
the test stops that cluster's API server. A detached watchdog lets the API
server go on after ``CAP_S`` whatever becomes of the test. The stop must
also stay well under the controller manager's node-monitor grace period
(50 s): past it, the node would be marked unreachable when the API server
came back.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from understudy.tools import figures
from understudy.tools.drill_front import scrape
from understudy.tools.drill_kube import KubeTarget
from understudy.tools.drill_load import REQUEST, Client
from understudy.tools.drill_sidecar import SIDECAR_COMMANDS, settled_under_load
from understudy.tools.drill_watch import Watcher, wait
from understudy.tools.series import Sample

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this tier's helpers
import test_e2e
from test_e2e import Instance

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# The chart helm-installed with the operator in-cluster, and the reference
# sample applied in a namespace of this module's own (test_e2e's fixtures).
installed = test_e2e.installed
instance = test_e2e.instance

CLIENTS = 8
CAP_S = 90.0  # the watchdog lets the API server go on after this, whatever happens
REARM_S = 30.0  # each kill's wait for the pod to be armed again
PAUSE_S = 1.0  # steady answers after each re-arm, still without the API server
# Bounds on the gap, the longest stretch with no answer after a kill. They
# are those of test_e2e, measured on a loaded two-core node: an engine's
# SIGKILL fails over at once (0.5 s there); GMS's death costs a request
# (2 s). The front has no bound there. Its next front starts from an exec
# (the issue measured up to 4.7 s at load 4.5).
GAP_BOUND_S = {"engine": 0.5, "front": 5.0, "gms": 2.0, "api server back": 2.0}
LOST = "understudy_front_lost_requests_total"
# kept-alive connections idle at the front's death: a next request may have
# been on its way in on one, unread (drill_front)
IDLE_LOST = "understudy_front_lost_idle_connections_total"
RESTARTS = "understudy_front_restarts_total"


class PodAsSeen(KubeTarget):
    """The drill's cluster target, with the pods read once while the API
    server answered. The engines' ``/state``, the front's status port and
    the processes to kill are all found from that, with no further call."""

    def __init__(self, namespace: str, instance: str, kubeconfig: str) -> None:
        super().__init__(namespace, instance, kubeconfig)
        self.seen = super().pods()

    def pods(self) -> list[Any]:
        return self.seen


def _api_server_pid(cluster_dir: Path) -> int:
    """The pid of the cluster's kube-apiserver: the one whose command line
    names this cluster's state directory."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"/kube-apiserver") and str(cluster_dir).encode() in b" ".join(
                argv
            ):
                found.append(int(pid))
    assert len(found) == 1, f"kube-apiserver processes of {cluster_dir}: {found}"
    return found[0]


def _proc_state(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The API server stopped for the block. It is always continued on the
    way out, and by a detached watchdog after ``CAP_S`` if this process dies
    first."""
    watchdog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; time.sleep({CAP_S}); os.kill({pid}, {int(signal.SIGCONT)})",
        ],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
        watchdog.kill()
        watchdog.wait()


def _unreachable(inst: Instance) -> bool:
    """Whether the API server fails to answer a plain call within 2 s."""
    proc = inst.cluster.kubectl(
        "get", "--raw", "/readyz", "--request-timeout=2s", check=False, timeout=20
    )
    return bool(proc.returncode != 0)


def _digest(url: str) -> str:
    """The digest of the answer to the drill clients' request, as they take it."""
    return hashlib.sha256(base64.b64decode(test_e2e._embed(url, REQUEST["input"]))).hexdigest()


def _restarts(pod: dict[str, Any]) -> dict[str, int]:
    statuses = pod["status"]["containerStatuses"] + pod["status"]["initContainerStatuses"]
    return {s["name"]: s["restartCount"] for s in statuses}


def _kill_engine(target: PodAsSeen, watcher: Watcher) -> dict[str, Any]:
    """SIGKILL the Active engine. Wait for the next one to take over, and for
    the killed container to serve as a Standby again (its respawner's work)."""
    before = watcher.until(figures.whole, REARM_S)
    assert before is not None, watcher.snapshot()
    t = time.monotonic()
    target.kill(before, signal.SIGKILL)
    took = watcher.until(lambda e: figures.successor(e, before.get("epoch") or 0), REARM_S)
    back = watcher.until(
        lambda e: figures.rearmed(e, before["name"], before["engine_id"]) and figures.whole(e),
        REARM_S,
    )
    return {
        "what": "engine",
        "t": t,
        "killed": before["name"],
        "took_over": took and took["name"],
        "back": bool(back),
        "rearm_s": figures.rearm_s(watcher.standby_seen, before["name"], before["engine_id"], t),
    }


def _front_metrics(target: PodAsSeen) -> dict[str, float]:
    [url] = target.front_status_urls()
    found = wait(lambda: scrape(url), REARM_S)
    assert found is not None and LOST in found and RESTARTS in found, found
    return dict(found)


def _kill_front(target: PodAsSeen, watcher: Watcher, pool: list[Client]) -> dict[str, Any]:
    """SIGKILL the front's process (not its respawner, nor the spare beside
    it). Wait for the next front to take over, and for answers to flow again.
    The next front reports the requests the dying one held."""
    assert watcher.until(figures.whole, REARM_S) is not None, watcher.snapshot()
    was = _front_metrics(target)
    t = time.monotonic()
    pids = target.kill_fronts()
    [url] = target.front_status_urls()

    def took_over() -> dict[str, float] | None:
        m = scrape(url)
        return m if m is not None and m.get(RESTARTS, 0.0) > was[RESTARTS] else None

    now: dict[str, float] | None = wait(took_over, REARM_S)
    answered = wait(lambda: any(s.ok and s.start >= t for c in pool for s in c.samples), REARM_S)
    back = watcher.until(figures.whole, REARM_S)
    return {
        "what": "front",
        "t": t,
        "killed": pids,
        "back": bool(now) and bool(answered) and back is not None,
        "in_flight": (now[LOST] - was[LOST]) if now else None,
        "idle": (now.get(IDLE_LOST, 0.0) - was.get(IDLE_LOST, 0.0)) if now else None,
    }


def _kill_gms(target: PodAsSeen, watcher: Watcher) -> dict[str, Any]:
    """SIGKILL GMS's process. Its respawner starts it again, the Active
    engine serves on from its mappings and gives them back (re-adoption);
    wait for that and for the pod to be whole again."""
    active = watcher.until(figures.whole, REARM_S)
    assert active is not None, watcher.snapshot()
    engines = watcher.snapshot()
    t = time.monotonic()
    pid = target.kill_container(target.seen[0], SIDECAR_COMMANDS["gms"], signal.SIGKILL)
    readopted = watcher.until(
        lambda e: figures.engine_changes(engines, e).readoptions >= 1, REARM_S
    )
    after = watcher.until(figures.whole, REARM_S)
    changes = figures.engine_changes(engines, watcher.snapshot())
    return {
        "what": "gms",
        "t": t,
        "killed": pid,
        "back": bool(readopted) and after is not None,
        "same_active": after is not None and after.get("engine_id") == active.get("engine_id"),
        "engine_restarts": changes.restarts,
        "readoptions": changes.readoptions,
    }


def _judge(steps: list[dict[str, Any]], samples: list[Sample], t_end: float) -> None:
    """Each step's failures, refusals and gap: the requests that ended from
    its event up to the next one."""
    times = [s["t"] for s in steps]
    for step, t_next in zip(steps, [*times[1:], t_end], strict=True):
        mine = [s for s in samples if step["t"] <= s.end < t_next]
        failed = [s for s in mine if not s.ok]
        step["requests"] = len(mine)
        step["failed"] = len(failed)
        step["refused"] = sum(1 for s in failed if s.error == "ConnectionRefusedError")
        step["errors"] = sorted({s.error for s in failed})
        step["gap_s"] = figures.longest_gap(
            [s for s in samples if s.end < t_next] or samples, step["t"]
        )


def _drill(instance: Instance, target: PodAsSeen, api: int) -> dict[str, Any]:
    """Clients through the Service; the API server stopped; the engine, the
    front and GMS killed in turn; the API server let go. What happened."""
    load_before = os.getloadavg()
    steps: list[dict[str, Any]] = []
    with settled_under_load(target, CLIENTS, REARM_S) as (watcher, pool):
        time.sleep(1.0)  # steady answers before anything stops
        t_stop = time.monotonic()
        with _stopped(api):
            unreachable = _unreachable(instance)
            steps.append(_kill_engine(target, watcher))
            time.sleep(PAUSE_S)
            steps.append(_kill_front(target, watcher, pool))
            time.sleep(PAUSE_S)
            steps.append(_kill_gms(target, watcher))
            time.sleep(PAUSE_S)
            stopped_throughout = _proc_state(api) == "T"
            t_cont = time.monotonic()
        steps.append({"what": "api server back", "t": t_cont, "back": True})
        ready = wait(instance.cluster.ready, 60)
        time.sleep(2.0)  # the API server's return, under load
        t_end = time.monotonic()
        split_brain = len(watcher.split_brain)
    samples = [s for c in pool for s in c.samples]
    _judge(steps, samples, t_end)
    return {
        "unreachable_while_stopped": unreachable,
        "stopped_throughout": stopped_throughout,
        "ready_again": bool(ready),
        "stopped_s": round(t_cont - t_stop, 2),
        "requests": len(samples),
        "answered_while_stopped": sum(1 for s in samples if s.ok and t_stop <= s.end < t_cont),
        "failed": sum(1 for s in samples if not s.ok),
        "failed_before_first_kill": sum(1 for s in samples if not s.ok and s.end < steps[0]["t"]),
        "split_brain": split_brain,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "steps": steps,
        "samples": samples,
    }


@pytest.mark.timeout(1200)
def test_api_server_stopped_engine_front_and_gms_killed_nothing_fails(instance: Instance) -> None:
    cluster = instance.cluster
    if not cluster.ours or os.geteuid() != 0:
        pytest.skip("stops hack/cluster's own API server: runs as root on its node")
    instance.wait_ready()
    url = instance.url()
    # The one right answer, taken while nothing is being killed: the drill's
    # clients send this request, and the reference engine's embedding is
    # deterministic.
    right = _digest(url)
    restarts_before = _restarts(instance.pod())
    target = PodAsSeen(instance.ns, instance.name, str(cluster.kubeconfig))
    assert len(target.seen) == 1

    report = _drill(instance, target, _api_server_pid(cluster.cluster_dir))
    samples: list[Sample] = report.pop("samples")
    report["wrong"] = sum(1 for s in samples if s.ok and s.digest != right)
    for step in report["steps"]:
        step.pop("t")
    out = test_e2e.REPORTS / f"control-plane-down-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    sys.stderr.write(json.dumps(report, indent=1, default=str) + "\n")

    assert report["unreachable_while_stopped"], "the API server still answered while stopped"
    assert report["stopped_throughout"], "the API server was continued before the test let it go"
    assert report["ready_again"], "the API server did not answer /readyz within 60 s of SIGCONT"
    assert report["stopped_s"] < 45.0, report  # under the node-monitor grace period
    assert all(s["back"] for s in report["steps"]), report
    assert all(s["requests"] > 0 for s in report["steps"]), report
    assert report["failed_before_first_kill"] == 0, report
    assert report["wrong"] == 0 and report["split_brain"] == 0, report
    engine, front, gms, back = report["steps"]
    assert engine["took_over"] and engine["took_over"] != engine["killed"], engine
    assert gms["same_active"] and gms["engine_restarts"] == 0, gms
    for step in (engine, front, gms, back):
        assert step["failed"] == 0, step
    # The front's death loses nothing: the lock server keeps the serving
    # socket and a copy of every client connection, which the next front
    # finishes (issue 30).
    assert front["refused"] == 0 and front["failed"] == 0, front
    for step in report["steps"]:
        assert step["gap_s"] is not None and step["gap_s"] < GAP_BOUND_S[step["what"]], step
    # Respawned in place: kubelet restarted no container; and with the API
    # server back the instance is Ready, answering as before.
    assert _restarts(instance.pod()) == restarts_before
    instance.wait_ready(120)
    assert _digest(url) == right
