"""The fleet gateway on the cluster (issue 28, docs/gateway.md "On
Kubernetes"): the llama sample with two pods and a ``gateway: {}`` section,
the chart helm-installed with the operator in-cluster (test_e2e's fixtures).

- what the operator renders: the gateway's Deployment (two replicas,
  available), its PodDisruptionBudget, the instance's Service selecting the
  gateway's pods, the headless ``<name>-pods`` over the instance's pods, and
  every gateway replica listing both pods from its EndpointSlices;
- ``understudy drill --kube`` through the gateway's Service: Active engines
  killed under load, every request answered, every answer the same;
- a pod force-deleted while streams are open on it (its containers killed at
  once: a node's loss as the API sees it): every stream finishes on the
  other pod, each identical to its uninterrupted run;
- the same with the API server stopped: the gateways route on the
  EndpointSlices they last saw;
- a gateway replica's process SIGKILLed: no new connection through the
  Service fails (the respawner holds its ports; its spare takes over);
- a rollout of the instance's pods through the gateway: no request fails;
- the API-key Secret mounted into the gateway: no key, 401; the key, 200
  (last: every request after it needs the key).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this tier's helpers
import test_e2e
from procs import asking
from test_control_plane_down import _api_server_pid, _stopped, _unreachable
from test_e2e import Instance, _sample, _wait

from understudy.tools.drill_kube import pod_processes

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
]

installed = test_e2e.installed

GATEWAY_STATUS_PORT = 8091
TINY = "builtin:tiny-llama"  # ~10x faster per token than the sample's SmolLM2
STREAMS = 6
MAX_TOKENS = 48
LONG = 1500  # tokens: streams still open when their pod is lost
STALL_BOUND_S = 5.0
FREEZE_S = 5.0
# Streams under a stopped API server: done well inside the stop's bound
# (45 s, the node-monitor grace period).
API_DOWN_TOKENS = 1000
# Long enough that streams span an old pod's drain.
ROLLOUT_TOKENS = 400


class GatewayInstance(Instance):
    """The llama sample with ``replicas.min: 2`` and ``gateway: {}``."""

    def __init__(self, cluster: Any, ns: str, name: str = "gw-llama") -> None:
        self.cluster, self.ns, self.name = cluster, ns, name
        doc = _sample(name, cluster.device_class, "llama", TINY)
        doc["spec"]["replicas"] = {"min": 2}
        doc["spec"]["gateway"] = {}
        # Two pods on hack/cluster's one two-CPU node (four fake GPUs): the
        # tiny model asks far less than the sample's SmolLM2 (0.41 CPU and
        # 0.9 GiB a pod with the sidecars; each gateway replica 0.1 CPU).
        doc["spec"]["engine"]["resources"]["requests"] = {"cpu": "100m", "memory": "256Mi"}
        cluster.apply(json.dumps(doc), namespace=ns)

    def gateway_pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.get_json(
            "pods", "-n", self.ns, "-l", f"understudy.dev/gateway={self.name}"
        )["items"]
        return items

    def engine_pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.get_json(
            "pods", "-n", self.ns, "-l", f"understudy.dev/instance={self.name}"
        )["items"]
        return items

    def gateway_state(self, pod: dict[str, Any]) -> dict[str, Any]:
        url = f"http://{pod['status']['podIP']}:{GATEWAY_STATUS_PORT}/state"
        with urllib.request.urlopen(url, timeout=2) as resp:
            state: dict[str, Any] = json.loads(resp.read())
        return state

    def every_gateway_routes_to(self, names: set[str]) -> bool:
        gateways = [p for p in self.gateway_pods() if p["status"].get("podIP")]
        if len(gateways) < 2:
            return False
        for gw in gateways:
            ready = {p["name"] for p in self.gateway_state(gw)["pods"] if p["phase"] == "ready"}
            if ready != names:
                return False
        return True

    def serving_pods(self) -> set[str]:
        """The instance's pods not on their way out (a rollout renames them)."""
        return {
            p["metadata"]["name"]
            for p in self.engine_pods()
            if not p["metadata"].get("deletionTimestamp")
        }

    def describe(self) -> str:
        """What a rollout that does not end is waiting on: each pod's phase,
        readiness and deletion, the operator's replicas, each gateway's pod
        list, and the operator's last words on this instance."""
        lines = []
        for p in self.engine_pods() + self.gateway_pods():
            meta, status = p["metadata"], p.get("status", {})
            ready = {c["name"]: c.get("ready") for c in status.get("containerStatuses") or ()}
            conds = [(c["type"], c["status"]) for c in status.get("conditions") or ()]
            lines.append(
                f"pod {meta['name']}: {status.get('phase')} "
                f"deleting={meta.get('deletionTimestamp')} node={p['spec'].get('nodeName')} "
                f"ready={ready} conditions={conds}"
            )
            if "understudy.dev/gateway" in meta.get("labels", {}) and status.get("podIP"):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    lines.append(f"  gateway pods: {self.gateway_state(p)['pods']}")
        inst = self.cluster.get_json("gpuinstance", self.name, "-n", self.ns)
        lines.append(f"replicas: {json.dumps(inst.get('status', {}).get('replicas'))}")
        lines.append(f"conditions: {json.dumps(inst.get('status', {}).get('conditions'))}")
        logs = self.cluster.kubectl(
            "logs", "-n", test_e2e.OPERATOR_NS, "-l", "app.kubernetes.io/name=understudy",
            "--tail=400", check=False,
        ).stdout  # fmt: skip
        lines += [ln for ln in logs.splitlines() if self.name in ln][-40:]
        return "\n".join(lines)

    def wait_gateway(self, timeout: float = 300) -> None:
        deployment = f"{self.name}-gateway"
        _wait(
            "the gateway's Deployment available",
            lambda: (
                self.cluster.get_json("deployment", deployment, "-n", self.ns)
                .get("status", {})
                .get("availableReplicas", 0)
                >= 2
            ),
            timeout,
        )

        def routed() -> bool:
            pods = self.serving_pods()
            return len(pods) == 2 and self.every_gateway_routes_to(pods)

        _wait("every gateway routes to both pods", routed, 120)


