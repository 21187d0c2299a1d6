"""The engine adapters a pod can run: named here, once.

An adapter's name is part of the pod contract (``UNDERSTUDY_ENGINE_ADAPTER``,
docs/pod.md): the GpuInstance API's ``engine.adapter``, the engine's own
configuration check, its loader (``engine_shim.adapters.<name>``) and the
local runner's ``--engine`` all take it from this module, so a new adapter is
one member here and its module in ``engine_shim/adapters/``.

Core module: no I/O imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final


class EngineAdapter(StrEnum):
    LLAMA = "llama"
    REFERENCE = "reference"
    SYNTHETIC = "synthetic"
    TORCH = "torch"
    VLLM = "vllm"


NAMES: Final = tuple(a.value for a in EngineAdapter)

# What an adapter serves when no model is named (an engine without
# UNDERSTUDY_MODEL, ``local up`` without ``--model``).
DEFAULT_MODELS: Final[Mapping[EngineAdapter, str]] = {
    EngineAdapter.LLAMA: "builtin:tiny-llama",
    EngineAdapter.REFERENCE: "builtin:all-MiniLM-L6-v2",
    EngineAdapter.SYNTHETIC: "256MiB",
    EngineAdapter.TORCH: "builtin:tiny-llama",
    EngineAdapter.VLLM: "builtin:tiny-llama",
}

# Adapters whose engines need torch, which lives in the vLLM venv, not ours:
# they run under that venv's python (engine_shim.python_env), and a tool run
# from a checkout resolves it for them (tools.checkout).
ENGINE_PYTHON: Final = frozenset({EngineAdapter.TORCH, EngineAdapter.VLLM})
