"""An engine started as a spare (``understudy respawn --spare``): it does its
imports ahead of time, binds and joins nothing until its turn, and then
starts as any engine would. The ``vllm`` adapter's spare imports vLLM itself
(seconds of CPU that a promoted spare no longer pays at a failover's re-arm),
on a thread at a restart's lower priority: it starts beside an Active engine."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
from localpod import free_port_block
from procs import PYTHON, understudy, wait_for

from understudy.engine_shim.mainloop import STARTUP_NICE
from understudy.tools import checkout
from understudy.wire import respawn

pytestmark = [pytest.mark.process]


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _spare(
    tmp: Path, adapter: str, extra: dict[str, str]
) -> tuple[subprocess.Popen[bytes], int, int]:
    """An engine process started as a spare; the write end of its go pipe; its
    status port."""
    go_r, go_w = os.pipe()
    port = free_port_block(1)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "ENGINE_ROLE": "shadow",
        "UNDERSTUDY_ENGINE_ADAPTER": adapter,
        "UNDERSTUDY_ENGINE_NAME": "engine-shadow-1",
        "UNDERSTUDY_RUN_DIR": str(tmp),
        "UNDERSTUDY_STATUS_PORT": str(port),
        "UNDERSTUDY_SERVE_PORT": "0",
        "UNDERSTUDY_STARTUP_BUDGET_S": "3",  # no GMS here: after its turn it fails init
        respawn.GO_FD: str(go_r),
        **extra,
    }
    with open(tmp / "engine.log", "ab") as log:
        p = subprocess.Popen(
            understudy("engine", "run"),
            env=env,
            stdout=log,
            stderr=log,
            pass_fds=(go_r,),
            start_new_session=True,
        )
    os.close(go_r)
    return p, go_w, port


def _vllm_python(cwd: Path) -> str:
    """Resolved by a process of its own, as `understudy local up` does: in this
    one tests/vllm passes for an installed vLLM (tests/vllm/conftest.py)."""
    python = subprocess.run(
        [PYTHON, "-c", "from understudy.tools import checkout; print(checkout.vllm_python())"],
        cwd=cwd,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    assert python != PYTHON, "no python with vLLM (hack/vllm/venv)"
    return python


def _vllm_env(cwd: Path, spare_imports: str = "1") -> dict[str, str]:
    """As `understudy local up` runs a vLLM engine (`checkout.engine_env`):
    this checkout's sources first on PYTHONPATH. The shared vLLM venv's own
    paths name whichever checkout built it, which may be gone (a CI clone
    removed: every vLLM spare test failed on ModuleNotFoundError)."""
    env = checkout.engine_env(_vllm_python(cwd))
    assert "PYTHONPATH" in env, env
    return {**env, respawn.SPARE_IMPORTS: spare_imports}


def _prepared(tmp: Path) -> str:
    lines = (tmp / "engine.log").read_text(errors="replace").splitlines()
    return next((line for line in lines if "event=spare_prepared" in line), "")


def _turn_comes(tmp: Path, p: subprocess.Popen[bytes], go_w: int, port: int) -> str:
    """Before the go line: alive, nothing bound. After it: the engine starts,
    deferred as a restart is (the go line says 1 process came before it).
    Its log line ``startup_deferred``."""
    try:
        assert p.poll() is None and _closed(port)
        os.write(go_w, respawn.go_line(1))
        os.close(go_w)
        wait_for(
            lambda: "event=starting" in (tmp / "engine.log").read_text(errors="replace"),
            240,
            0.1,
            what="the engine to start after its turn",
        )
        assert p.wait(60) in (1, 6)  # no GMS: init fails, as any engine's would
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    lines = (tmp / "engine.log").read_text(errors="replace").splitlines()
    return next(line for line in lines if "event=startup_deferred" in line)


def _deferred_s(line: str) -> float:
    return float(line.split("seconds=", 1)[1].split(maxsplit=1)[0])


def test_a_spare_prepares_then_starts_only_at_its_turn(tmp_path: Path) -> None:
    p, go_w, port = _spare(tmp_path, "llama", {})
    line = wait_for(lambda: _prepared(tmp_path), 60, 0.1, what="the spare prepared")
    assert "adapter=llama" in line and "turn=False" in line
    assert "imported=" not in line  # nothing deferred to name: its module imports all
    assert _deferred_s(_turn_comes(tmp_path, p, go_w, port)) > 0.5  # from its turn
    assert (tmp_path / "engine.log").read_text().count("event=spare_prepared") == 1


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_vllm_spare_imports_vllm_before_its_turn_at_a_lower_priority(tmp_path: Path) -> None:
    p, go_w, port = _spare(tmp_path, "vllm", _vllm_env(tmp_path))
    line = wait_for(lambda: _prepared(tmp_path), 240, 0.2, what="the vLLM spare prepared")
    assert "adapter=vllm" in line and "turn=False" in line
    imported = line.split("imported=", 1)[1].split()[0].split(",")
    assert imported[0] == "vllm" and "vllm.v1.engine.llm_engine" in imported
    assert f"nice={STARTUP_NICE}" in line  # beside the Active, at a restart's priority
    assert _deferred_s(_turn_comes(tmp_path, p, go_w, port)) > 0.5


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_vllm_spare_whose_turn_comes_while_it_imports_spends_its_deferral_importing(
    tmp_path: Path,
) -> None:
    """One window of yielding from the death: the imports past the turn are
    the deferral (vLLM's take seconds, so none is left to wait)."""
    p, go_w, port = _spare(tmp_path, "vllm", _vllm_env(tmp_path))
    assert _deferred_s(_turn_comes(tmp_path, p, go_w, port)) == 0
    line = _prepared(tmp_path)
    assert "turn=True" in line and "imported=vllm," in line


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_without_spare_imports_a_vllm_spare_leaves_vllm_to_its_start(tmp_path: Path) -> None:
    """A Kubernetes pod's engines (the operator does not set it): nice does not
    cross containers' cgroups, so a spare importing vLLM would take the
    Active's CPU at the standby's weight."""
    p, go_w, port = _spare(tmp_path, "vllm", _vllm_env(tmp_path, spare_imports="0"))
    line = wait_for(lambda: _prepared(tmp_path), 120, 0.1, what="the vLLM spare prepared")
    assert "imported=" not in line and "nice=0" in line and "turn=False" in line
    _turn_comes(tmp_path, p, go_w, port)
