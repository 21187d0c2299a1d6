"""The front door's cost: latency added per request, and throughput, against
the same engine served directly, measured in one run.

A local pod of the synthetic engine (``understudy local up``). "Direct"
sends the request straight to the Active engine's Unix socket (with its
epoch, as the front does); "front" sends it to the pod's serving port. Each
client keeps one HTTP/1.1 connection alive and sends requests back to back.

    python bench/front_overhead.py [--requests 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import http.client
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import print_table, summary, write_results
from localpod import LocalPod, http_json


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("engine", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


def run(make: object, path: str, body: bytes, headers: dict[str, str], n: int) -> list[float]:
    conn = make()  # type: ignore[operator]
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
    make: object, path: str, body: bytes, headers: dict[str, str], n: int, c: int
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    pod = LocalPod(engine="synthetic")
    try:
        active = pod.wait_armed(120)
        sock = active["serving_socket"]
        epoch = {"X-Understudy-Epoch": str(active["epoch"])}
        json_h = {"Content-Type": "application/json"}

        def direct() -> http.client.HTTPConnection:
            return UnixHTTPConnection(sock)

        def front() -> http.client.HTTPConnection:
            return http.client.HTTPConnection("127.0.0.1", pod.serve_port, timeout=30)

        cases = {
            "GET /health": ("/health", b"", {}),
            "POST /v1/checksum": ("/v1/checksum", b"{}", json_h),
        }
        rows: dict[str, dict[str, float]] = {}
        results: dict[str, object] = {}
        for name, (path, body, headers) in cases.items():
            run(direct, path, body, {**headers, **epoch}, 200)  # warm both
            run(front, path, body, headers, 200)
            d = run(direct, path, body, {**headers, **epoch}, args.requests)
            f = run(front, path, body, headers, args.requests)
            rows[f"{name} direct"] = summary(d)
            rows[f"{name} front"] = summary(f)
            tput_d = throughput(
                direct, path, body, {**headers, **epoch}, args.requests, args.concurrency
            )
            tput_f = throughput(front, path, body, headers, args.requests, args.concurrency)
            added = {
                q: rows[f"{name} front"][q] - rows[f"{name} direct"][q] for q in ("p50", "p99")
            }
            results[name] = {
                "direct_s": rows[f"{name} direct"],
                "front_s": rows[f"{name} front"],
                "added_p50_ms": added["p50"] * 1000,
                "added_p99_ms": added["p99"] * 1000,
                "throughput_direct_rps": tput_d,
                "throughput_front_rps": tput_f,
                "throughput_ratio": tput_f / tput_d,
            }
        print_table("sequential latency, one keep-alive connection", rows)
        print()
        for name, r in results.items():
            assert isinstance(r, dict)
            print(
                f"{name:20} front adds p50 {r['added_p50_ms']:.3f} ms, "
                f"p99 {r['added_p99_ms']:.3f} ms; "
                f"throughput x{args.concurrency}: direct {r['throughput_direct_rps']:.0f}/s, "
                f"front {r['throughput_front_rps']:.0f}/s (ratio {r['throughput_ratio']:.2f})"
            )
        metrics = http_json(pod.front_port, "/state")[1]
        write_results(
            "front_overhead",
            {
                "requests": args.requests,
                "concurrency": args.concurrency,
                "cases": results,
                "front_state": metrics,
            },
            args.json,
        )
    finally:
        pod.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
