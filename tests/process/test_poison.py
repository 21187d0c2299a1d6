"""Poison isolation in a real pod (docs/poison.md): with failpoint
``engine.poison`` armed, one request among eight clients SIGKILLs every
engine that starts it. The front moves it twice beside the others, runs it
alone, and at the third death answers it a clear 422; every other request
is answered, none failed for it."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import pytest
from localpod import LocalPod, http_json
from procs import wait_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

MARKER = "POISON-PILL-30"
CLIENTS = 8


def _complete(pod: LocalPod, prompt: str, stream: bool) -> tuple[int, object]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
    return http_json(pod.serve_port, "/v1/completions", body, timeout=120)


def _deaths(pod: LocalPod) -> int:
    """Engine processes SIGKILLed so far (each one's respawner logs its restart)."""
    return sum(
        pod.log(name).count("event=restart code=137")
        for name in pod.local_state()["containers"]
        if name.startswith("engine-")
    )


def test_one_poison_among_eight_clients_is_told_after_three_deaths_and_nothing_else_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", f"engine.poison=return({MARKER})")
    pod = LocalPod(engine="llama", shadows=2)
    try:
        pod.wait_armed(180)
        done = threading.Event()
        answers: list[tuple[int, object]] = []

        def innocent(i: int) -> None:
            n = 0
            while not done.is_set() or n == 0:
                answers.append(_complete(pod, f"innocent {i}, request {n}", stream=i % 2 == 0))
                n += 1

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
            clients = [ex.submit(innocent, i) for i in range(CLIENTS - 1)]
            wait_for(lambda: len(answers) >= CLIENTS, 60, what="the innocents answered")
            try:
                status, body = _complete(pod, f"tell me about {MARKER}, please", stream=False)
            finally:
                done.set()
            for c in clients:
                c.result(timeout=180)
        assert status == 422, body
        assert isinstance(body, dict)
        message = body["error"]["message"]
        assert "killed the engine that ran it alone" in message, message
        assert "(3 in all)" in message, message
        assert _deaths(pod) <= 3
        failed = [a for a in answers if a[0] != 200]
        assert not failed, failed[:3]
        streams = [a for a in answers if isinstance(a[1], str)]
        assert streams and all(str(b).rstrip().endswith("data: [DONE]") for _, b in streams)
        assert pod.metric("understudy_front_poison_total") == 1
        assert pod.metric("understudy_front_isolated_total") >= 1
        gave_up = [json.loads(x.split("reason=", 1)[1]) for x in _gave_up(pod)]
        assert len(gave_up) == 1 and "ran it alone" in gave_up[0]
        # the poison told, no suspect waits: what a drill's next round waits for
        assert http_json(pod.front_port, "/state")[1]["isolation"] == "open"
    finally:
        pod.close()


def _gave_up(pod: LocalPod) -> list[str]:
    return [line for line in pod.log("front").splitlines() if "event=gave_up" in line]
