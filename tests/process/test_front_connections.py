"""Client connections outlive the front (issue 30): the lock server keeps a
copy of each connection the front accepts (``wire.connhold``), the front
writes down what each one has received and been sent (``front.connlog``),
and the next front finishes them.

A local pod of the ``llama`` engine (the tiny random-weight Llama); the
front's process SIGKILLed while clients read, on raw sockets so that what
is compared is every byte: a stream read across the front's death is the
uninterrupted stream's, chunk framing included; a client that stopped
reading gets its whole stream once it reads again, none of it twice; and ten
deaths under eight clients lose nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from localpod import LocalPod
from procs import understudy, wait_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

# the stall a stream sees while the next front starts and adopts it
NEXT_EVENT_BOUND_S = 10.0


@pytest.fixture(scope="module")
def pod():
    p = LocalPod(shadows=1, engine="llama")
    p.wait_armed(180)
    yield p
    p.close()


def _request(max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "What does an understudy do?"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: pod\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )


def _open(pod: LocalPod, max_tokens: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: the window it advertises
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", pod.serve_port))
    s.settimeout(60)
    s.sendall(_request(max_tokens))
    return s


def _read_to_end(s: socket.socket, got: bytearray, gaps: list[float] | None = None) -> None:
    """Until the chunked answer's last chunk."""
    last = time.monotonic()
    while not got.endswith(b"\r\n0\r\n\r\n"):
        data = s.recv(65536)
        assert data, f"the connection closed after {len(got)} bytes: {bytes(got[-200:])!r}"
        now = time.monotonic()
        if gaps is not None:
            gaps.append(now - last)
        last = now
        got += data


def _read_events(s: socket.socket, n: int) -> bytearray:
    """Until the head and ``n`` events are out."""
    got = bytearray()
    while got.count(b"data: ") < n:
        data = s.recv(65536)
        assert data, f"the connection closed after {len(got)} bytes"
        got += data
    return got


def _split(answer: bytes) -> tuple[list[bytes], bytes]:
    """The head's lines but its Date, and the body with its one answer id and
    ``created`` blanked: what two runs of one request have the same. Each
    has one id and one ``created``, in every event."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = [h for h in head.split(b"\r\n") if not h.lower().startswith(b"date:")]
    ids = set(re.findall(rb'"id":"([^"]*)"', body))
    created = set(re.findall(rb'"created":(\d+)', body))
    assert len(ids) == 1 and len(created) == 1, (ids, created)
    (one_id,), (one_created,) = ids, created
    same_size = b"x" * len(one_id), b"0" * len(one_created)  # the chunk sizes stay true
    body = body.replace(b'"id":"%b"' % one_id, b'"id":"%b"' % same_size[0])
    body = body.replace(b'"created":%b' % one_created, b'"created":%b' % same_size[1])
    return lines, body


def _reference(pod: LocalPod, max_tokens: int) -> bytes:
    with _open(pod, max_tokens) as s:
        got = bytearray()
        _read_to_end(s, got)
    return bytes(got)


def _next_front(pod: LocalPod, old: int) -> None:
    """Another front answers its status port (a loaded machine may take a
    moment to answer a probe, though the stream came through it)."""
    wait_for(lambda: pod.front_pid() not in (None, old), 30, 0.1, what="the next front")


def _kill_front(pod: LocalPod) -> int:
    old: int = wait_for(pod.front_pid, 30, 0.1, what="the front answering")
    os.kill(old, signal.SIGKILL)
    return old


def test_a_stream_read_across_the_front_death_is_the_uninterrupted_one_byte_for_byte(
    pod: LocalPod,
) -> None:
    ref_head, ref_body = _split(_reference(pod, 128))
    with _open(pod, 128) as s:
        got = _read_events(s, 4)
        old = _kill_front(pod)
        gaps: list[float] = []
        _read_to_end(s, got, gaps)
    head, body = _split(bytes(got))
    _next_front(pod, old)
    assert head == ref_head
    assert body == ref_body  # ids, created, chunk framing: every byte
    assert max(gaps) < NEXT_EVENT_BOUND_S, max(gaps)
    log = pod.log("front")
    assert "event=adopted" in log and "stream_tokens=" in log


def test_a_client_that_stops_reading_gets_the_whole_stream_after_the_front_death(
    pod: LocalPod,
) -> None:
    """A client that stops reading while its stream runs: hundreds of events
    sit in the kernel's buffers when the front dies, not yet read. The next
    front goes on from the last event the dead one wrote down, and the
    client, reading again, gets the uninterrupted stream: none twice, none
    missing. (The bytes the kernel never took, ``connlog.plan``'s tail, are
    checked on real sockets in tests/unit/front/test_connlog.py: on loopback
    the kernel takes megabytes before a front has to keep any.)"""
    ref_head, ref_body = _split(_reference(pod, 1500))
    with _open(pod, 1500, rcvbuf=4096) as s:
        time.sleep(3.0)  # reading nothing
        old = _kill_front(pod)
        got = bytearray()
        _read_to_end(s, got)
    head, body = _split(bytes(got))
    _next_front(pod, old)
    assert (head, body) == (ref_head, ref_body)


def test_a_stream_whose_copy_never_reached_the_keeper_is_finished_from_its_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The front's copy of a connection waits in its queue (``conns.hold.queued``:
    a keeper that stopped reading) when the front dies in the middle of the
    stream: its witness gives the keeper the connection under an id of its
    own, and the next front finds the connection's record by its socket and
    finishes the stream. (Without the record's socket the next front had
    nothing to finish it from, and closed it.)"""
    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", "conns.hold.queued=return")
    pod = LocalPod(shadows=1, engine="llama")
    try:
        pod.wait_armed(180)
        with _open(pod, 128) as s:
            got = _read_events(s, 4)
            old = _kill_front(pod)
            _read_to_end(s, got)
        _next_front(pod, old)
        assert _split(bytes(got)) == _split(_reference(pod, 128))
        log = pod.log("front")
        assert "event=witness_kept" in log and "event=record_found id=w" in log, log[-3000:]
    finally:
        pod.close()


def test_ten_front_deaths_under_eight_clients_lose_nothing(pod: LocalPod, tmp_path: Path) -> None:
    """``understudy drill --sidecar front``: streaming and not, chat and
    completions, greedy; every request answered, every answer its kind's."""
    out = tmp_path / "front-drill.json"
    run = subprocess.run(
        [
            *understudy(
                "drill", "--dir", str(pod.dir), "--sidecar", "front", "--kills", "10",
                "--clients", "8", "--max-tokens", "48", "--output", str(out),
            )
        ],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    sys.stdout.write(run.stdout[-3000:])
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["refused"] == 0, report["rounds"]
    assert not report["different_answers"] and report["split_brain"] == 0
    assert report["passed"], run.stdout[-3000:]
    assert report["requests"] > 100
    wait_for(lambda: pod.front_pid() is not None, 30, what="the front answering")
