"""The fleet gateway's cost: latency added per request, and throughput,
against the same pod reached through its own front, measured in one run.

A local pod of the synthetic engine (``understudy local up``) and one
``understudy gateway`` in front of it (``--pod``, the pod's serving and
status ports). "Front" sends each request to the pod's serving port, as a
client of a single pod would; "gateway" sends it to the gateway, which
relays it to the same front (with the relay header: the front writes
heartbeats on the gateway's streams). Rounds alternate as in
``front_overhead.py`` (whose measurement this reuses), so a drift of the
machine lands on both alike; the headline is the median round's p50
difference, beside the gateway's CPU time per request and the throughput
ratio. The targets (issue 28): at most 0.3 ms p50 added, throughput at
least 0.9x.

With ``--gateway-cpu N`` the gateway runs on CPU N alone, and the pod and
the clients on the other CPUs: the gateway on cores of its own, as its own
pod on a cluster has them, so the ratio says whether the gateway limits the
throughput rather than what its CPU takes from a shared machine.

    python bench/gateway_overhead.py [--requests 1000] [--rounds 5] [--concurrency 8]
        [--gateway-cpu N]
"""

from __future__ import annotations

import contextlib
import http.client
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import print_table, write_results
from front_overhead import CASES, Side, measure_case, parse_args
from localpod import LocalPod, free_port_block, http_json
from procs import Proc, understudy, wait_for

from understudy.tools.drill_target import pod_processes


def _ready(port: int) -> bool:
    with contextlib.suppress(OSError, http.client.HTTPException):
        return http_json(port, "/ready")[0] == 200
    return False


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (an affinity is a thread's own)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


def _pin_apart(pod: LocalPod, gateway: int, cpu: int) -> dict[str, list[int]]:
    """The gateway on ``cpu``; the pod's processes and this one (the clients) elsewhere."""
    mine = set(os.sched_getaffinity(0))
    rest = mine - {cpu}
    if not rest or cpu not in mine:
        raise SystemExit(f"--gateway-cpu {cpu}: needs it and another CPU of {sorted(mine)}")
    _pin(gateway, {cpu})
    for pid in (*pod_processes(Path(pod.dir)), os.getpid()):
        _pin(pid, rest)
    return {"gateway": [cpu], "pod_and_clients": sorted(rest)}


def main() -> int:
    args = parse_args(
        __doc__,
        lambda ap: ap.add_argument(
            "--gateway-cpu", type=int, help="the gateway alone on this CPU, the rest elsewhere"
        ),
    )
    pod = LocalPod(engine="synthetic")
    gateway: Proc | None = None
    try:
        pod.wait_armed(120)
        port = free_port_block(2)
        front_status = pod.front_port  # the pod front's status port (/ready)
        gateway = Proc(
            understudy(
                "gateway", "--pod", f"http://127.0.0.1:{pod.serve_port}?status={front_status}",
                "--port", str(port), "--metrics-port", str(port + 1),
            ),
            log=Path(pod.dir) / "gateway.out",
        )  # fmt: skip
        wait_for(lambda: _ready(port + 1), 60, 0.1, what="the gateway routing the pod")
        pinned = None
        if args.gateway_cpu is not None:
            pinned = _pin_apart(pod, gateway.pid, args.gateway_cpu)
            print(f"pinned: {pinned}")
        rows: dict[str, dict[str, float]] = {}
        results: dict[str, dict[str, object]] = {}
        for name, (path, body, headers) in CASES.items():
            front = Side(
                lambda: http.client.HTTPConnection("127.0.0.1", pod.serve_port, timeout=30),
                headers,
            )
            via = Side(lambda: http.client.HTTPConnection("127.0.0.1", port, timeout=30), headers)
            f_sum, g_sum, r = measure_case(front, via, path, body, gateway.pid, args)
            # measure_case names its two sides direct and front: here they are
            # the pod's front and the gateway
            results[name] = {k.replace("front", "gateway").replace("direct", "front"): v
                             for k, v in r.items()}  # fmt: skip
            rows[f"{name} front"], rows[f"{name} gateway"] = f_sum, g_sum
        print_table(
            f"sequential latency, one keep-alive connection, {args.rounds} interleaved rounds", rows
        )
        print()
        for name, r in results.items():
            rounds = r["added_p50_ms_rounds"]
            cpu = r["gateway_cpu_us_per_request"]
            assert isinstance(rounds, list) and isinstance(cpu, dict)
            print(
                f"{name:18} gateway adds p50 {r['added_p50_ms']:.3f} ms (median round; rounds "
                f"{min(rounds):.3f}-{max(rounds):.3f}), p99 {r['added_p99_ms_pooled']:.3f} ms "
                f"pooled; gateway CPU {cpu['user']:.0f} us user + {cpu['system']:.0f} us system "
                f"per request; throughput x{args.concurrency}: front "
                f"{r['throughput_front_rps']:.0f}/s, gateway {r['throughput_gateway_rps']:.0f}/s "
                f"(ratio {r['throughput_ratio']:.2f})"
            )
        write_results(
            "gateway_overhead",
            {
                "requests_per_round": args.requests,
                "rounds": args.rounds,
                "concurrency": args.concurrency,
                "pinned": pinned,
                "load_average": os.getloadavg(),
                "cases": results,
                "gateway_state": http_json(port + 1, "/state")[1],
            },
            args.json,
        )
    finally:
        if gateway is not None:
            gateway.stop()
        pod.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
