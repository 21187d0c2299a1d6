"""Which python runs a ``vllm`` engine.

vLLM (and torch) live in their own, heavy venv, never in ours. An engine of
the ``vllm`` adapter therefore runs under that venv's python:

1. ``--engine-python`` (``engine run``), else
2. ``UNDERSTUDY_VLLM_PYTHON``, else
3. this python (an image that installed vLLM next to our wheels).

The runtime knows nothing of repository checkouts: whoever starts an engine
from a checkout (``understudy local up``, the tests) resolves the checkout's
vLLM venv and its sources (``understudy.tools.checkout``) and passes them in
as ``--engine-python`` / ``UNDERSTUDY_VLLM_PYTHON`` and ``PYTHONPATH``; the
re-executed engine inherits that environment as it is.
"""

from __future__ import annotations

import importlib.util
import os
import sys

ENV = "UNDERSTUDY_VLLM_PYTHON"
# Set in an engine this module started under another python: it runs there.
REEXEC_MARK = "UNDERSTUDY_ENGINE_PYTHON_CHOSEN"


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_python(explicit: str | None = None) -> str:
    """The python to run a vllm engine with (see the module)."""
    return explicit or os.environ.get(ENV) or sys.executable
