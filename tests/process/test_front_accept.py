"""The one instant of a connection's life in which the front alone holds it:
between its ``accept`` and the copy the lock server keeps. The copy goes
first, so a front killed right after it, before anything else the accept
does (the connection's record is a file to create: tens of microseconds),
leaves the connection held, and the next front answers it (docs/connections.md,
"A loss in CI on 2026-12-02"). The failpoint ``front.accept.record`` kills
the front at exactly that place, on every connection it accepts;
``front.accept.header`` a step later, with the record's file made and its
header not written (an empty record: CI's reset of 2026-12-05). And one
later place of the same kind, ``front.record.compact``: the record of a
kept-alive connection cut back to its header after an answer, the new
header not written yet.
"""

from __future__ import annotations

import http.client
import json

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


def test_a_front_killed_compacting_a_record_answers_the_next_request_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One kept-alive connection, three requests: every front dies as it
    compacts the record after an answer (the cut made, the new header not),
    and the next front, finding the old bases and no records, takes the
    socket's own counts and answers the next request on that connection.
    (It closed the connection, the next request unread: a reset.)"""
    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", "front.record.compact=kill")
    pod = LocalPod(shadows=1, engine="reference")
    try:
        pod.wait_armed(120)
        fronts = {wait_for(pod.front_pid, 30, what="the front answering")}
        conn = http.client.HTTPConnection("127.0.0.1", pod.serve_port, timeout=60)
        try:
            for n in range(3):
                conn.request(
                    "POST", "/v1/embeddings", json.dumps({**REQUEST, "input": f"request {n}"}),
                    {"Content-Type": "application/json"},
                )  # fmt: skip
                resp = conn.getresponse()
                body = json.loads(resp.read())
                assert resp.status == 200, body
                assert body["data"][0]["embedding"]
                fronts.add(wait_for(lambda: pod.front_pid() not in fronts and pod.front_pid(),
                                    30, what="the next front"))  # fmt: skip
        finally:
            conn.close()
        log = pod.log("front")
        assert log.count("rebased=True") >= 2, log[-3000:]
        assert "event=adopt_connection_failed" not in log
    finally:
        pod.close()
