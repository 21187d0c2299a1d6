"""Scheduling over 1,000 nodes of a real apiserver (Node objects without kubelets).

``fleet.Fleet`` creates 1,000 Nodes with 8 fake GPUs each in their
ResourceSlices (driver and DeviceClass ``fleet.understudy.dev``), tainted so
that nobody else's pods land there, and keeps them Ready with Lease
heartbeats. Then:

* the operator's watch-based cache syncs them, and follows a node deletion
  and a claim allocation as they happen;
* a multi-node e2e where binpack and spread disagree: two GpuInstances of
  two replicas x 2 GPUs, one per strategy, tolerating the fleet's taint, are
  placed by the operator (running out of cluster) on different nodes, and
  kube-scheduler binds their pods where the operator said (DRA allocates
  the fleet's devices there). No kubelet runs them.

Everything the fleet created is deleted at the end (the module fixture).
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import wait_settled

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this tier's helpers
from crd_guard import this_crd
from fleet import DRIVER, LABEL, Fleet, Loop, request
from operator_proc import operator

from understudy.operator.cache import ClusterCache

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SIZE = 1000


def _wait(what: str, fn: Callable[[], Any], timeout: float = 120) -> Any:
    return wait_settled(what, fn, timeout)


@pytest.fixture(scope="module")
def fleet(cluster: Any) -> Iterator[tuple[Loop, Fleet]]:
    loop = Loop(str(cluster.kubeconfig))
    f = Fleet(loop.api, name="e2e")
    try:
        took = loop.run(f.grow(SIZE))
        print(f"\nfleet: {SIZE} nodes, slices and leases created in {took:.1f} s")
        loop.run(_start_heartbeat(f))
        yield loop, f
    finally:
        loop.run(f.delete())
        left = loop.run(f.count())
        loop.close()
        assert left == {"nodes": 0, "resourceslices": 0, "leases": 0}, left


async def _start_heartbeat(f: Fleet) -> None:
    f.start_heartbeat(period=20)


@pytest.fixture(scope="module")
def crd_installed(cluster: Any) -> Iterator[Any]:
    with this_crd(cluster):
        yield cluster


def test_the_cache_follows_a_thousand_nodes(fleet: tuple[Loop, Fleet], namespace: str) -> None:
    loop, f = fleet
    cache = ClusterCache(loop.api)

    async def start() -> float:
        t0 = time.perf_counter()
        cache.start()
        await cache.wait_synced()
        return time.perf_counter() - t0

    async def fleet_infos() -> dict[str, Any]:
        return {n.name: n for n in cache.node_infos(DRIVER, f"{DRIVER}/index") if LABEL in n.labels}

    synced = loop.run(start())
    try:
        infos = loop.run(fleet_infos())
        assert len(infos) == SIZE
        assert all(n.devices == frozenset(range(8)) and n.ready for n in infos.values())
        print(f"\ncache: {SIZE} fleet nodes synced in {synced:.2f} s")

        loop.run(f.allocate(namespace, "held", node=3, devices=5))
        _wait(
            "the allocation in the cache",
            lambda: loop.run(fleet_infos())[f.node_name(3)].allocated == frozenset(range(5)),
            30,
        )
        loop.run(
            _delete(loop, f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/held")
        )
        _wait(
            "the release in the cache",
            lambda: not loop.run(fleet_infos())[f.node_name(3)].allocated,
            30,
        )
        gone = f.node_name(SIZE - 1)
        loop.run(_delete(loop, f"/api/v1/nodes/{gone}"))
        _wait("the deletion in the cache", lambda: gone not in loop.run(fleet_infos()), 30)
        f.size = SIZE - 1  # the heartbeat skips it from now on
    finally:
        loop.run(cache.stop())


async def _delete(loop: Loop, path: str) -> None:
    await request(loop.api, "DELETE", path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _instance(name: str, strategy: str, fleet_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "understudy.dev/v1alpha1",
        "kind": "GpuInstance",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "1MiB"},
            "engine": {"adapter": "synthetic"},
            "gpus": {"count": 2, "deviceClassName": DRIVER},
            "gms": {"backend": "host"},
            "failover": {"enabled": False},
            "placement": {
                "strategy": strategy,
                "nodeSelector": {LABEL: fleet_name},
                "tolerations": [{"key": LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            },
            "replicas": {"min": 2},
        },
    }


def _placed(c: Any, ns: str, name: str) -> list[str] | None:
    st = c.get_json("-n", ns, f"gpuinstance/{name}").get("status") or {}
    nodes = [r.get("node") for r in st.get("replicas") or []]
    return nodes if len(nodes) == 2 and all(nodes) else None


def _bound(c: Any, ns: str, name: str) -> dict[str, str]:
    pods = c.get_json("-n", ns, "pods", "-l", f"understudy.dev/instance={name}")["items"]
    return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods}


def _affinity(pod: dict[str, Any]) -> str:
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    value: str = terms["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
    return value


@pytest.mark.timeout(900)
def test_binpack_and_spread_disagree_on_a_thousand_nodes(
    fleet: tuple[Loop, Fleet], crd_installed: Any, namespace: str, image: str
) -> None:
    loop, f = fleet
    c = crd_installed
    # Two partly used nodes: 6 of 8 GPUs on one, 4 of 8 on another.
    full, half = f.node_name(7), f.node_name(500)
    loop.run(f.allocate(namespace, "six", node=7, devices=6))
    loop.run(f.allocate(namespace, "four", node=500, devices=4))
    port = _free_port()
    try:
        with operator(c, namespace, image, metrics_port=port):
            c.kubectl(
                "create", "-n", namespace, "-f", "-",
                input=json.dumps(_instance("pack", "binpack", f.name)),
            )  # fmt: skip
            packed = _wait("binpack placed", lambda: _placed(c, namespace, "pack"), 180)
            c.kubectl(
                "create", "-n", namespace, "-f", "-",
                input=json.dumps(_instance("spread", "spread", f.name)),
            )  # fmt: skip
            spread = _wait("spread placed", lambda: _placed(c, namespace, "spread"), 180)
            # kube-scheduler binds where the operator said; DRA allocates there.
            _wait(
                "binpack bound",
                lambda: sorted(_bound(c, namespace, "pack").values()) == sorted(packed),
            )
            _wait(
                "spread bound",
                lambda: sorted(_bound(c, namespace, "spread").values()) == sorted(spread),
            )
            pods = c.get_json("-n", namespace, "pods")["items"]
            for pod in pods:
                assert _affinity(pod) == pod["spec"]["nodeName"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                metrics = resp.read().decode()
    finally:
        # Pods bound to nodes without a kubelet never finish a graceful delete.
        c.kubectl(
            "delete", "pods", "-n", namespace, "--all", "--force", "--grace-period=0",
            check=False,
        )  # fmt: skip
    print(f"\nbinpack placed on {packed}, spread on {spread}")
    # Every fleet node was a candidate (nothing lost to a stale or partial view).
    placed = [
        e["message"]
        for e in c.get_json("-n", namespace, "events")["items"]
        if e["reason"] == "Placed"
    ]
    assert len(placed) == 4 and all(
        int(m.split(" of ")[1].split()[0]) >= SIZE - 3 for m in placed
    ), placed
    # Binpack fills the fullest nodes first; spread takes two empty ones.
    assert packed == [full, half]
    assert len(set(spread)) == 2 and not set(spread) & {full, half}
    count = _metric(metrics, "understudy_scheduler_decision_seconds_count")
    total = _metric(metrics, "understudy_scheduler_decision_seconds_sum")
    assert count >= 4
    print(
        f"operator decisions over {SIZE + 1} nodes: {count:.0f}, mean {1000 * total / count:.2f} ms"
    )


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )
