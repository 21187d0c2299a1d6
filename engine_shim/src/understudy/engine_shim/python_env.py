"""Which python runs a ``vllm`` engine, and with which sources.

vLLM (and torch) live in their own, heavy venv, never in ours. An engine of
the ``vllm`` adapter therefore runs under that venv's python:

1. ``--engine-python`` (``engine run``, ``local up``), else
2. ``UNDERSTUDY_VLLM_PYTHON``, else
3. in a checkout of this repository: the venv ``hack/vllm/venv`` prints
   (built and cached on first use, about a minute), else
4. this python (an image that installed vLLM next to our wheels).

In a checkout, the vLLM venv holds our packages as editable installs of
whichever checkout built it (the venv is cached per requirements, shared by
checkouts), so the engine gets this checkout's sources first on
``PYTHONPATH``. The installed metadata still matters: the ``vllm.general_plugins``
entry point that registers our model loader comes from it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ENV = "UNDERSTUDY_VLLM_PYTHON"
# Set in an engine this module started under another python: it runs there.
REEXEC_MARK = "UNDERSTUDY_ENGINE_PYTHON_CHOSEN"


def checkout_root() -> Path | None:
    """The repository this package runs from, if it runs from one (editable)."""
    root = Path(__file__).resolve().parents[4]
    return root if (root / "hack" / "vllm" / "venv").is_file() else None


def source_dirs(root: Path) -> list[str]:
    return [str(p) for p in sorted(root.glob("*/src")) if (p / "understudy").is_dir()]


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_python(explicit: str | None = None) -> str:
    """The python to run a vllm engine with (see the module)."""
    if explicit:
        return explicit
    if env := os.environ.get(ENV):
        return env
    root = checkout_root()
    if root is None or has_vllm():
        return sys.executable
    out = subprocess.run(
        [str(root / "hack" / "vllm" / "venv")], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    return str(Path(out) / "bin" / "python")


def engine_env(python: str) -> dict[str, str]:
    """Environment additions for an engine run by ``python``: this checkout's
    sources first when that is another python than ours."""
    extra = {REEXEC_MARK: "1"}
    root = checkout_root()
    if root is None or python == sys.executable:
        return extra
    paths = source_dirs(root)
    if old := os.environ.get("PYTHONPATH"):
        paths.append(old)
    return {**extra, "PYTHONPATH": os.pathsep.join(paths)}
