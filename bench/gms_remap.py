"""GMS wake cost: ``remap`` of N allocations totalling B bytes, RO grant latency,
and — measured in the same run — loading the same bytes from a file.

For every (N, B): a writer allocates N allocations of B/N bytes and fills
them by reading a B-byte file into them (``readinto`` on each mapping; that
read is the baseline, "load the weights from a file", timed). Then it
commits; a reader imports everything and is timed through ``unmap`` +
``remap`` rounds (the wake path: docs/architecture.md, "A wake never waits forever").

Pages: memfd pages exist only once written, so the writer's file read faults
every page in — the weights are resident, as on a GPU. ``remap`` does *not*
fault them into the reader (no MAP_POPULATE): it maps N ranges and the first
touch of each page costs a minor fault later, as CUDA's cuMemMap does not copy
either. That is why remap should not grow with B. ``remap+touch`` (one read
per 4 KiB page) is reported once per config to show what the faults cost.

The file was just written, so it is read from the page cache as far as it fits
(at 8 GiB on a 24 GiB shared machine, partly from disk): close to the
baseline's best case. A cold load from disk or the network is slower still.

The server runs with a 4 KiB granularity so that B/N is exact for every N.

    python bench/gms_remap.py [--quick] [--rounds 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, summary, write_results

from understudy.gms.client import GmsClient, query_state
from understudy.gms.messages import Mode

GiB = 1 << 30
MiB = 1 << 20
PAGE = 4096


def start_server(sock: Path, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "understudy.gms.cli",
            "server",
            "--socket",
            str(sock),
            "--device",
            "0",
            "--granularity",
            str(PAGE),
        ],
        stderr=log.open("ab"),
        env={**os.environ, "UNDERSTUDY_LOG_LEVEL": "WARNING"},
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            query_state(sock, 1)
            return proc
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"GMS server did not start; see {log}") from None
            time.sleep(0.05)


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    chunk = os.urandom(64 * MiB)
    with path.open("wb") as f:
        left = size
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n


def load_from_file(path: Path, client: GmsClient) -> float:
    """Read the file into the allocations in order; returns seconds."""
    t0 = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        for a in client.allocations:
            view = a.view()
            got = 0
            while got < a.size:
                n = f.readinto(view[got:])
                if not n:
                    raise EOFError(path)
                got += n
    return time.perf_counter() - t0


def touch(client: GmsClient) -> float:
    t0 = time.perf_counter()
    total = 0
    for a in client.allocations:
        arr = (ctypes.c_uint8 * a.size).from_address(a.address)
        import numpy as np

        total += int(np.ctypeslib.as_array(arr)[::PAGE].sum())
    return time.perf_counter() - t0


def run_config(sock: Path, data: Path, n: int, total: int, rounds: int) -> dict[str, Any]:
    each = total // n
    writer = GmsClient.connect(sock, Mode.RW, 30)
    for _ in range(n):
        writer.allocate(each)
    file_s = load_from_file(data, writer)
    writer.put_metadata("bench", {"n": n, "bytes": total})
    writer.commit()

    reader = GmsClient.connect(sock, Mode.RO, 30)
    reader.import_all()
    addresses = [a.address for a in reader.allocations]
    remaps: list[float] = []
    unmaps: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        reader.unmap()
        t1 = time.perf_counter()
        reader.remap(30)
        t2 = time.perf_counter()
        unmaps.append(t1 - t0)
        remaps.append(t2 - t1)
    assert [a.address for a in reader.allocations] == addresses
    reader.unmap()
    reader.remap(30)
    touch_s = touch(reader)
    reader.close()
    writer.close()
    return {
        "allocations": n,
        "bytes": total,
        "remap": summary(remaps),
        "unmap": summary(unmaps),
        "touch_after_remap_s": touch_s,
        "file_load_s": file_s,
        "file_load_gib_per_s": total / GiB / file_s,
        "ratio_file_over_remap_p50": file_s / summary(remaps)["p50"],
    }


def ro_grant(sock: Path, rounds: int) -> dict[str, Any]:
    """Connect + hello(RO) → granted, on a committed layout, new connection each time."""
    hold = GmsClient.connect(sock, Mode.RW, 30)
    hold.allocate(MiB)
    hold.commit()
    times: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        c = GmsClient.connect(sock, Mode.RO, 30)
        times.append(time.perf_counter() - t0)
        c.close()
    hold.close()
    return summary(times)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        counts, sizes, rounds, grants = (1, 64, 1024), (64 * MiB, 256 * MiB), args.rounds or 10, 200
    else:
        counts, sizes, rounds, grants = (
            (1, 64, 1024, 4096),
            (1 * GiB, 8 * GiB),
            args.rounds or 30,
            1000,
        )

    with tempfile.TemporaryDirectory(prefix="gms-bench-") as tmp:
        tmpdir = Path(tmp)
        sock = tmpdir / "gms" / "gms_0_weights.sock"
        server = start_server(sock, tmpdir / "server.log")
        data_dir = Path(os.environ.get("GMS_BENCH_DATA_DIR", tempfile.gettempdir()))
        data = data_dir / f"gms-bench-{os.getpid()}.bin"
        results: list[dict[str, Any]] = []
        try:
            grant = ro_grant(sock, grants)
            print_table("RO grant (connect + hello, committed, no writer)", {"ro_grant": grant})
            for total in sizes:
                make_file(data, total)
                for n in counts:
                    r = run_config(sock, data, n, total, rounds)
                    results.append(r)
                    label = f"N={n} B={total / GiB:g}GiB"
                    print_table(label, {"remap": r["remap"], "unmap": r["unmap"]})
                    print(
                        f"  file load {r['file_load_s'] * 1000:.1f} ms "
                        f"({r['file_load_gib_per_s']:.2f} GiB/s, just written); "
                        f"file/remap p50 = {r['ratio_file_over_remap_p50']:.0f}x; "
                        f"touch after remap {r['touch_after_remap_s'] * 1000:.1f} ms"
                    )
        finally:
            data.unlink(missing_ok=True)
            server.terminate()
            server.wait(10)

    by = {(r["allocations"], r["bytes"]): r for r in results}
    growth = {
        str(n): by[(n, sizes[-1])]["remap"]["p50"] / by[(n, sizes[0])]["remap"]["p50"]
        for n in counts
    }
    target_key = (1024, 8 * GiB)
    payload: dict[str, Any] = {
        "quick": args.quick,
        "rounds": rounds,
        "ro_grant": grant,
        "configs": results,
        "remap_p50_growth_largest_over_smallest_bytes": growth,
        "targets": {
            "ro_grant_p50_under_1ms": grant["p50"] < 0.001,
            "remap_8GiB_1024_p50_under_50ms": (
                by[target_key]["remap"]["p50"] < 0.050 if target_key in by else None
            ),
            "remap_8GiB_1024_p99_under_50ms": (
                by[target_key]["remap"]["p99"] < 0.050 if target_key in by else None
            ),
        },
    }
    print(
        f"\nremap p50 growth from {sizes[0] // MiB} MiB to {sizes[-1] // MiB} MiB, by N: {growth}"
    )
    print(f"targets: {payload['targets']}")
    write_results("gms_remap", payload, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
