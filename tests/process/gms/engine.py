"""A TP>1 engine in its own process: one worker thread per device.

Like vLLM, the workers connect to their device's GMS in ``init_device`` and
then meet at a barrier (the executor waits for every worker) before loading:
a worker granted RW allocates, fills and commits; a worker granted RO
imports and verifies. Driven by JSON lines on stdin:

  {"op": "worker", "trial": T, "device": D, "devices": N, "socket": P,
   "mode": M, "timeout": S, "size": B, "pause_before_commit": false}
  {"op": "sleep_wake", "trial": T, "timeout": S}   (every worker: unmap, remap, verify)
  {"op": "close_trial", "trial": T}

and reports JSON events on stdout: granted, committed, paused, done, rewoken,
error. On the cuda backend bytes move by driver copies (devmem.py), in the
worker's own thread: that is where its context is current.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from typing import Any

import devmem
import numpy as np

from understudy.gms.client import GmsClient
from understudy.gms.messages import Granted, Mode

_out = threading.Lock()
MULT = np.uint64(0x9E3779B97F4A7C15)


def emit(**doc: Any) -> None:
    with _out:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()


def pattern(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * MULT) ^ np.uint64(seed)


class Trial:
    def __init__(self, devices: int, timeout: float) -> None:
        self.barrier = threading.Barrier(devices, timeout=timeout)
        self.clients: list[GmsClient] = []
        self.lock = threading.Lock()
        self.commands: dict[int, queue.Queue[dict[str, Any]]] = {}


trials: dict[int, Trial] = {}


def worker(cmd: dict[str, Any]) -> None:
    trial_id, device = cmd["trial"], cmd["device"]
    trial = trials[trial_id]
    try:
        client = GmsClient.connect(cmd["socket"], Mode(cmd["mode"]), cmd["timeout"])
        with trial.lock:
            trial.clients.append(client)
            commands = trial.commands.setdefault(device, queue.Queue())
        emit(event="granted", trial=trial_id, device=device, mode=client.granted_mode)
        trial.barrier.wait()  # the executor waits for every worker's init_device
        seed = 1000 + device  # the same model on every start
        if client.granted_mode is Granted.RW:
            a = client.allocate(cmd["size"])
            if client.backend == "cuda":
                devmem.fill(client, a, seed)
            else:
                a.array("uint64")[:] = pattern(a.size // 8, seed)
            client.put_metadata("w", {"alloc": a.id, "offset": 0, "device": device})
            if cmd.get("pause_before_commit"):
                emit(event="paused", trial=trial_id, device=device)
                threading.Event().wait()
            client.commit()
            emit(event="committed", trial=trial_id, device=device)
            loaded = True
        else:
            (a,) = client.import_all()
            if client.backend == "cuda":
                same = devmem.verify(client, a, seed)
            else:
                same = np.array_equal(a.array("uint64"), pattern(a.size // 8, seed))
            if not same:
                raise AssertionError(f"device {device}: imported bytes differ")
            loaded = False
        emit(event="done", trial=trial_id, device=device, loaded=loaded)
        while True:  # later commands for this worker, in its own thread
            order = commands.get()
            address = a.address
            t0 = time.monotonic()
            client.unmap()
            client.remap(order["timeout"])
            elapsed = time.monotonic() - t0
            (a,) = client.allocations
            equal = (
                devmem.verify(client, a, seed)
                if client.backend == "cuda"
                else np.array_equal(a.array("uint64"), pattern(a.size // 8, seed))
            )
            emit(
                event="rewoken",
                trial=trial_id,
                device=device,
                same_address=a.address == address,
                equal=equal,
                elapsed=elapsed,
            )
    except Exception as exc:
        emit(
            event="error", trial=trial_id, device=device, error=type(exc).__name__, message=str(exc)
        )
        trial.barrier.abort()


def main() -> None:
    emit(event="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "worker":
            trials.setdefault(cmd["trial"], Trial(cmd["devices"], cmd["timeout"] + 1.0))
            threading.Thread(target=worker, args=(cmd,), daemon=True).start()
        elif cmd["op"] == "sleep_wake":
            for q in trials[cmd["trial"]].commands.values():
                q.put(cmd)
        elif cmd["op"] == "close_trial":
            trial = trials.pop(cmd["trial"])
            for c in trial.clients:
                c.close()
            emit(event="closed", trial=cmd["trial"])


if __name__ == "__main__":
    main()
