"""Failpoint ``engine.poison`` in a real pod: armed with a marker, a llama
engine SIGKILLs itself as it starts a request whose prompt holds the marker,
and serves every other request as before."""

from __future__ import annotations

import contextlib

import pytest
from localpod import LocalPod, http_json
from procs import wait_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

MARKER = "POISON-PILL-7"


def _complete(pod: LocalPod, prompt: str, timeout: float) -> tuple[int, object]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    return http_json(pod.serve_port, "/v1/completions", body, timeout=timeout)


def test_the_marker_kills_the_engine_that_starts_it_and_nothing_else_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", f"engine.poison=return({MARKER})")
    pod = LocalPod(engine="llama")
    try:
        active = pod.wait_armed(120)
        # Near misses are ordinary prompts: answered, by the same process.
        for prompt in ("An understudy waits in the wings", "POISON PILL 7", MARKER[:-1]):
            status, body = _complete(pod, prompt, timeout=60)
            assert status == 200, body
        assert pod.wait_armed()["pid"] == active["pid"]
        assert "event=restart" not in pod.log(active["name"])
        # The poisoned request: the front holds it and moves it on, and each
        # engine that starts it dies; the client's wait is not what is tested.
        with contextlib.suppress(OSError):
            _complete(pod, f"tell me about {MARKER}, please", timeout=2)
        wait_for(
            lambda: "event=restart code=137" in pod.log(active["name"]),
            60,
            what=f"{active['name']} killed by SIGKILL (its respawner's restart, code 137)",
        )
    finally:
        pod.close()
