"""One pod as local processes: the pod ``render.py`` renders, in local places (pure).

The local runner keeps no container list of its own: it runs the rendered
pod's containers, each one's command and environment as rendered, with what
only the node decides replaced (``Places``):

- the pod's shared directory (the ``run`` emptyDir at ``render.RUN_DIR``) by
  a local directory, and every path under it with it;
- the pod's ports by local ones: a value is a port where it is one whole (an
  argument ``9101`` or ``HOST:9101``, an environment variable named ``*_PORT``).
  The GpuInstance's bounds keep every other number of a command below the
  lowest pod port (timings up to an hour, counts), so no timing is mistaken
  for a port;
- the programs: the image puts ``understudy`` and ``python`` on PATH, and a
  checkout's venv need not be active, so they become a python's
  ``-m understudy.cli`` and that python. A wrapper's child (after ``--``, the
  respawner's) is a program too; an engine's runs with the engines' python;
- the downward API (the pod's name and namespace).

The engines' HTTP probes come along (``HttpProbe``, at their local ports):
the runner plays kubelet with the pod's own settings. Model paths need
nothing: ``model.path`` is mounted at the same path in the container. One
call makes one pod; ``--pods N`` makes N with N places.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from understudy.operator.render import RUN_DIR


@dataclass(frozen=True, slots=True)
class Places:
    """Where one local pod lives: its directory, its ports, its pythons."""

    dir: Path
    ports: Mapping[int, int]  # the pod's port -> the local one
    python: str  # runs every container's program, and the sidecars' children
    engine_python: str  # runs the engines (a vllm engine needs the vLLM venv's)
    engine_env: Mapping[str, str] = field(default_factory=dict)  # beside the rendered env
    pod_name: str = "local"
    namespace: str = "local"


@dataclass(frozen=True, slots=True)
class HttpProbe:
    """One of kubelet's HTTP probes of a container, at its local port."""

    port: int
    path: str
    period_s: float
    timeout_s: float
    failures: int  # in a row, that fail the probe
    grace_s: float  # a liveness kill's SIGTERM -> SIGKILL


@dataclass(frozen=True, slots=True)
class Process:
    """One container of the pod as a local process."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    # A native sidecar (an init container that keeps running): started in
    # order, each gated by its startup check, before the engines.
    sidecar: bool
    # An engine's probes, as the pod declares them; a sidecar's start is
    # checked by the runner itself, and kubelet does not restart it on them.
    startup: HttpProbe | None
    liveness: HttpProbe | None


def processes(pod_spec: Mapping[str, Any], places: Places) -> list[Process]:
    """The containers of ``pod_spec`` (``render.pod_spec``), sidecars first, as local processes."""
    for c in pod_spec["initContainers"]:
        if c.get("restartPolicy") != "Always":
            raise ValueError(f"{c['name']}: the local runner runs sidecars, not run-once inits")
    grace = float(pod_spec["terminationGracePeriodSeconds"])
    return [
        *(_sidecar(c, places) for c in pod_spec["initContainers"]),
        *(_engine(c, places, grace) for c in pod_spec["containers"]),
    ]


def _sidecar(c: Mapping[str, Any], places: Places) -> Process:
    env = {e["name"]: _env_value(e, places) for e in c.get("env", [])}
    argv = command([*c.get("command", []), *c.get("args", [])], places, places.python)
    return Process(c["name"], argv, env, sidecar=True, startup=None, liveness=None)


def _engine(c: Mapping[str, Any], places: Places, pod_grace: float) -> Process:
    env = {e["name"]: _env_value(e, places) for e in c.get("env", [])}
    return Process(
        name=c["name"],
        argv=command([*c.get("command", []), *c.get("args", [])], places, places.engine_python),
        env={**env, **places.engine_env},
        sidecar=False,
        startup=_http_probe(c.get("startupProbe"), places, pod_grace),
        liveness=_http_probe(c.get("livenessProbe"), places, pod_grace),
    )


def _http_probe(
    probe: Mapping[str, Any] | None, places: Places, pod_grace: float
) -> HttpProbe | None:
    """A rendered HTTP probe, kubelet's defaults where the pod leaves a field out."""
    if probe is None or "httpGet" not in probe:
        return None
    get = probe["httpGet"]
    return HttpProbe(
        port=places.ports[get["port"]],
        path=get["path"],
        period_s=float(probe.get("periodSeconds", 10)),
        timeout_s=float(probe.get("timeoutSeconds", 1)),
        failures=int(probe.get("failureThreshold", 3)),
        grace_s=float(probe.get("terminationGracePeriodSeconds", pod_grace)),
    )


def command(argv: Sequence[str], places: Places, child_python: str) -> tuple[str, ...]:
    """A rendered command line, run here."""
    words = [local_value(a, places) for a in argv[1:]]
    if "--" in words:
        cut = words.index("--")
        words[cut + 1 : cut + 2] = _program(words[cut + 1], child_python)
    return (*_program(argv[0], places.python), *words)


def _program(word: str, python: str) -> list[str]:
    if word == "understudy":
        return [python, "-m", "understudy.cli"]
    if word == "python":
        return [python]
    raise ValueError(f"no local program for the pod's {word!r}")


def local_value(value: str, places: Places) -> str:
    """An argument: a path in the pod's directory, or a port, made local."""
    if value == RUN_DIR or value.startswith(RUN_DIR + "/"):
        return str(places.dir) + value[len(RUN_DIR) :]
    head, colon, tail = value.rpartition(":")
    if tail.isdigit() and int(tail) in places.ports:
        return f"{head}{colon}{places.ports[int(tail)]}"
    return value


def _env_value(e: Mapping[str, Any], places: Places) -> str:
    if "value" not in e:
        downward = {"metadata.name": places.pod_name, "metadata.namespace": places.namespace}
        return downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
    v: str = e["value"]
    if e["name"].endswith("_PORT") or v.startswith(RUN_DIR):
        return local_value(v, places)
    return v
