"""The drill against a cluster: the target is a GpuInstance's Service.

``understudy drill --kube NAMESPACE/NAME`` loads the instance's Service
(ClusterIP), reads every engine's ``/state`` at its pod IP and status port,
and kills the Active engine's process from the node (the drill runs as root
on the node hosting the pod: container processes are found in ``/proc`` by
their ``POD_NAME`` and ``UNDERSTUDY_ENGINE_NAME``, and the engine among them
by its pid in the pod, which its ``/state`` reports; a container's PID 1
cannot be SIGKILLed from inside its own PID namespace). An observer records, every
50 ms, whether each pod is a ready endpoint of the Service, the pods' Ready
condition and the containers' restart counts.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
from typing import Any

LABEL_INSTANCE = "understudy.dev/instance"


def _environ(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def in_pod(pid: str, uid: str) -> bool:
    """Whether node process ``pid`` runs in the pod whose uid is ``uid``: its
    cgroup path names the pod (kubelet's cgroupfs driver: ``…/pod<uid>/…``;
    systemd's: ``…-pod<uid, "-" as "_">.slice``). A pod's name, all its
    ``HOSTNAME`` says, can be another namespace's pod's too (CI once saw a
    drill's three GMS kills go unnoticed by every engine of the drilled
    pod, with the module before it having run a pod of the same name)."""
    with open(f"/proc/{pid}/cgroup") as f:
        text = f.read()
    return f"pod{uid}" in text or f"pod{uid.replace('-', '_')}" in text


def pod_processes(uid: str) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process of the pod ``uid``
    on this node."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if not in_pod(pid, uid):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            out[int(pid)] = (ppid, cmd)
    return out


def ns_pid(pid: str) -> int | None:
    """The pid of node process ``pid`` inside its innermost PID namespace (the
    pod's: what the engine reports as its own pid in ``/state``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return None


def host_pid(pod: str, namespace: str, container: str, pid_in_pod: int | None = None) -> int | None:
    """The node-level pid of the engine process of ``container`` in ``pod``:
    the one whose pid in the pod is ``pid_in_pod`` (the engine runs under its
    container's respawner, which carries the same environment), else the
    container's top process."""
    candidates: dict[int, int] = {}  # pid -> ppid
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            env = _environ(pid)
            if (
                env.get("POD_NAME") == pod
                and env.get("POD_NAMESPACE") == namespace
                and env.get("UNDERSTUDY_ENGINE_NAME") == container
            ):
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                candidates[int(pid)] = ppid
    if pid_in_pod is not None:
        for p in candidates:
            with contextlib.suppress(OSError):
                if ns_pid(str(p)) == pid_in_pod:
                    return p
    tops = [p for p, pp in candidates.items() if pp not in candidates]
    return tops[0] if len(tops) == 1 else None


class KubeTarget:
    def __init__(
        self,
        namespace: str,
        instance: str,
        kubeconfig: str | None = None,
        pod: str | None = None,
    ) -> None:
        from kubernetes import client, config

        config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api()
        self.discovery = client.DiscoveryV1Api()
        self.namespace, self.instance = namespace, instance
        svc: Any = self.core.read_namespaced_service(instance, namespace)
        port = svc.spec.ports[0].port
        self.service_port = port
        self.serve_url = f"http://{svc.spec.cluster_ip}:{port}"
        # Behind a gateway the instance's Service lists the gateway's pods; the
        # instance's own are the headless <name>-pods that the gateway watches.
        gateway = "understudy.dev/gateway" in (svc.spec.selector or {})
        self.endpoints_service = f"{instance}-pods" if gateway else instance
        self.only_pod = pod  # --kube-pod: drill this pod of several
        self.observer = Observer(self)

    def pods(self) -> list[Any]:
        listed: list[Any] = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{LABEL_INSTANCE}={self.instance}"
        ).items
        return [p for p in listed if self.only_pod in (None, p.metadata.name)]

    def engines(self) -> list[dict[str, Any]]:
        out = []
        for pod in self.pods():
            ip = pod.status.pod_ip
            for c in pod.spec.containers:
                ports = [
                    p.container_port
                    for p in (c.ports or [])
                    if p.name and p.name.startswith("status-")
                ]
                if not ports or not ip:
                    continue
                try:
                    conn = http.client.HTTPConnection(ip, ports[0], timeout=0.3)
                    asked_at = time.time()
                    conn.request("GET", "/state")
                    engine = json.loads(conn.getresponse().read())
                    conn.close()
                    engine["asked_at"] = asked_at  # figures.split_brain
                except (OSError, ValueError, http.client.HTTPException):
                    engine = {"name": c.name, "state": "Unreachable"}
                engine["pod"] = pod.metadata.name
                out.append(engine)
        return out

    def kill(self, engine: dict[str, Any], sig: int) -> None:
        pid = host_pid(engine["pod"], self.namespace, engine["name"], engine.get("pid"))
        if pid is None:
            raise RuntimeError(
                f"no unique process for {engine['pod']}/{engine['name']} on "
                "this node (the drill must run on the pod's node, as root)"
            )
        os.kill(pid, sig)

    def kill_container(self, pod: Any, container_cmd: str, sig: int) -> int:
        """Kill a sidecar's process in ``pod``, found by its command line: the
        one that runs it, the child of the container's respawner (whose
        command line names it too). A process of the sidecar's own (GMS's
        servers) never names it."""
        found = {
            pid: ppid
            for pid, (ppid, cmd) in pod_processes(pod.metadata.uid).items()
            if container_cmd in cmd
        }
        inner = [p for p, pp in found.items() if pp in found] or list(found)
        if len(inner) != 1:
            raise RuntimeError(
                f"{len(inner)} processes running {container_cmd!r} in pod "
                f"{pod.metadata.namespace}/{pod.metadata.name} on this node: {sorted(found)}"
            )
        os.kill(inner[0], sig)
        return inner[0]

    def kill_sidecar(self, which: str) -> list[int]:
        from understudy.tools.drill_sidecar import SIDECAR_COMMANDS

        return [
            self.kill_container(pod, SIDECAR_COMMANDS[which], signal.SIGKILL) for pod in self.pods()
        ]

    def _front_status_url(self, pod: Any) -> str | None:
        for c in pod.spec.init_containers or []:
            for p in c.ports or []:
                if p.name == "front-status" and pod.status.pod_ip:
                    return f"http://{pod.status.pod_ip}:{p.container_port}"
        return None

    def front_status_urls(self) -> list[str]:
        return [u for u in map(self._front_status_url, self.pods()) if u is not None]

    def kill_fronts(self) -> list[int]:
        """Each pod's serving front: the process whose pid in the pod is the one
        its ``/state`` reports (not the respawner above it, whose command line
        names the front's too, nor the spare beside it, which runs the same)."""
        from understudy.tools.drill_target import front_pid

        killed = []
        for pod in self.pods():
            url = self._front_status_url(pod)
            if url is None:
                raise RuntimeError(f"pod {pod.metadata.name} has no front status port")
            serving = front_pid(url)
            found = [
                pid
                for pid, (_, cmd) in pod_processes(pod.metadata.uid).items()
                if "understudy.front serve" in cmd
                and "respawn" not in cmd
                and ns_pid(str(pid)) == serving
            ]
            if len(found) != 1:
                raise RuntimeError(
                    f"{len(found)} front processes with pid {serving} in pod {pod.metadata.name}"
                )
            os.kill(found[0], signal.SIGKILL)
            killed.append(found[0])
        return killed

    def serving_listeners(self) -> set[int] | None:
        return None  # checked by the local drill, which sees the pod's sockets


class Observer(threading.Thread):
    """Endpoint membership, pod readiness and restarts, sampled every 50 ms."""

    def __init__(self, target: KubeTarget, period: float = 0.05) -> None:
        super().__init__(name="drill-observer", daemon=True)
        self.target = target
        self.period = period
        self.stop = threading.Event()
        self.samples = 0
        self.not_endpoint: dict[str, float] = {}  # pod -> seconds not a ready endpoint
        self.not_ready: dict[str, float] = {}
        self.ready_timeline: list[dict[str, Any]] = []
        self.restarts_start: dict[str, int] = {}
        self.restarts_end: dict[str, int] = {}
        self._last_ready: dict[str, bool] = {}

    def _restarts(self, pods: list[Any]) -> dict[str, int]:
        out = {}
        for pod in pods:
            for cs in (pod.status.container_statuses or []) + (
                pod.status.init_container_statuses or []
            ):
                out[f"{pod.metadata.name}/{cs.name}"] = cs.restart_count
        return out

    def run(self) -> None:
        t = self.target
        last = time.monotonic()
        first = True
        while not self.stop.is_set():
            try:
                pods = t.pods()
                slices: Any = t.discovery.list_namespaced_endpoint_slice(
                    t.namespace, label_selector=f"kubernetes.io/service-name={t.endpoints_service}"
                ).items
            except Exception:  # the API server blipped: count nothing this round
                time.sleep(self.period)
                continue
            now = time.monotonic()
            dt, last = now - last, now
            ready_ips = {
                addr
                for s in slices
                for e in (s.endpoints or [])
                if (e.conditions is None or e.conditions.ready is not False)
                for addr in e.addresses
            }
            if first:
                self.restarts_start = self._restarts(pods)
                first = False
            self.restarts_end = self._restarts(pods)
            self.samples += 1
            for pod in pods:
                name = pod.metadata.name
                ready = any(
                    c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or [])
                )
                if self._last_ready.get(name) != ready:
                    self.ready_timeline.append({"pod": name, "ready": ready, "at": time.time()})
                    self._last_ready[name] = ready
                if not ready:
                    self.not_ready[name] = self.not_ready.get(name, 0.0) + dt
                if pod.status.pod_ip not in ready_ips:
                    self.not_endpoint[name] = self.not_endpoint.get(name, 0.0) + dt
                else:
                    self.not_endpoint.setdefault(name, 0.0)
            time.sleep(self.period)

    def report(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "seconds_not_an_endpoint": self.not_endpoint,
            "left_endpoints": any(v > 0 for v in self.not_endpoint.values()),
            "seconds_pod_not_ready": self.not_ready,
            "pod_ready_timeline": self.ready_timeline,
            "restarts": {
                k: self.restarts_end.get(k, 0) - v for k, v in self.restarts_start.items()
            },
        }