@pytest.fixture(scope="module")
def gw(installed: Any) -> Iterator[GatewayInstance]:
    ns = f"gateway-{int(time.time())}"
    installed.kubectl("create", "namespace", ns)
    installed.kubectl("wait", "--for=create", "-n", ns, "serviceaccount/default", "--timeout=30s")
    try:
        inst = GatewayInstance(installed, ns)
        inst.wait_ready(600)
        inst.wait_gateway()
        yield inst
    finally:
        installed.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _completion(
    url: str,
    prompt: str,
    *,
    stream: bool,
    key: str | None = None,
    max_tokens: int = MAX_TOKENS,
    gaps: list[float] | None = None,
) -> str:
    """A greedy completion through ``url``: its text (a stream's, joined)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        if not stream:
            return str(json.loads(resp.read())["choices"][0]["text"])
        text, done = [], False
        last = time.monotonic()
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            if gaps is not None:  # the longest wait between two events
                now = time.monotonic()
                gaps.append(now - last)
                last = now
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                done = True
                break
            text.append(json.loads(data)["choices"][0]["text"])
        assert done, "the stream ended without [DONE]"
        return "".join(text)


def test_the_gateway_objects_and_the_services(gw: GatewayInstance) -> None:
    c, ns, name = gw.cluster, gw.ns, gw.name
    dep = c.get_json("deployment", f"{name}-gateway", "-n", ns)
    assert dep["spec"]["replicas"] == 2
    assert dep["metadata"]["ownerReferences"][0]["kind"] == "GpuInstance"
    pdb = c.get_json("poddisruptionbudget", f"{name}-gateway", "-n", ns)
    assert pdb["spec"]["maxUnavailable"] == 1
    # The instance's Service lists the gateway's pods, the headless one the instance's.
    gateways = {p["metadata"]["name"] for p in gw.gateway_pods()}
    engines = {p["metadata"]["name"] for p in gw.engine_pods()}
    assert len(gateways) == 2 and engines == {f"{name}-0", f"{name}-1"}

    def listed(service: str) -> set[str]:
        slices = c.get_json(
            "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={service}"
        )["items"]
        return {ep["targetRef"]["name"] for sl in slices for ep in sl.get("endpoints") or []}

    assert listed(name) == gateways
    assert listed(f"{name}-pods") == engines
    # One answer through the Service, the same again.
    url = gw.url()
    first = _completion(url, "The capital of France is", stream=False)
    assert _completion(url, "The capital of France is", stream=True) == first


@pytest.mark.timeout(1800)
def test_drill_through_the_gateway_kills_active_engines(gw: GatewayInstance) -> None:
    kills = 6
    report = gw.drill(
        "--kills",
        str(kills),
        "--signal",
        "KILL,SEGV,STOP",
        "--clients",
        "8",
        "--kube-pod",
        f"{gw.name}-0",
    )
    s = report["summary"]
    assert s["failed_requests"] == 0, report.get("errors")
    assert s["wrong_answers"] == 0 and s["split_brain"] == 0
    assert report["exit_code"] == 0
    gw.wait_ready(300)


def _streams_by_pod(gw: GatewayInstance) -> dict[str, int]:
    """Requests in flight on each pod, summed over the gateway's replicas."""
    out: dict[str, int] = {}
    for pod in gw.gateway_pods():
        if pod["status"].get("podIP"):
            for p in gw.gateway_state(pod)["pods"]:
                out[p["name"]] = out.get(p["name"], 0) + p["busy"]
    return out


