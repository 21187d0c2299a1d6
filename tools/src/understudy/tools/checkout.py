"""This repository's checkout, for the tools that run the pod from one.

A tool started from a checkout (``understudy local up``, the drills, the
tests) runs a ``vllm`` engine under the checkout's vLLM venv, which
``hack/vllm/venv`` builds and caches. That venv holds our packages as
editable installs of whichever checkout built it (it is shared by
checkouts), so an engine started this way gets this checkout's sources
first on ``PYTHONPATH``; the installed metadata still matters (the
``vllm.general_plugins`` entry point that registers our model loader).

The engine runtime itself never looks for a checkout: it takes the python
it is given (``understudy.engine_shim.python_env``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from understudy.engine_shim import python_env

_MARKER = Path("hack") / "vllm" / "venv"


def root(start: Path | None = None) -> Path | None:
    """The checkout that holds ``start`` (default: this module), if any: the
    nearest directory above it with ``hack/vllm/venv``."""
    here = (start or Path(__file__)).resolve()
    for d in (here, *here.parents):
        if (d / _MARKER).is_file() and (d / "pyproject.toml").is_file():
            return d
    return None


def source_dirs(checkout: Path) -> list[str]:
    """Every component's ``src`` directory of ``checkout``."""
    return [str(p) for p in sorted(checkout.glob("*/src")) if (p / "understudy").is_dir()]


def vllm_python(explicit: str | None = None) -> str:
    """The python with vLLM: ``explicit``, else ``$UNDERSTUDY_VLLM_PYTHON``, else
    (from a checkout, when this python lacks vLLM) the checkout's vLLM venv,
    built on first use (about a minute); else this python."""
    chosen = explicit or os.environ.get(python_env.ENV)
    if chosen:
        return chosen
    checkout = root()
    if checkout is None or python_env.has_vllm():
        return sys.executable
    out = subprocess.run(
        [str(checkout / _MARKER)], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    return str(Path(out) / "bin" / "python")


def engine_env(python: str) -> dict[str, str]:
    """Environment for an engine run by ``python``: the choice itself (so the
    engine does not choose again) and, when that is another python than
    ours, this checkout's sources first."""
    extra = {python_env.ENV: python}
    checkout = root()
    if checkout is None or python == sys.executable:
        return extra
    paths = source_dirs(checkout)
    if old := os.environ.get("PYTHONPATH"):
        paths.append(old)
    return {**extra, "PYTHONPATH": os.pathsep.join(paths)}
