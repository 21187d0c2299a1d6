"""The llama adapter under the shim, as real processes: a primary and a shadow
started together on an empty model cache build builtin:tiny-llama once (under
the cache's lock), the primary loads it into GMS, the shadow imports it, and
after a kill -9 of the active engine the other one wakes and serves."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from localpod import free_port_block, http_json
from procs import Proc, understudy, wait_for

pytestmark = [pytest.mark.process, pytest.mark.slow]


def state(port: int) -> dict | None:
    try:
        code, body = http_json(port, "/state", timeout=1.0)
    except OSError:
        return None
    return body if code == 200 else None


def test_primary_and_shadow_build_the_model_once_and_fail_over(
    tmp_path: Path, shm_path: Path
) -> None:
    run = shm_path
    cache = tmp_path / "models"
    base = free_port_block(2)
    procs = [
        Proc(
            understudy(
                "lockserver",
                "serve",
                "--socket",
                str(run / "lock.sock"),
                "--state-file",
                str(run / "lock.state"),
            ),
            log=tmp_path / "lock.log",
        ),
        Proc(
            understudy(
                "gms",
                "serve",
                "--socket-dir",
                str(run / "gms"),
                "--devices",
                "0",
                "--backend",
                "host",
            ),
            log=tmp_path / "gms.log",
        ),
    ]
    engines = {}
    try:
        for i, role in enumerate(("primary", "shadow")):
            env = {
                "ENGINE_ROLE": role,
                "UNDERSTUDY_ENGINE_NAME": f"engine-{role}",
                "UNDERSTUDY_ENGINE_ADAPTER": "llama",
                "UNDERSTUDY_MODEL_CACHE": str(cache),
                "UNDERSTUDY_RUN_DIR": str(run),
                "UNDERSTUDY_STATUS_PORT": str(base + i),
            }
            proc = Proc(understudy("engine", "run"), env=env, log=tmp_path / f"{role}.log")
            engines[role] = (proc, base + i)

        def settled() -> dict[str, dict] | None:
            states = {role: state(port) for role, (_, port) in engines.items()}
            if any(s is None for s in states.values()):
                return None
            found = sorted(s["state"] for s in states.values())
            return states if found == ["Active", "Standby"] else None

        states = wait_for(settled, 120, 0.2, "one Active and one Standby llama engine")
        assert states["primary"]["weights"] == {"loaded": [0], "imported": []}
        assert states["shadow"]["weights"] == {"loaded": [], "imported": [0]}
        assert all(s["adapter"] == "llama" for s in states.values())
        # one build for both engines, and no half-built leftovers
        assert [p.name for p in cache.iterdir() if p.is_dir()] == ["tiny-llama-f1-s0"]
        active = next(r for r, s in states.items() if s["state"] == "Active")
        other = "shadow" if active == "primary" else "primary"
        code, ready = http_json(engines[active][1], "/ready")
        assert code == 200, ready  # the engine's health() says it serves
        assert Path(states[active]["serving_socket"]).is_socket()
        assert not Path(states[other]["serving_socket"]).exists()  # a standby never listens
        os.kill(engines[active][0].pid, signal.SIGKILL)
        woke = wait_for(
            lambda: (s := state(engines[other][1])) and s["state"] == "Active" and s,
            30,
            0.05,
            "the other engine Active",
        )
        assert woke["epoch"] > states[active]["epoch"]
    finally:
        for proc, _ in engines.values():
            proc.stop()
        for p in procs:
            p.stop()
        shutil.rmtree(run, ignore_errors=True)
