"""The pod a drill kills, and how its processes are found.

``Target`` is what every drill asks of a pod: its engines' ``/state``, a way to
kill an engine or a sidecar, and which processes listen on the engines'
serving socket. ``LocalTarget`` is a pod started by ``understudy local up``
(``drill_kube.KubeTarget`` is one in a cluster). ``FleetTarget`` is the pods
and gateway of ``understudy local up --pods N``: the gateway's ``/state``, each
pod as a ``LocalTarget``, and every process of a pod (``pod_processes``) to
kill or freeze whole. The rest reads ``/proc``: a container's own process
behind its respawner, and the listeners of a socket directory.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import time
import urllib.parse
from pathlib import Path
from typing import Any, Protocol


class Target(Protocol):
    serve_url: str

    def engines(self) -> list[dict[str, Any]]: ...

    def kill(self, engine: dict[str, Any], sig: int) -> None: ...

    def kill_sidecar(self, which: str) -> list[int]:
        """SIGKILL the sidecar's process in every pod; the pids killed."""
        ...

    def serving_listeners(self) -> set[int] | None:
        """Pids listening on an engine serving socket (None: cannot tell)."""
        ...


class LocalTarget:
    """A pod started by ``understudy local up`` (reads its local.json)."""

    def __init__(self, directory: Path) -> None:
        from understudy.tools.local import read_state

        self.directory = directory
        state = read_state(directory)
        self.serve_url = state["serve_url"]
        self.run_dir = Path(state.get("run_dir", directory))
        self.status_ports = {
            name: c["status_port"]
            for name, c in state["containers"].items()
            if c["status_port"] is not None
        }

    def engines(self) -> list[dict[str, Any]]:
        from understudy.tools.local import read_state

        started: dict[str, bool] = {}
        with contextlib.suppress(OSError, ValueError):
            started = {
                n: c.get("started", True)
                for n, c in read_state(self.directory)["containers"].items()
            }
        out = []
        for name, port in self.status_ports.items():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=0.3)
                asked_at = time.time()
                conn.request("GET", "/state")
                body = conn.getresponse().read()
                conn.close()
                engine = json.loads(body)
                engine["asked_at"] = asked_at  # figures.split_brain
            except (OSError, ValueError, http.client.HTTPException):
                engine = {"name": name, "state": "Unreachable"}
            # the runner's startup probe passed: its liveness probe is watching
            engine["started"] = started.get(name, True)
            out.append(engine)
        return out

    def kill(self, engine: dict[str, Any], sig: int) -> None:
        os.kill(engine["pid"], sig)

    def kill_sidecar(self, which: str) -> list[int]:
        from understudy.tools.local import read_state

        pid = container_process(read_state(self.directory)["containers"][which]["pid"])
        os.kill(pid, signal.SIGKILL)
        return [pid]

    def front_status_urls(self) -> list[str]:
        from understudy.tools.local import read_state

        return [read_state(self.directory)["front_status_url"]]

    def kill_fronts(self) -> list[int]:
        """The front's own process: its container's process is the respawner."""
        pid = front_pid(self.front_status_urls()[0])
        os.kill(pid, signal.SIGKILL)
        return [pid]

    def serving_listeners(self) -> set[int] | None:
        return unix_listeners(self.run_dir / "serve")


