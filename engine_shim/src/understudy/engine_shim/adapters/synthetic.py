"""The synthetic engine: weights of any size, for size-scaling runs.

``UNDERSTUDY_MODEL=synthetic:8GiB`` (or ``8GiB``) spreads that many bytes over
the pod's devices, in ``--allocations N`` allocations per device (engine
args), filled deterministically: 64-bit word ``i`` of the whole model is
``i * 0x9E3779B97F4A7C15 mod 2**64``. It serves ``POST /v1/checksum``: a
checksum over a fixed sample of 4 KiB pages of every allocation (or over all
bytes with ``{"full": true}``), which must never change across failovers;
``{"hold_ms": N}`` makes a request take N ms more, so a test can have
requests in flight when an engine dies.

It runs on either GMS backend: the bytes go in and out by ``Allocation.write``
and ``read`` (host: through the mapping; cuda: the driver's copies), through a
host buffer of at most 64 MiB, never a view of the allocation. An
allocation's padding past its share of the words is written as zeros, as a
fresh memfd reads, so the checksums are the same on both backends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from aiohttp import web

from understudy.engine_shim.adapters.base import AdapterError
from understudy.gms.client import Allocation, GmsClient

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
META_KEY = "synthetic"
PAGE = 4096
SAMPLES_PER_ALLOC = 16
_CHUNK = 64 * 1024 * 1024  # bytes per copy in or out (the host buffer's size)
_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise AdapterError(f"size {text!r}: expected e.g. 512MiB or 8GiB")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    return int(value) // 8 * 8


def fill(alloc: Allocation, nbytes: int, first_word: int) -> None:
    """Write the deterministic pattern as the first ``nbytes`` (a multiple of
    8) of ``alloc``, words ``first_word`` on, and zeros after them, through
    one host buffer of at most ``_CHUNK`` bytes."""
    buf = np.arange(min(_CHUNK, max(nbytes, alloc.size - nbytes)) // 8, dtype=np.uint64)
    buf += np.uint64(first_word)
    buf *= GOLDEN  # word i is i * GOLDEN; the next chunk's is len(buf) * GOLDEN on
    step = np.uint64(len(buf) * int(GOLDEN) % 2**64)
    for start in range(0, nbytes, _CHUNK):
        if start:
            buf += step
        alloc.write(buf[: min(_CHUNK, nbytes - start) // 8].data, start)
    if nbytes < alloc.size:  # the padding: zeros, whatever the device held before
        buf.fill(0)
        zeros = buf.data.cast("B")
        for start in range(nbytes, alloc.size, len(zeros)):
            alloc.write(zeros[: min(len(zeros), alloc.size - start)], start)


class SyntheticEngine:
    name = "synthetic"

    def __init__(self, model: str, args: tuple[str, ...], devices: tuple[int, ...]) -> None:
        self.devices = devices
        self.total = parse_size(model.removeprefix("synthetic:"))
        self.per_device_allocs = 1
        it = iter(args)
        for arg in it:
            if arg == "--allocations":
                self.per_device_allocs = int(next(it))
            else:
                raise AdapterError(f"unknown synthetic engine argument {arg!r}")
        if self.per_device_allocs < 1:
            raise AdapterError("--allocations must be >= 1")
        self.allocs: list[Allocation] = []
        self.awake = False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checksum")

    def _device_share(self, device_pos: int, n_devices: int) -> int:
        base = self.total // n_devices // 8 * 8
        return self.total - base * (n_devices - 1) if device_pos == n_devices - 1 else base

    def load(self, device: int, session: GmsClient) -> None:
        # Each device holds a contiguous share of the words, in device order.
        pos, n = self.devices.index(device), len(self.devices)
        share = self._device_share(pos, n)
        first_word = sum(self._device_share(p, n) for p in range(pos)) // 8
        sizes = [share // self.per_device_allocs // 8 * 8] * self.per_device_allocs
        sizes[-1] = share - sum(sizes[:-1])
        records = []
        for size in sizes:
            alloc = session.allocate(max(size, 8))
            fill(alloc, size, first_word)
            records.append({"allocation": alloc.id, "first_word": first_word, "bytes": size})
            first_word += size // 8
        session.put_metadata(META_KEY, {"total": self.total, "records": records})

    def attach(self, sessions: Mapping[int, GmsClient]) -> None:
        self.allocs = []
        for device in sorted(sessions):
            meta = sessions[device].metadata().get(META_KEY)
            if meta is None or meta["total"] != self.total:
                raise AdapterError(
                    f"device {device}: GMS holds no synthetic {self.total}-byte model"
                )
            self.allocs.extend(sessions[device].allocations)

    def sleep(self) -> None:
        self.awake = False

    def wake(self) -> None:
        self.checksum(full=False)  # touches a sample of every allocation
        self.awake = True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def health(self) -> tuple[bool, str]:
        return (True, "ok") if self.awake else (False, "not awake")

    def checksum(self, full: bool) -> str:
        h = hashlib.sha256()
        for a in self.allocs:
            if full:
                for start in range(0, a.size, _CHUNK):
                    h.update(a.read(start, min(_CHUNK, a.size - start)))
                continue
            pages = max(1, a.size // PAGE)
            for k in range(SAMPLES_PER_ALLOC):
                p = (k * pages) // SAMPLES_PER_ALLOC
                h.update(a.read(p * PAGE, min(a.size, (p + 1) * PAGE) - p * PAGE))
        return h.hexdigest()

    async def handle_checksum(self, request: web.Request) -> web.Response:
        body: Any = {}
        if request.can_read_body:
            try:
                body = await request.json()
            except (ValueError, RecursionError):  # nested too deep is not JSON to us
                return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be an object"}}, status=400)
        full = bool(body.get("full", False))
        # A request that takes this long on purpose: what the process tests use
        # to have a request in flight when an engine dies or drains.
        hold_ms = body.get("hold_ms", 0)
        if not isinstance(hold_ms, int) or not 0 <= hold_ms <= 60_000:
            return web.json_response(
                {"error": {"message": "hold_ms must be an integer in 0..60000"}}, status=400
            )
        if hold_ms:
            await asyncio.sleep(hold_ms / 1000)
        loop = asyncio.get_running_loop()
        digest = await loop.run_in_executor(self._pool, self.checksum, full)
        return web.json_response({"checksum": digest, "bytes": self.total, "full": full})

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/checksum", self.handle_checksum)]
