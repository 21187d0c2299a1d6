"""The llama engine over GMS in its own process, driven by JSON lines on stdin.

    python llama_agent.py MODEL_DIR

Each command gets one JSON reply line ({"ok": true, ...} or {"ok": false,
"error": ...}):

  {"op": "connect", "path": P, "mode": "RW_OR_RO" | "RO", "timeout": S}
      RW: engine.load + commit; RO: import. Then attach and wake, as the shim does.
  {"op": "generate", "prompts": [text, ...], "params": {...}, "resumes": [[id, ...], ...]}
      every prompt at once (one batch); replies {"tokens": [[id, ...], ...], "finish": [...]}
  {"op": "placement"}
      where the model's tensors live: inside the GMS allocation, read-only, not copied
  {"op": "sleep_wake", "timeout": S}
      engine.sleep, unmap, remap, engine.wake: a standby's path to Active
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from typing import Any

from understudy.engine_shim.adapters.llama import LlamaEngine
from understudy.engine_shim.generation import SamplingParams
from understudy.gms.client import GmsClient
from understudy.gms.messages import Granted, Mode


def emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


class Agent:
    def __init__(self, model_dir: str) -> None:
        self.engine = LlamaEngine(model_dir)
        self.session: GmsClient | None = None

    def s(self) -> GmsClient:
        assert self.session is not None
        return self.session

    async def generate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        params = SamplingParams(**cmd["params"])
        prompts = [self.engine.encode(t) for t in cmd["prompts"]]
        resumes = cmd.get("resumes") or [[] for _ in prompts]

        async def one(prompt: list[int], resume: list[int]) -> list[Any]:
            return [s async for s in self.engine.generate(prompt, params, resume)]

        runs = await asyncio.gather(*(one(p, r) for p, r in zip(prompts, resumes, strict=True)))
        return {
            "tokens": [[s.token_id for s in steps] for steps in runs],
            "finish": [steps[-1].finish_reason for steps in runs],
        }

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "connect":
            self.session = GmsClient.connect(cmd["path"], Mode(cmd["mode"]), cmd["timeout"])
            loaded = self.s().granted_mode is Granted.RW
            if loaded:
                self.engine.load(0, self.s())
                self.s().commit()
            else:
                self.s().import_all()
            self.engine.attach({0: self.s()})
            self.engine.wake()
            return {"loaded": loaded, "layout_hash": self.s().layout_hash}
        if op == "generate":
            return asyncio.run(self.generate(cmd))
        if op == "placement":
            assert self.engine.model is not None
            tensors = list(self.engine.model.tensors.values())
            (alloc,) = self.s().allocations
            end = alloc.address + alloc.size
            return {
                "tensors": len(tensors),
                "all_inside": all(
                    alloc.address <= a.ctypes.data and a.ctypes.data + a.nbytes <= end
                    for a in tensors
                ),
                "any_writeable": any(a.flags.writeable for a in tensors),
                "nbytes": sum(a.nbytes for a in tensors),
                "allocation": alloc.size,
            }
        if op == "sleep_wake":
            self.engine.sleep()
            self.s().unmap()
            self.s().remap(cmd["timeout"])
            self.engine.wake()
            return {"healthy": self.engine.health()[0]}
        raise ValueError(f"unknown op {op}")


def main() -> None:
    agent = Agent(sys.argv[1])
    emit({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            emit({"ok": True})
            return
        try:
            emit({"ok": True, **agent.handle(cmd)})
        except Exception as exc:
            emit(
                {
                    "ok": False,
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "trace": traceback.format_exc(limit=5),
                }
            )


if __name__ == "__main__":
    main()