def _migrations(gw: GatewayInstance) -> int:
    moved = 0
    for pod in gw.gateway_pods():
        url_metrics = f"http://{pod['status']['podIP']}:{GATEWAY_STATUS_PORT}/metrics"
        with urllib.request.urlopen(url_metrics, timeout=2) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("understudy_gateway_migrations_total{"):
                    moved += int(float(line.rsplit(" ", 1)[1]))
    return moved


def _fault_under_streams(
    gw: GatewayInstance,
    fault: Callable[[str, str], str],
    *,
    tokens: int = LONG,
    around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Six greedy streams of ``tokens`` open through the gateway; ``fault``
    (the pod's name and uid; it says what it did) to the pod that serves the
    most of them, inside ``around`` from just before the fault until every
    stream ended. Every stream finishes, identical to its uninterrupted run,
    none waits past STALL_BOUND_S for an event, and the faulted pod's
    streams moved."""
    url = gw.url()
    prompts = [f"Story number {i}: once upon a time" for i in range(STREAMS)]
    want = {p: _completion(url, p, stream=False, max_tokens=tokens) for p in prompts}
    moved_before = _migrations(gw)
    got: dict[str, str] = {}
    errors: list[BaseException] = []
    gaps: list[float] = []

    def stream(prompt: str) -> None:
        try:
            got[prompt] = _completion(url, prompt, stream=True, max_tokens=tokens, gaps=gaps)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    _wait("every stream open on a pod", lambda: sum(_streams_by_pod(gw).values()) >= STREAMS, 60)
    by_pod = _streams_by_pod(gw)
    victim = max(by_pod, key=lambda name: by_pod[name])
    uid = gw.cluster.get_json("pod", victim, "-n", gw.ns)["metadata"]["uid"]
    with around():
        t_fault = time.monotonic()
        did = fault(victim, uid)
        for t in threads:
            t.join(300)
        finished_s = time.monotonic() - t_fault
    sys.stderr.write(
        f"{victim} {did} under streams {by_pod}; every stream done {finished_s:.2f} s "
        f"after the fault, longest wait for an event {max(gaps):.2f} s, "
        f"load {os.getloadavg()}\n"
    )
    assert not errors, errors
    assert got == want
    # The faulted pod's streams wait for the gateway to find it dead (a reset
    # at once, or --silence, 1 s) and for the other pod to take them on:
    # their prompt and tokens so far prefilled, beside its own streams.
    assert max(gaps) < STALL_BOUND_S, sorted(gaps)[-5:]
    # streams were on the faulted pod (by_pod), and moved
    assert _migrations(gw) - moved_before >= by_pod[victim], by_pod
    gw.wait_ready(600)
    gw.wait_gateway()


def _kill_all(victim: str, uid: str) -> int:
    """SIGKILL every process of the pod from the node: how many."""
    killed = 0
    for pid in pod_processes(uid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    assert killed, f"no process of {victim} on this node"
    return killed


@pytest.mark.timeout(900)
def test_a_pod_lost_under_streams_moves_them_token_exact(gw: GatewayInstance) -> None:
    """A node's loss as the API and the node see it: the pod is force-deleted
    (grace 0) and every process of it is SIGKILLed from the node at once."""

    def lose(victim: str, uid: str) -> str:
        gw.cluster.kubectl(
            "delete", "pod", victim, "-n", gw.ns, "--grace-period=0", "--force", "--wait=false"
        )
        return f"lost ({_kill_all(victim, uid)} processes SIGKILLed)"

    _fault_under_streams(gw, lose)


def _pod_freezer(uid: str) -> tuple[Path, str, str]:
    """The pod's own cgroup in the freezer (v1: ``freezer.state``; v2:
    ``cgroup.freeze``), with what freezes and what thaws it: the directory
    above its containers', whose name carries the pod's uid."""
    for pid in pod_processes(uid):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "freezer" in controllers.split(","):
                root, knob, on, off = "/sys/fs/cgroup/freezer", "freezer.state", "FROZEN", "THAWED"
            elif controllers == "":
                root, knob, on, off = "/sys/fs/cgroup", "cgroup.freeze", "1", "0"
            else:
                continue
            for d in (Path(root + path), *Path(root + path).parents):
                if uid in d.name or uid.replace("-", "_") in d.name:
                    return d / knob, on, off
    raise AssertionError(f"no freezer cgroup for pod {uid}")


@pytest.mark.timeout(900)
def test_a_pod_frozen_under_streams_moves_them_token_exact(gw: GatewayInstance) -> None:
    """A frozen node, a partition that heals: every process of the pod
    stopped at once for 5 s through its cgroup's freezer, then thawed. The
    gateway finds its streams silent (--silence 1 s) and moves them."""

    def freeze(victim: str, uid: str) -> str:
        knob, on, off = _pod_freezer(uid)
        knob.write_text(on)
        try:
            time.sleep(FREEZE_S)
        finally:
            knob.write_text(off)
        return f"frozen {FREEZE_S:g} s"

    _fault_under_streams(gw, freeze)


@pytest.mark.timeout(900)
def test_the_api_server_stopped_a_pod_lost_under_streams_moves_them(gw: GatewayInstance) -> None:
    """The control plane is not on the gateway's data path: with the API
    server stopped (SIGSTOP: every call hangs, the gateways' watches go
    silent), every process of a pod is SIGKILLed from the node under
    streams. The gateways route on the EndpointSlices they last saw: the
    pod's streams move to the other pod, token-exact, before the API server
    goes on. No kubectl inside: the node's own view only."""
    cluster = gw.cluster
    if not cluster.ours or os.geteuid() != 0:
        pytest.skip("stops hack/cluster's own API server: runs as root on its node")
    api = _api_server_pid(cluster.cluster_dir)
    seen: dict[str, Any] = {}

    @contextlib.contextmanager
    def api_stopped() -> Iterator[None]:
        t0 = time.monotonic()
        with _stopped(api):
            yield
            seen["stopped_s"] = time.monotonic() - t0

    def lose(victim: str, uid: str) -> str:
        killed = _kill_all(victim, uid)
        seen["unreachable"] = _unreachable(gw)  # after the kill: the streams are running
        return f"lost with the API server stopped ({killed} processes SIGKILLed)"

    _fault_under_streams(gw, lose, tokens=API_DOWN_TOKENS, around=api_stopped)
    sys.stderr.write(f"API server stopped {seen['stopped_s']:.1f} s\n")
    assert seen["unreachable"], "the API server still answered while stopped"
    assert seen["stopped_s"] < 45.0  # under the node-monitor grace period


def _gateway_pid_on_node(pod: dict[str, Any], pid_in_pod: int) -> tuple[int, int]:
    """The node's pid of the gateway process that says ``pid_in_pod`` in its
    ``/state`` (its own PID namespace), and how many gateway processes the
    pod runs (the serving one and its spare; not the respawner)."""
    found, gateways = 0, 0
    for pid in pod_processes(pod["metadata"]["uid"]):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"gateway" not in argv or b"respawn" in argv:
                continue
            gateways += 1
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and int(line.split()[-1]) == pid_in_pod:
                    found = pid
    return found, gateways


@pytest.mark.timeout(600)
def test_a_gateway_replica_killed_refuses_no_new_connection(gw: GatewayInstance) -> None:
    """One gateway replica's serving process SIGKILLed from the node while
    clients open new connections through the Service: none fails. The
    replica runs under the respawner, which holds its ports, so the
    Service's connections to it wait in the port's queue for the spare,
    and kubelet restarts nothing. What the killed process had accepted is
    lost with it: the streams open on it directly are cut (reported)."""
    victim = next(p for p in gw.gateway_pods() if p["status"].get("podIP"))
    ip = victim["status"]["podIP"]
    port = next(
        p["containerPort"] for p in victim["spec"]["containers"][0]["ports"] if p["name"] == "http"
    )
    restarts = victim["status"]["containerStatuses"][0]["restartCount"]
    old = int(gw.gateway_state(victim)["pid"])
    _wait("a spare beside the victim", lambda: _gateway_pid_on_node(victim, old)[1] == 2, 60)
    node_pid, _ = _gateway_pid_on_node(victim, old)
    assert node_pid, f"no process of {victim['metadata']['name']} says pid {old}"
    cut: list[BaseException] = []

    def own_stream(i: int) -> None:  # a client of the victim itself
        try:
            _completion(
                f"http://{ip}:{port}", f"Story number {i}: on the gateway that dies",
                stream=True, max_tokens=LONG,
            )  # fmt: skip
        except BaseException as exc:  # what it loses is the finding
            cut.append(exc)

    streams = [threading.Thread(target=own_stream, args=(i,)) for i in range(2)]
    for t in streams:
        t.start()
    url = gw.url()
    with asking(lambda i, n: _completion(url, "hello", stream=False, max_tokens=4), 4) as results:
        _wait("the victim's streams open", lambda: gw.gateway_state(victim)["inflight"] >= 2, 60)
        _wait("requests flowing", lambda: len(results) >= 8, 60)
        t_kill = time.monotonic()
        os.kill(node_pid, signal.SIGKILL)

        def successor() -> int:
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = int(gw.gateway_state(victim)["pid"])
                return pid if pid != old else 0
            return 0

        new = _wait("the victim's spare serving", successor, 60)
        back_s = time.monotonic() - t_kill
        time.sleep(2.0)
    for t in streams:
        t.join(120)
    after = [exc for t0, exc in results if t0 >= t_kill]
    failed = [exc for exc in after if exc is not None]
    sys.stderr.write(
        f"gateway {victim['metadata']['name']} pid {old} killed, pid {new} serving after "
        f"{back_s:.2f} s; {len(after)} requests through the Service after the kill, "
        f"{len(failed)} failed; its own 2 open streams: {len(cut)} cut ({cut[:2]}); "
        f"load {os.getloadavg()}\n"
    )
    assert failed == [], failed[:3]
    assert len(after) >= 8
    assert back_s < 10.0  # a spare's turn in place, not kubelet's restart
    pod = gw.cluster.get_json("pod", victim["metadata"]["name"], "-n", gw.ns)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == restarts
    gw.wait_gateway()


@pytest.mark.timeout(1500)
def test_a_rollout_of_the_pods_through_the_gateway_fails_no_request(gw: GatewayInstance) -> None:
    """A spec change rolls the instance's pods out (surge first, each old pod
    drained: unrouted, then deleted with its grace) while clients stream and
    ask through the gateway's Service. The gateways take nothing new to a
    terminating pod, and its streams finish there or move: no request
    fails, every answer is its greedy one, and the gateways end up routing
    to the two new pods only."""
    c, ns, name = gw.cluster, gw.ns, gw.name
    url = gw.url()
    old = gw.serving_pods()
    prompts = [f"Rollout question {i}: what does an understudy do?" for i in range(4)]
    want = {p: _completion(url, p, stream=False, max_tokens=ROLLOUT_TOKENS) for p in prompts}
    stop = threading.Event()
    answered, errors, wrong = [0], [], []

    def client(i: int) -> None:
        prompt = prompts[i]
        while not stop.is_set():
            try:
                got = _completion(url, prompt, stream=i % 2 == 0, max_tokens=ROLLOUT_TOKENS)
            except Exception as exc:
                errors.append(exc)
                continue
            answered[0] += 1
            if got != want[prompt]:
                wrong.append((prompt, got))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    try:
        _wait("requests flowing", lambda: answered[0] >= 4, 120)
        cpu = f"{100 + int(time.time()) % 50}m"  # a new pod template, each run
        patch = {"spec": {"engine": {"resources": {"requests": {"cpu": cpu}}}}}
        c.kubectl("patch", "gpuinstance", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))

        def rolled() -> bool:
            pods = gw.serving_pods()
            return (
                len(pods) == 2
                and not pods & old
                and not {p["metadata"]["name"] for p in gw.engine_pods()} & old
                and gw.every_gateway_routes_to(pods)
            )

        try:
            _wait("both pods replaced, the gateways routing to the new ones", rolled, 1200)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{gw.describe()}") from None
        took = time.monotonic() - t0
        time.sleep(3.0)  # requests on the new pods alone
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    new = gw.serving_pods()
    sys.stderr.write(
        f"rollout {sorted(old)} -> {sorted(new)} in {took:.0f} s: {answered[0]} answers, "
        f"{len(errors)} failed, {len(wrong)} wrong; load {os.getloadavg()}\n"
    )
    assert not errors, errors[:5]
    assert not wrong, wrong[:2]
    assert answered[0] > 8
    gw.wait_ready(600)


