"""``understudy local up --gms-backend cuda``: the pod rendered with GMS on
CUDA VMM (GMS serves ``--backend cuda``; every engine is told so), and, on a
machine with no GPU, one clear line before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from commands import parse

from understudy.cli import main
from understudy.operator import render
from understudy.tools import local

RUN = Path("/dev/shm/us-gms-backend")


def test_the_flag_renders_gms_on_cuda_and_tells_the_engines() -> None:
    cfg = local.LocalConfig(dir=RUN, engine="torch", shadows=2, gms_backend="cuda")
    by_name = {c.name: c for c in local.containers(cfg)}
    assert parse(by_name[render.GMS].argv)[1]["backend"] == "cuda"
    engines = [c for c in by_name.values() if c.name.startswith("engine-")]
    assert len(engines) == 3
    assert {c.env["UNDERSTUDY_GMS_BACKEND"] for c in engines} == {"cuda"}
    host = {c.name: c for c in local.containers(local.LocalConfig(dir=RUN))}
    assert parse(host[render.GMS].argv)[1]["backend"] == "host"  # the default stays


def test_without_a_gpu_local_up_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No driver anywhere on the path (the CUDA driver double included).
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    problem = local.gpu_problem((0,))
    if problem is None:
        pytest.skip("this machine has a GPU")
    assert problem.startswith("no GPU found for --gms-backend cuda")
    argv = ["local", "up", "--gms-backend", "cuda", "--dir", str(tmp_path / "pod")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no GPU found" in err
    assert "Traceback" not in err
    assert not (tmp_path / "pod" / local.STATE_FILE).exists()  # nothing started
    assert os.environ["LD_LIBRARY_PATH"] == str(tmp_path)
