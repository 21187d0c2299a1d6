"""The front door's cost: latency added per request, and throughput, against
the same engine served directly, measured in one run.

A local pod of the synthetic engine (``understudy local up``). "Direct"
sends the request straight to the Active engine's Unix socket (with its
epoch, as the front does); "front" sends it to the pod's serving port. Each
client keeps one HTTP/1.1 connection alive and sends requests back to back.

Direct and front alternate in ``--rounds`` rounds of ``--requests`` each, so
a drift of the machine (another process waking, the CPU's clock) lands on
both alike. The added latency is reported per round (front p50 minus direct
p50 of that round; the median round is the headline) and pooled. The
front's CPU time per request (user and system, from /proc) is what the added
latency is mostly made of on a machine with two cores.

    python bench/front_overhead.py [--requests 1000] [--rounds 5] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import print_table, summary, write_results
from localpod import LocalPod, http_json

Make = Callable[[], http.client.HTTPConnection]


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("engine", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def run(make: Make, path: str, body: bytes, headers: dict[str, str], n: int) -> list[float]:
    conn = make()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("POST" if body else "GET", path, body or None, headers)
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t0)
        assert resp.status == 200, resp.status
    conn.close()
    return out


def throughput(
    make: Make, path: str, body: bytes, headers: dict[str, str], n: int, c: int
) -> float:
    threads = [
        threading.Thread(target=run, args=(make, path, body, headers, n // c)) for _ in range(c)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (n // c) * c / (time.perf_counter() - t0)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """A process's user and system CPU time so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


@dataclass(frozen=True)
class Side:
    """One way to reach the engine: a connection factory and its headers."""

    connect: Callable[[], http.client.HTTPConnection]
    headers: dict[str, str]


def measure_case(
    direct: Side, front: Side, path: str, body: bytes, front_pid: int, args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, float], dict[str, object]]:
    """Interleaved rounds of one request shape: direct, then through the front."""
    run(direct.connect, path, body, direct.headers, 200)  # warm both
    run(front.connect, path, body, front.headers, 200)
    d_all: list[float] = []
    f_all: list[float] = []
    added: list[float] = []
    user = system = 0.0
    tput_d: list[float] = []
    tput_f: list[float] = []
    for _ in range(args.rounds):
        d = run(direct.connect, path, body, direct.headers, args.requests)
        u0, s0 = cpu_seconds(front_pid)
        f = run(front.connect, path, body, front.headers, args.requests)
        u1, s1 = cpu_seconds(front_pid)
        user, system = user + u1 - u0, system + s1 - s0
        added.append(statistics.median(f) - statistics.median(d))
        d_all += d
        f_all += f
        tput_d.append(
            throughput(direct.connect, path, body, direct.headers, args.requests, args.concurrency)
        )
        tput_f.append(
            throughput(front.connect, path, body, front.headers, args.requests, args.concurrency)
        )
    d_sum, f_sum = summary(d_all), summary(f_all)
    served = args.rounds * args.requests
    result: dict[str, object] = {
        "direct_s": d_sum,
        "front_s": f_sum,
        "added_p50_ms": statistics.median(added) * 1000,
        "added_p50_ms_rounds": [a * 1000 for a in added],
        "added_p50_ms_pooled": (f_sum["p50"] - d_sum["p50"]) * 1000,
        "added_p99_ms_pooled": (f_sum["p99"] - d_sum["p99"]) * 1000,
        "front_cpu_us_per_request": {"user": user / served * 1e6, "system": system / served * 1e6},
        "throughput_direct_rps": statistics.fmean(tput_d),
        "throughput_front_rps": statistics.fmean(tput_f),
        "throughput_ratio": statistics.fmean(tput_f) / statistics.fmean(tput_d),
    }
    return d_sum, f_sum, result


def print_added(results: dict[str, dict[str, object]], concurrency: int) -> None:
    for name, r in results.items():
        rounds = r["added_p50_ms_rounds"]
        cpu = r["front_cpu_us_per_request"]
        assert isinstance(rounds, list) and isinstance(cpu, dict)
        print(
            f"{name:18} front adds p50 {r['added_p50_ms']:.3f} ms (median round; rounds "
            f"{min(rounds):.3f}-{max(rounds):.3f}; pooled {r['added_p50_ms_pooled']:.3f}), "
            f"p99 {r['added_p99_ms_pooled']:.3f} ms pooled; front CPU {cpu['user']:.0f} us "
            f"user + {cpu['system']:.0f} us system per request; throughput "
            f"x{concurrency}: direct {r['throughput_direct_rps']:.0f}/s, front "
            f"{r['throughput_front_rps']:.0f}/s (ratio {r['throughput_ratio']:.2f})"
        )


# The request shapes measured: a GET the engine answers at once, and a small
# POST with a body (the synthetic engine's checksum of its weights' layout).
CASES: dict[str, tuple[str, bytes, dict[str, str]]] = {
    "GET /health": ("/health", b"", {}),
    "POST /v1/checksum": ("/v1/checksum", b"{}", {"Content-Type": "application/json"}),
}


def parse_args(
    doc: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="per round and side")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", type=Path)
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def main() -> int:
    args = parse_args(__doc__)
    pod = LocalPod(engine="synthetic")
    try:
        active = pod.wait_armed(120)
        sock = active["serving_socket"]
        epoch = {"X-Understudy-Epoch": str(active["epoch"])}
        rows: dict[str, dict[str, float]] = {}
        results: dict[str, dict[str, object]] = {}
        for name, (path, body, headers) in CASES.items():
            direct = Side(lambda: UnixHTTPConnection(sock), {**headers, **epoch})
            front = Side(
                lambda: http.client.HTTPConnection("127.0.0.1", pod.serve_port, timeout=30),
                headers,
            )
            d_sum, f_sum, results[name] = measure_case(
                direct, front, path, body, pod.front_pid() or 0, args
            )
            rows[f"{name} direct"], rows[f"{name} front"] = d_sum, f_sum
        print_table(
            f"sequential latency, one keep-alive connection, {args.rounds} interleaved rounds", rows
        )
        print()
        print_added(results, args.concurrency)
        write_results(
            "front_overhead",
            {
                "requests_per_round": args.requests,
                "rounds": args.rounds,
                "concurrency": args.concurrency,
                "cases": results,
                "front_state": http_json(pod.front_port, "/state")[1],
            },
            args.json,
        )
    finally:
        pod.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