class FleetTarget:
    """Pods behind the fleet gateway, started by ``understudy local up --pods N``
    (reads its local.json: the gateway and each pod's directory)."""

    def __init__(self, directory: Path) -> None:
        from understudy.tools.local import read_state

        state = read_state(directory)
        if "pods" not in state:
            raise ValueError(f"{directory} is one pod, not a fleet (understudy local up --pods N)")
        self.directory = directory
        self.serve_url = state["serve_url"]
        self.gateway_url = state["gateway"]["metrics_url"]
        self.pod_dirs = {name: Path(p["dir"]) for name, p in state["pods"].items()}
        self.pods = {name: LocalTarget(d) for name, d in self.pod_dirs.items()}

    def gateway_state(self) -> dict[str, Any] | None:
        """The gateway's ``/state`` (its pods: phase, generation, busy,
        streams), or None while it does not answer."""
        url = urllib.parse.urlsplit(self.gateway_url)
        try:
            conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=1.0)
            conn.request("GET", "/state")
            body = conn.getresponse().read()
            conn.close()
            return dict(json.loads(body))
        except (OSError, ValueError, TypeError, http.client.HTTPException):
            return None

    def stop_pod(self, name: str) -> list[int]:
        """SIGSTOP every process of the pod, those it forks meanwhile too:
        the pod freezes at once, as a node that stalls or is cut off."""
        stopped: list[int] = []
        for _ in range(3):
            new = [p for p in pod_processes(self.pod_dirs[name]) if p not in stopped]
            if not new:
                break
            for pid in new:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped += new
        return stopped

    def kill_pod(self, name: str) -> list[int]:
        """SIGKILL every process of the pod, as a node's loss would: frozen
        first, so that none of them sees another die (no respawner restarts
        its child, no engine judges its lock lost) before all are gone."""
        pids = self.stop_pod(name)
        signal_all(pids, signal.SIGKILL)
        return pids


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def pod_processes(directory: Path) -> list[int]:
    """Every process of a local pod: those with ``directory`` in their command
    line (``fleet.marked``: ``-X understudy_pod=DIR``, or a path inside it)."""
    mark = str(directory).encode()
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if any(
                    a == mark or a.startswith(mark + b"/") or a.endswith(b"=" + mark) for a in argv
                ):
                    out.append(int(proc.name))
    return out


def front_state(status_url: str) -> dict[str, Any]:
    """The serving front's ``/state``."""
    url = urllib.parse.urlsplit(status_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=2)
    try:
        conn.request("GET", "/state")
        doc: dict[str, Any] = json.loads(conn.getresponse().read())
        return doc
    finally:
        conn.close()


def front_pid(status_url: str) -> int:
    """The serving front's pid, as its ``/state`` reports it (in the pod's PID
    namespace). Its command line cannot tell: the respawner's spare runs the
    same one, waiting for its turn."""
    return int(front_state(status_url)["pid"])


def isolation_open(target: object) -> bool:
    """Whether every pod's front has no suspect waiting to run alone (a
    target that cannot reach its fronts: yes). A poison is named when an
    engine dies while a suspect of two deaths runs alone (docs/poison.md), so
    a drill's next kill waits for the last round's suspects to be cleared:
    else its fault, not the request, would be the third death."""
    urls = getattr(target, "front_status_urls", None)
    if urls is None:
        return True
    try:
        return all(front_state(u).get("isolation", "open") == "open" for u in urls())
    except Exception:  # a front restarting, the API unreachable: not known yet
        return False


def container_process(pid: int) -> int:
    """The process a container runs: ``pid`` itself, or, when that is the
    container's respawner (``understudy respawn -- …``), its child. A death of
    the process is the fault to drill; the respawner's is the container's."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid
    if b"respawn" not in cmdline:
        return pid
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            return int(entry.name)
    return pid


# /proc/net/unix: "Num RefCount Protocol Flags Type St Inode Path"; a
# listening socket has __SO_ACCEPTCON (0x10000) in Flags.
_ACCEPTCON = 0x10000


# A task's flags in /proc/<pid>/task/<tid>/stat (the 9th field): set from the
# first step of its exit, before its memory and files are given back.
_PF_EXITING = 0x4


def exiting(pid: int) -> bool:
    """Whether every thread of ``pid`` is on its way out (a killed process
    whose teardown has not closed its files yet), or it is gone: it runs no
    code of its own again, so a socket it still holds serves nobody. One
    live thread is enough to count it (a process whose first thread ended)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        for tid in tasks:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            if not int(stat[stat.rindex(")") + 2 :].split()[6]) & _PF_EXITING:
                return False
    except (OSError, ValueError, IndexError):
        pass  # gone while read: exiting too
    return True


def unix_listeners(directory: Path) -> set[int]:
    """Pids of the processes listening on Unix sockets in ``directory``; not
    one that is exiting (`exiting`): a killed engine may hold its socket for
    a second of teardown at ``SCHED_IDLE`` (the lock server's), and serves
    nothing in it."""
    prefix = str(directory) + "/"
    inodes = set()
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            listening = len(parts) >= 8 and int(parts[3], 16) & _ACCEPTCON
            if listening and parts[7].startswith(prefix):
                inodes.add(parts[6])
    pids: set[int] = set()
    if not inodes:
        return pids
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        pids.add(int(pid))
    return {pid for pid in pids if not exiting(pid)}
