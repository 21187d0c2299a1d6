"""Built-in models made on first use and kept under ``$UNDERSTUDY_MODEL_CACHE``.

Every built-in checkpoint (``builtin:tiny-llama``, ``builtin:smollm2-135m``) is
a Hugging Face directory that some code writes offline, deterministically.
`built_once` keeps it under the cache root (default
``$XDG_CACHE_HOME/understudy/models``, ``~/.cache`` where that is unset, as
``hack/setup`` keeps its venvs and uv its wheels), building it into a
temporary directory beside its final place and renaming it there when
complete, under an exclusive ``flock``: a reader never sees half a
checkpoint, and a primary and a shadow that start together build it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from understudy.wire.obs import log_event

__all__ = ["ModelMissing", "built_once", "cache_dir"]

log = logging.getLogger("understudy.engine_shim.model_cache")


class ModelMissing(ValueError):
    """A built-in model's source files are not installed (the message says how to)."""


def cache_dir() -> Path:
    root = os.environ.get("UNDERSTUDY_MODEL_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")  # the XDG spec: ignored unless absolute
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "understudy" / "models"


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def built_once(name: str, build: Callable[[Path], object], root: Path | None = None) -> Path:
    """``root/name``, made by ``build(directory)`` unless it is there already.

    ``name`` must change whenever ``build`` would write other bytes (a format
    number, a seed, the digest of a source file): a cached directory is never
    checked again.
    """
    root = cache_dir() if root is None else root
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with _exclusive(root / f".{name}.lock"):
        if final.is_dir():  # another process built it while we waited
            log_event(log, "model_cached", path=final, waited_s=round(time.monotonic() - t0, 3))
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it 0700; a cache is shared
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log_event(log, "model_built", path=final, seconds=round(time.monotonic() - t0, 3))
    return final
