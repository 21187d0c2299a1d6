"""The one instant of a connection's life in which the front alone holds it:
between its ``accept`` and the copy the lock server keeps. The copy goes
first, so a front killed right after it, before anything else the accept
does (the connection's record is a file to create: tens of microseconds),
leaves the connection held, and the next front answers it (docs/connections.md,
"A loss in CI on 2026-12-02"). The failpoint ``front.accept.record`` kills
the front at exactly that place, on every connection it accepts;
``front.accept.header`` a step later, with the record's file made and its
header not written (an empty record: CI's reset of 2026-12-05).
"""

from __future__ import annotations

import pytest
from localpod import LocalPod, http_json
from procs import wait_for

pytestmark = [pytest.mark.process]

REQUEST = {"input": "a request whose front dies as it accepts it", "encoding_format": "base64"}


@pytest.mark.parametrize("armed", ["front.accept.record=kill", "front.accept.header=kill"])
def test_a_front_killed_at_the_accept_after_the_copy_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, armed: str
) -> None:
    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", armed)
    pod = LocalPod(shadows=1, engine="reference")
    try:
        pod.wait_armed(120)
        first = wait_for(pod.front_pid, 30, what="the front answering")
        # One connection: the front that accepts it dies at the failpoint; the
        # next one adopts it (an adoption is no accept: it does not die).
        status, body = http_json(pod.serve_port, "/v1/embeddings", REQUEST, timeout=60)
        assert status == 200, body
        assert body["data"][0]["embedding"]
        second = wait_for(pod.front_pid, 30, what="the next front answering")
        assert second != first  # the failpoint did kill the front that accepted it
        log = pod.log("front")
        assert "event=adopted" in log and "event=adopt_connection_failed" not in log
        # the next front found the connection held: nothing counted lost
        assert pod.metric("understudy_front_lost_requests_total") == 0
        assert pod.metric("understudy_front_lost_idle_connections_total") == 0
    finally:
        pod.close()
