"""A GMS client in its own process, driven by JSON lines on stdin.

On the cuda backend (a GPU, or the CUDA driver double) bytes move by the
driver's copies (devmem.py) instead of through host views.

Each command line gets one JSON reply line on stdout; a lost connection is
reported asynchronously as {"event": "lost"}. Run: python agent.py
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import devmem
import numpy as np

from understudy.gms.client import GmsClient
from understudy.gms.kvclient import KvSession
from understudy.gms.messages import Mode
from understudy.wire import deathword
from understudy.wire.serving import heartbeat_path

_out = threading.Lock()
MULT = np.uint64(0x9E3779B97F4A7C15)
CHUNK = 8 << 20  # uint64 elements per chunk (64 MiB)


def emit(doc: dict[str, Any]) -> None:
    with _out:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()


def pattern(start: int, n: int, seed: int) -> np.ndarray:
    return (np.arange(start, start + n, dtype=np.uint64) * MULT) ^ np.uint64(seed)


def fill(arr: np.ndarray, seed: int) -> None:
    for i in range(0, arr.size, CHUNK):
        n = min(CHUNK, arr.size - i)
        arr[i : i + n] = pattern(i, n, seed)


def verify(arr: np.ndarray, seed: int) -> bool:
    return all(
        np.array_equal(
            arr[i : i + min(CHUNK, arr.size - i)], pattern(i, min(CHUNK, arr.size - i), seed)
        )
        for i in range(0, arr.size, CHUNK)
    )


def smaps() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        out[key.strip()] = int(rest.split()[0]) * 1024
    return out


class Agent:
    def __init__(self) -> None:
        self.client: GmsClient | None = None
        self.kept: list[np.ndarray] = []  # views built from raw addresses
        self.kept_ptrs: list[tuple[int, int]] = []  # cuda: (index, device pointer) kept alike
        self.kv: KvSession | None = None
        self.kv_ro: KvSession | None = None  # a read-only view (kv_peek)

    def c(self) -> GmsClient:
        assert self.client is not None
        return self.client

    @property
    def cuda(self) -> bool:
        return self.client is not None and self.client.backend == "cuda"

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = getattr(self, f"op_{cmd['op']}", None)
        if op is None:
            raise ValueError(f"unknown op {cmd['op']}")
        result: dict[str, Any] = op(cmd)
        return result

    # --- one method per op ---------------------------------------------------

    def op_connect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.client = GmsClient.connect(
            cmd["path"],
            Mode(cmd["mode"]),
            cmd["timeout"],
            on_lost=lambda exc: emit({"event": "lost", "error": str(exc)}),
        )
        return {"granted": self.c().granted_mode, "layout_hash": self.c().layout_hash}

    def op_allocate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        a = self.c().allocate(cmd["size"], cmd.get("tag", "weights"))
        return {"id": a.id, "address": a.address, "size": a.size}

    def op_fill(self, cmd: dict[str, Any]) -> dict[str, Any]:
        a = self.c().allocations[cmd["index"]]
        if self.cuda:
            devmem.fill(self.c(), a, cmd["seed"])
        else:
            fill(a.array("uint64"), cmd["seed"])
        return {}

    def op_put_metadata(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.c().put_metadata(cmd["key"], cmd["value"])
        return {}

    def op_commit(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"layout_hash": self.c().commit()}

    def op_import(self, cmd: dict[str, Any]) -> dict[str, Any]:
        allocs = self.c().import_all()
        return {
            "allocations": [{"id": a.id, "address": a.address, "size": a.size} for a in allocs],
            "metadata": self.c().metadata(),
        }

    def op_verify(self, cmd: dict[str, Any]) -> dict[str, Any]:
        a = self.c().allocations[cmd["index"]]
        if self.cuda:
            return {"equal": devmem.verify(self.c(), a, cmd["seed"])}
        return {"equal": verify(a.array("uint64"), cmd["seed"])}

    def op_keep_view(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Keep what an engine keeps from before sleep: its tensors."""
        a = self.c().allocations[cmd["index"]]
        if self.cuda:  # a device pointer
            self.kept_ptrs.append((cmd["index"], a.address))
            return {"kept": len(self.kept_ptrs) - 1}
        # a numpy array built from the raw address
        raw = (ctypes.c_uint64 * (a.size // 8)).from_address(a.address)
        self.kept.append(np.ctypeslib.as_array(raw))
        return {"kept": len(self.kept) - 1}

    def op_verify_kept(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self.cuda:
            index, ptr = self.kept_ptrs[cmd["kept"]]
            a = self.c().allocations[index]
            return {"equal": devmem.verify(self.c(), a, cmd["seed"], address=ptr)}
        return {"equal": verify(self.kept[cmd["kept"]], cmd["seed"])}

    def op_write(self, cmd: dict[str, Any]) -> dict[str, Any]:
        a = self.c().allocations[cmd["index"]]
        if self.cuda:
            devmem.write(self.c(), a.address, b"x")  # DeviceCopyError if read-only
            return {"wrote": True}
        raw = (ctypes.c_char * a.size).from_address(a.address)
        raw[0] = b"x"  # faults (SIGSEGV) if the mapping is read-only
        return {"wrote": True}

    def op_device_health(self, cmd: dict[str, Any]) -> dict[str, Any]:
        healthy, reason = self.c().device_health()
        return {"healthy": healthy, "reason": reason}

    def op_cuda_context(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """What an engine has before it connects: a current context on the device."""
        from understudy.gms.backends.cuda_vmm import CudaVmmMapper

        CudaVmmMapper(cmd["device"])
        return {}

    def op_mem_info(self, cmd: dict[str, Any]) -> dict[str, Any]:
        free, total = devmem.mem_info()
        return {"free": free, "total": total}

    def op_addresses(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"addresses": [a.address for a in self.c().allocations]}

    def op_unmap(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.c().unmap()
        return {}

    def op_remap(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            self.c().remap(cmd["timeout"])
        finally:
            self.last_elapsed = time.monotonic() - t0
        return {"elapsed": self.last_elapsed}

    def op_readopt(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """GMS restarted under this mapped client: give the layout back."""
        return {"how": self.c().readopt(cmd["timeout"]), "layout_hash": self.c().layout_hash}

    def op_state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        report: dict[str, Any] = self.c().state().model_dump(mode="json")
        return report

    def op_smaps(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return dict(smaps())

    def op_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.c().close()
        return {}

    # --- the KV pool (a session of its own) --------------------------------------

    def op_kv_acquire(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.kv = KvSession.acquire(
            cmd["path"],
            epoch=cmd["epoch"],
            size=cmd["size"],
            spec=cmd.get("spec", "spec"),
            timeout=cmd["timeout"],
            name=cmd["name"],
            on_lost=lambda exc: emit({"event": "kv_lost", "error": str(exc)}),
        )
        kv = self.kv
        return {
            "created": kv.created,
            "previous_epoch": kv.previous_epoch,
            "size": kv.size,
            "allocation_id": kv.allocation_id,
        }

    def op_kv_fill(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.kv is not None
        devmem.fill(self.kv, self.kv, cmd["seed"])  # type: ignore[arg-type]  # address, size, backend
        return {}

    def op_kv_verify(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.kv is not None
        return {"equal": devmem.verify(self.kv, self.kv, cmd["seed"])}  # type: ignore[arg-type]

    def op_kv_peek(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.kv_ro = KvSession.peek(
            cmd["path"], size=cmd["size"], spec=cmd.get("spec", "spec"), timeout=5, name="reader"
        )
        ro = self.kv_ro
        return {"writable": ro.writable, "previous_epoch": ro.previous_epoch, "size": ro.size}

    def op_kv_peek_verify(self, cmd: dict[str, Any]) -> dict[str, Any]:
        ro = self.kv_ro
        assert ro is not None
        if ro.backend == "host":
            assert ro.view().readonly
        return {"equal": devmem.verify(ro, ro, cmd["seed"]), "alive": ro.alive()}  # type: ignore[arg-type]

    def op_kv_peek_write(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Write one byte through the read-only mapping: the kernel kills us."""
        ro = self.kv_ro
        assert ro is not None
        ctypes.memset(ro.address, 0xFF, 1)
        return {}

    def op_kv_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.kv is not None
        self.kv.close()
        return {}

    # --- as an engine dies ---------------------------------------------------------

    def op_arm_death_word(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The word the engine shim arms beside its heartbeat (wire.deathword)."""
        deathword.arm(deathword.word_path(heartbeat_path(Path(cmd["run_dir"]), cmd["name"])))
        return {}

    def op_fork_holder(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A child that holds every connection of this process open, asleep: this
        process's death then closes none of them (as a teardown still under way)."""
        child = os.fork()
        if child == 0:
            time.sleep(3600)
            os._exit(0)
        return {"child": child}


def main() -> None:
    agent = Agent()
    emit({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            emit({"ok": True})
            return
        t0 = time.monotonic()
        try:
            result = agent.handle(cmd)
            emit({"ok": True, **result})
        except Exception as exc:
            emit(
                {
                    "ok": False,
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "elapsed": time.monotonic() - t0,
                    "trace": traceback.format_exc(limit=3),
                }
            )


if __name__ == "__main__":
    main()
