"""The CUDA driver double for tests: host memory, not a GPU.

``build()`` compiles hack/cuda-double (libcuda.so.1, libnvidia-ml.so.1) into a
cache keyed by the sources' hash. ``GpuDouble`` puts it in front of every
process a test starts: ``LD_LIBRARY_PATH`` names the build, so cuda-python's
``dlopen("libcuda.so.1")`` and pynvml's ``CDLL("libnvidia-ml.so.1")`` find the
double; the test process itself never loads it (the loader reads
``LD_LIBRARY_PATH`` once, at exec). Each test gets its own "machine" (its
devices, memory accounting and control files), so tests never see each
other's memory.

What passes here proves our calls and their semantics against our model of
the driver (hack/cuda-double/cuda_double.c), not against NVIDIA's driver.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "hack" / "cuda-double" / "build"
NAME_PREFIX = "understudy-cuda-double"


def build() -> Path:
    """The directory holding the double's libraries (built once per source hash)."""
    root = os.environ.get("UNDERSTUDY_CUDA_DOUBLE_CACHE")
    args = [str(BUILD), *([root] if root else [])]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        pytest.fail(f"building the CUDA driver double failed:\n{out.stderr}", pytrace=False)
    return Path(out.stdout.strip())


class GpuDouble:
    """One test's machine of the double; its settings go into ``os.environ``
    (through ``monkeypatch``), so every process the test starts inherits them."""

    def __init__(self, lib_dir: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lib_dir = lib_dir
        self.machine = f"t{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.control = tmp / "gpu-control"
        self.control.mkdir(exist_ok=True)
        self._mp = monkeypatch
        path = os.environ.get("LD_LIBRARY_PATH")
        self.set(
            LD_LIBRARY_PATH=f"{lib_dir}:{path}" if path else str(lib_dir),
            UNDERSTUDY_CUDA_DOUBLE_MACHINE=self.machine,
            UNDERSTUDY_CUDA_DOUBLE_CONTROL=str(self.control),
        )

    def set(self, **env: str | None) -> None:
        """Set (or, with None, remove) double settings for processes started from now."""
        for key, value in env.items():
            if value is None:
                self._mp.delenv(key, raising=False)
            else:
                self._mp.setenv(key, value)

    def fail(self, *rules: str) -> None:
        """``fail("cuMemCreate:OUT_OF_MEMORY@2")``: CUDA faults for processes started from now."""
        self.set(UNDERSTUDY_CUDA_DOUBLE_FAIL=",".join(rules) or None)

    def control_line(self, device: int, line: str) -> None:
        """Append ``key=value`` to device ``device``'s control file (read at every call)."""
        with open(self.control / f"gpu{device}", "a") as f:
            f.write(line + "\n")

    def allocations(self, device: int | None = None) -> dict[int, int]:
        """inode -> size of this machine's allocations alive anywhere (fds or
        mappings of any process), seen independently of the double's own count."""
        prefix = f"/memfd:{NAME_PREFIX}:{self.machine}:"
        found: dict[int, int] = {}
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                for fd in (pid_dir / "fd").iterdir():
                    try:
                        link = str(fd.readlink())
                        if link.startswith(prefix):
                            found[fd.stat().st_ino] = _size(link, prefix, device)
                    except OSError:
                        pass
                for line in (pid_dir / "maps").read_text().splitlines():
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(prefix):
                        found[int(parts[4])] = _size(parts[5], prefix, device)
            except OSError:
                continue
        return {ino: size for ino, size in found.items() if size >= 0}

    def used_bytes(self, device: int | None = None) -> int:
        return sum(self.allocations(device).values())

    def holders(self) -> list[str]:
        """Every process that still holds this machine's memory, for messages."""
        prefix = f"/memfd:{NAME_PREFIX}:{self.machine}:"
        out = []
        for pid_dir in Path("/proc").iterdir():
            if pid_dir.name.isdigit():
                try:
                    if prefix in (pid_dir / "maps").read_text() or any(
                        str(fd.readlink()).startswith(prefix) for fd in (pid_dir / "fd").iterdir()
                    ):
                        out.append(f"{pid_dir.name} {(pid_dir / 'cmdline').read_bytes()[:80]!r}")
                except OSError:
                    continue
        return out


def _size(name: str, prefix: str, device: int | None) -> int:
    """``<prefix><device>:<size> (deleted)`` -> size; -1 for another device."""
    dev, _, rest = name[len(prefix) :].partition(":")
    if device is not None and int(dev) != device:
        return -1
    return int(rest.split()[0])


def loaded_libraries(pid: int) -> Iterable[str]:
    """Shared objects mapped by ``pid`` (to tell the double from a driver)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].endswith(".so.1"):
            yield parts[5]