@pytest.mark.timeout(600)
def test_the_api_key_secret_guards_the_service(gw: GatewayInstance) -> None:
    """The Secret's key switched on: the gateway's Deployment rolls out (its
    replicas replaced one by one), and a client that sends the key all along
    sees no error through it; one without the key is refused, 401."""
    c, ns, name = gw.cluster, gw.ns, gw.name
    key = "k-" + str(int(time.time()))
    url = gw.url()
    answered, errors = [0], []
    stop = threading.Event()

    def keyed_client() -> None:  # a keyless gateway ignores the header
        while not stop.is_set():
            try:
                _completion(url, "hello", stream=False, key=key)
                answered[0] += 1
            except Exception as exc:
                errors.append(exc)

    client = threading.Thread(target=keyed_client)
    client.start()
    try:
        c.kubectl(
            "create", "secret", "generic", f"{name}-keys", "-n", ns, f"--from-literal=keys={key}"
        )
        patch = {"spec": {"gateway": {"apiKeySecret": {"name": f"{name}-keys", "key": "keys"}}}}
        c.kubectl("patch", "gpuinstance", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))

        def refused() -> bool:
            try:
                _completion(url, "hello", stream=False)
            except urllib.error.HTTPError as exc:
                return exc.code == 401
            return False

        _wait("a request without a key refused", refused, 120)
        deployment = f"{name}-gateway"
        c.kubectl(
            "rollout", "status", f"deployment/{deployment}", "-n", ns, "--timeout=300s", timeout=330
        )
        time.sleep(2.0)  # the last old replica's pre-stop wait and drain, under the client
    finally:
        stop.set()
        client.join(60)
    sys.stderr.write(f"gateway rollout: {answered[0]} keyed requests, {len(errors)} failed\n")
    assert not errors, errors[:5]
    assert answered[0] > 0
    assert _completion(url, "hello", stream=False, key=key)
