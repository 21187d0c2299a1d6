"""Scheduling decision time at 100 / 1,000 / 5,000 nodes x 8 GPUs: watch caches vs. list per pass.

The fleet of ``tests/cluster/fleet.py`` grows in the real apiserver of the
cluster tier (Node objects without kubelets, 8 fake GPUs each in their
ResourceSlices, kept Ready by Lease heartbeats); every tenth node holds an
allocated ResourceClaim of 4 GPUs, so binpack and spread have something to
tell apart. At each size, in the same run:

* **cached**: the operator's decision now: a snapshot of the watch-based
  ``ClusterCache`` (populated by that apiserver) plus ``select`` (filters,
  then scorers), binpack and spread alternating;
* **cached, changing**: the same with a claim event applied to the cache
  before every decision, so each one re-digests the node it touched;
* **baseline, list per pass**: what the operator did before the caches:
  list Nodes, ResourceSlices and ResourceClaims (``observe.placement_inputs``
  without a cache), digest them, then ``select``.

Goal: <= 10 ms per decision at 1,000 nodes. Results: ``bench/results/scheduler.json``.
It mutates the shared cluster, so take the lock, and it deletes its fleet at
the end (also on failure)::

    flock /tmp/understudy-cluster.lock .venv/bin/python bench/scheduler.py \
        [--sizes 100,1000,5000] [--rounds 300] [--baseline-rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cluster"))
from _common import print_table, summary, write_results
from fleet import DRIVER, LABEL, Fleet, request

from understudy.operator.api import GpuInstance, PlacementStrategy
from understudy.operator.cache import ClusterCache
from understudy.operator.observe import placement_inputs
from understudy.operator.scheduler import Request, Toleration, select

NAMESPACE = "bench-scheduler"
KUBECONFIG = "/var/lib/understudy/cluster/admin.kubeconfig"
GOAL_MS = 10.0


def instance(name: str) -> GpuInstance:
    return GpuInstance.from_body(
        {
            "metadata": {"name": "bench", "namespace": NAMESPACE, "uid": "bench"},
            "spec": {
                "model": {"source": "1MiB"},
                "engine": {"adapter": "synthetic"},
                "gpus": {"count": 2, "deviceClassName": DRIVER},
                "placement": {
                    "nodeSelector": {LABEL: name},
                    "tolerations": [{"key": LABEL, "operator": "Exists"}],
                },
            },
        }
    )


def requests(name: str) -> list[Request]:
    tol = (Toleration(LABEL, "Exists"),)
    return [
        Request(
            count=2,
            strategy=strategy,
            node_selector={LABEL: name},
            tolerations=tol,
            image="localhost/understudy:dev",
        )
        for strategy in (PlacementStrategy.BINPACK, PlacementStrategy.SPREAD)
    ]


def fleet_view(cache: ClusterCache, name: str) -> tuple[int, int]:
    """(fleet nodes with 8 devices, fleet nodes with an allocation) the cache holds."""
    infos = [n for n in cache.node_infos(DRIVER, f"{DRIVER}/index") if n.labels.get(LABEL) == name]
    return (
        sum(1 for n in infos if n.devices is not None and len(n.devices) == 8),
        sum(1 for n in infos if n.allocated),
    )


async def wait_for(cache: ClusterCache, name: str, nodes: int, allocated: int) -> float:
    started = time.perf_counter()
    while fleet_view(cache, name) != (nodes, allocated):
        if time.perf_counter() - started > 300:
            raise TimeoutError(f"cache holds {fleet_view(cache, name)}, want {(nodes, allocated)}")
        await asyncio.sleep(0.2)
    return time.perf_counter() - started


def decide_cached(cache: ClusterCache, reqs: list[Request], rounds: int) -> list[float]:
    out = []
    for r in range(rounds):
        t0 = time.perf_counter()
        nodes = cache.node_infos(DRIVER, f"{DRIVER}/index")
        placement = select(reqs[r % 2], nodes)
        out.append(time.perf_counter() - t0)
        assert placement.feasible and placement.node is not None
    return out


def decide_changing(
    cache: ClusterCache, fleet: Fleet, reqs: list[Request], rounds: int
) -> list[float]:
    """A claim event lands before every decision (allocated, then released)."""
    out = []
    for r in range(rounds):
        node = fleet.node_name((r * 7) % fleet.size)
        devices = [{"driver": DRIVER, "pool": node, "device": "gpu-7"}] if r % 2 == 0 else []
        cache.inventory.put_claim(
            {
                "metadata": {"uid": "bench-churn", "name": "churn"},
                "status": {"allocation": {"devices": {"results": devices}}},
            }
        )
        t0 = time.perf_counter()
        nodes = cache.node_infos(DRIVER, f"{DRIVER}/index")
        select(reqs[r % 2], nodes)
        out.append(time.perf_counter() - t0)
    cache.inventory.drop_claim({"metadata": {"uid": "bench-churn"}})
    return out


async def decide_listing(
    dyn: Any, inst: GpuInstance, reqs: list[Request], rounds: int
) -> list[float]:
    out = []
    for r in range(rounds):
        t0 = time.perf_counter()
        nodes, _ = await placement_inputs(dyn, inst, None)
        select(reqs[r % 2], nodes)
        out.append(time.perf_counter() - t0)
    return out


async def allocate(fleet: Fleet, start: int, stop: int, concurrency: int = 16) -> int:
    """A 4-GPU claim on every tenth fleet node in [start, stop)."""
    sem = asyncio.Semaphore(concurrency)
    nodes = [i for i in range(start, stop) if i % 10 == 0]

    async def one(i: int) -> None:
        async with sem:
            await fleet.allocate(NAMESPACE, f"held-{i:05d}", node=i, devices=4)

    await asyncio.gather(*(one(i) for i in nodes))
    return len(nodes)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kubernetes.aio import config
    from kubernetes.aio.client import ApiClient, Configuration
    from kubernetes.aio.dynamic import DynamicClient

    cfg = Configuration()
    await config.load_kube_config(config_file=args.kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = 64
    api = ApiClient(configuration=cfg)
    dyn = await DynamicClient(api)  # type: ignore[no-untyped-call]
    fleet = Fleet(api, name="bench")
    cache = ClusterCache(api)
    inst = instance(fleet.name)
    reqs = requests(fleet.name)
    results: dict[str, Any] = {}
    try:
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        await request(api, "POST", "/api/v1/namespaces", ns)
        cache.start()
        await cache.wait_synced()
        fleet.start_heartbeat(period=args.heartbeat)
        claims = 0
        for size in args.sizes:
            before = fleet.size
            grow_s = await fleet.grow(size)
            claims += await allocate(fleet, before, size)
            sync_s = await wait_for(cache, fleet.name, size, claims)
            print(f"\n{size} nodes: grown in {grow_s:.1f} s, cache current {sync_s:.2f} s later")
            load_before = os.getloadavg()[0]
            cached = decide_cached(cache, reqs, args.rounds)
            changing = decide_changing(cache, fleet, reqs, args.rounds)
            listing = await decide_listing(dyn, inst, reqs, args.baseline_rounds)
            rows = {
                f"{size} cached": summary(cached),
                f"{size} cached, changing": summary(changing),
                f"{size} list per pass": summary(listing),
            }
            title = f"decision time, {size} nodes x 8 GPUs ({claims} claims)"
            print_table(f"{title}, load {load_before:.1f}", rows)
            results[str(size)] = {
                "nodes": size,
                "gpus": 8 * size,
                "claims": claims,
                "grow_seconds": grow_s,
                "cache_current_seconds": sync_s,
                "cached": summary(cached),
                "cached_changing": summary(changing),
                "list_per_pass": summary(listing),
                "speedup_p50": summary(listing)["p50"] / summary(cached)["p50"],
                # The machine is shared: its 1-minute load before and after.
                "load1": [load_before, os.getloadavg()[0]],
            }
        heartbeat = {"beats": fleet.beats, "missed": fleet.missed, "last_s": fleet.beat_seconds}
    finally:
        if not args.keep:
            await fleet.delete()
            await request(api, "DELETE", f"/api/v1/namespaces/{NAMESPACE}")
            print(f"\nfleet deleted: {await fleet.count()} left")
        await cache.stop()
        await api.close()
    return {"sizes": results, "heartbeat": heartbeat}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,1000,5000")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--baseline-rounds", type=int, default=20)
    p.add_argument("--heartbeat", type=float, default=15.0, help="lease renewal pause (s)")
    p.add_argument("--kubeconfig", default=KUBECONFIG)
    p.add_argument("--keep", action="store_true", help="leave the fleet in the cluster")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.sizes = sorted(int(s) for s in args.sizes.split(","))
    out = asyncio.run(run(args))
    at = out["sizes"].get("1000")
    if at is not None:
        p50, p99 = at["cached"]["p50"] * 1000, at["cached"]["p99"] * 1000
        verdict = "met" if p99 <= GOAL_MS else "missed"
        print(
            f"\ngoal <= {GOAL_MS} ms at 1,000 nodes: p50 {p50:.2f} ms, p99 {p99:.2f} ms ({verdict})"
        )
        out["goal"] = {"ms": GOAL_MS, "nodes": 1000, "met_p99": p99 <= GOAL_MS}
    write_results("scheduler", out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
