"""Fuzz the pod's HTTP surfaces, live: the front door and the engines.

A whole local pod (``understudy local up --engine synthetic``: lock server,
GMS, front, a primary and a shadow) runs for the test. Each hypothesis example
sends a few raw HTTP/1.1 requests to the front's serving port, the front's
status port, both engines' status ports and the Active engine's serving Unix
socket: any method (HEAD among them), known paths and others, percent-encoded
bytes and query strings, random headers (UTF-8 values, an epoch header, chunked
transfer), bodies that are checksum requests with good and bad arguments,
completion requests, random JSON, JSON nested thousands deep or random bytes,
framed right or wrong (a Content-Length too short or too long, a broken
chunk), and then reads the answer, pipelines a second request, or hangs up
before the answer or halfway through sending.

While a program runs:
- no 5xx, except the front's documented 503 when its hold expires; an
  engine's 409 Not-Active is a 4xx;
- a well-formed request always gets an answer, and a checksum request that
  gets a 200 gets the right checksum.
After every example:
- the front holds no request and no engine is in flight;
- the pod is as it was: the same processes (none restarted), the same Active
  engine at the same epoch, the other one Standby;
- a well-formed checksum request through the front gets the right answer.
At the end, no log of the pod holds a traceback.

Budget: ``UNDERSTUDY_FUZZ_EXAMPLES`` examples (default 40; fuzzkit.py).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import socket
import string
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fuzzkit import (
    deep_json,
    ensure,
    fuzz_settings,
    json_values,
    log_tail,
    timeout_for,
    tracebacks,
    weighted,
)
from hypothesis import given
from hypothesis import strategies as st
from localpod import LocalPod, http_json
from procs import wait_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

TARGETS = (
    "front",
    "front",
    "front",
    "front-status",
    "engine-status-0",
    "engine-status-1",
    "engine-serving",
)
PATHS = (
    "/v1/checksum",
    "/v1/checksum",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/models",
    "/health",
    "/live",
    "/ready",
    "/startup",
    "/state",
    "/metrics",
    "/pressure",
    "/",
)
METHODS = ("GET", "POST", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")
# Characters a path may hold as they are (RFC 3986 pchar, less "%").
PCHARS = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@/"
WELL_FORMED_WAIT_S = 15.0  # a well-formed request unanswered this long is a hang

# ------------------------------------------------------------ requests ----


@dataclass(frozen=True)
class Request:
    target: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    framing: str  # length | none | short | long | chunked | bad-chunk
    how: str  # read | pipeline | hang-up | half-sent

    @property
    def well_formed(self) -> bool:
        token = set(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~")
        return (
            self.method in METHODS  # aiohttp's parser refuses methods it does not know
            and self.path.startswith("/")
            and all(0x21 <= ord(c) <= 0x7E for c in self.path)
            and all(
                n and set(n) <= token and all(c == "\t" or " " <= c != "\x7f" for c in v)
                for n, v in self.headers
            )
            and self.framing in ("length", "chunked")
            and not self._framing_headers()
            # aiohttp refuses a repeated User-Agent, Content-Type, …: keep it simple
            and len({n.lower() for n, _ in self.headers}) == len(self.headers)
        )

    def _framing_headers(self) -> bool:
        names = {n.lower() for n, _ in self.headers}
        return bool(names & {"content-length", "transfer-encoding", "expect", "host"})

    def render(self) -> bytes:
        head = [f"{self.method} {self.path} HTTP/1.1", "Host: fuzz"]
        head += [f"{n}: {v}" for n, v in self.headers]
        body = self.body
        match self.framing:
            case "length":
                head.append(f"Content-Length: {len(body)}")
            case "short":
                head.append(f"Content-Length: {max(0, len(body) - 1)}")
            case "long":
                head.append(f"Content-Length: {len(body) + 10}")
            case "chunked":
                head.append("Transfer-Encoding: chunked")
                body = (
                    f"{len(body):x}\r\n".encode() + body + b"\r\n" if body else b""
                ) + b"0\r\n\r\n"
            case "bad-chunk":
                head.append("Transfer-Encoding: chunked")
                body = b"zz\r\n" + body + b"\r\n0\r\n\r\n"
        return ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogatepass") + body

    @property
    def checksum(self) -> bool:
        """A checksum request whose 200 must carry the right checksum."""
        return self.method == "POST" and self.path.split("?")[0] == "/v1/checksum"

    def checksum_answer(self) -> tuple[int, bool | None] | None:
        """The synthetic engine's answer to this request, by its rules: 200 and
        whether the checksum is the full one, or 400. None: no prediction (not a
        plain checksum request, or a header that changes the answer)."""
        names = {n.lower() for n, _ in self.headers}
        if not (
            self.checksum
            and self.well_formed
            and self.target in ("front", "engine-serving")
            and (self.framing == "length" or self.target == "front")
            and not names & {"content-type", "x-understudy-epoch"}
        ):
            return None
        if not self.body:
            return 200, False
        try:
            doc = json.loads(self.body.decode("utf-8"))
        except (ValueError, RecursionError):
            return 400, None
        if not isinstance(doc, dict):
            return 400, None
        hold = doc.get("hold_ms", 0)
        if not isinstance(hold, int) or not 0 <= hold <= 60_000:
            return 400, None
        return 200, bool(doc.get("full", False))


def _pct(data: bytes) -> str:
    return "".join(f"%{b:02X}" for b in data)


paths = weighted(
    (st.sampled_from(PATHS), 10),
    (st.tuples(st.sampled_from(PATHS), st.text(PCHARS, max_size=8)).map("/".join), 2),
    (
        st.tuples(st.sampled_from(PATHS), st.binary(min_size=1, max_size=6).map(_pct)).map("".join),
        2,
    ),
    (st.tuples(st.sampled_from(PATHS), st.text(PCHARS + "%", max_size=10)).map("?".join), 2),
    (st.text(PCHARS, max_size=12).map(lambda s: "/" + s), 1),
    (st.text(max_size=12), 1),
    (st.just("*"), 1),
)
header_names = weighted(
    (
        st.sampled_from(
            [
                "Content-Type",
                "Accept",
                "Authorization",
                "User-Agent",
                "X-Understudy-Epoch",
                "Connection",
                "OpenAI-Organization",
                "X-Request-Id",
            ]
        ),
        8,
    ),
    (st.sampled_from(["Content-Length", "Transfer-Encoding", "Expect", "Host"]), 1),
    (st.text(string.ascii_letters + "-", min_size=1, max_size=10), 1),
    (st.text(max_size=6), 1),
)
header_values = weighted(
    (st.sampled_from(["application/json", "text/plain", "close", "keep-alive", "1", "*/*"]), 4),
    (st.text(string.printable.strip() + " ", max_size=20), 3),
    (st.text(st.characters(exclude_categories=["Cs", "Cc"]), max_size=12), 3),
    (st.text(max_size=8), 1),
)


@st.composite
def checksum_docs(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if draw(st.booleans()):
        doc["hold_ms"] = draw(
            weighted(
                (st.integers(0, 300), 6),
                (st.integers(-(2**70), -1) | st.integers(60_001, 2**70), 1),
                (json_values, 1),
            )
        )
    if draw(st.booleans()):
        doc["full"] = draw(weighted((st.booleans(), 4), (json_values, 1)))
    if draw(weighted((st.just(False), 6), (st.just(True), 1))):
        doc[draw(st.text(max_size=5))] = draw(json_values)
    return doc


@st.composite
def completion_docs(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": draw(st.sampled_from(["synthetic", "x"]) | json_values)}
    doc["prompt" if draw(st.booleans()) else "messages"] = draw(json_values)
    if draw(st.booleans()):
        doc["stream"] = draw(st.booleans() | json_values)
    return doc


bodies = weighted(
    (st.just(b""), 3),
    (checksum_docs().map(lambda d: json.dumps(d).encode()), 8),
    (completion_docs().map(lambda d: json.dumps(d).encode()), 2),
    (json_values.map(lambda v: json.dumps(v).encode()), 1),
    (deep_json(60_000), 2),
    (st.binary(max_size=40), 1),
)

methods = weighted(
    (st.sampled_from(METHODS), 12),
    (st.text(string.ascii_uppercase, max_size=8), 1),
    (st.text(max_size=4), 1),
)
# What a client of each surface would send, so that most requests reach a
# handler; then anything at all.
routes = weighted(
    (st.just(("POST", "/v1/checksum")), 8),
    (st.sampled_from([("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]), 2),
    (st.sampled_from([("GET", p) for p in PATHS] + [("HEAD", "/health")]), 3),
    (st.tuples(methods, paths), 5),
)
headers = st.lists(st.tuples(header_names, header_values), max_size=4).map(tuple)
framings = weighted(
    (st.just("length"), 12),
    (st.just("chunked"), 2),
    (st.sampled_from(["none", "short", "long", "bad-chunk"]), 2),
)
hows = weighted(
    (st.just("read"), 12),
    (st.just("pipeline"), 2),
    (st.sampled_from(["hang-up", "half-sent"]), 2),
)
requests = st.builds(
    lambda target, route, *rest: Request(target, *route, *rest),
    st.sampled_from(TARGETS),
    routes,
    headers,
    bodies,
    framings,
    hows,
)
programs = st.lists(requests, min_size=1, max_size=6)

# ----------------------------------------------------------------- pod ----


class _KeepOpen(io.BufferedReader):
    def close(self) -> None:
        pass  # http.client closes its reader after each answer; the next needs it


class _Stream:
    """A socket as http.client sees it, with one buffered reader for every
    answer on it (one reader per answer would lose what the first read ahead)."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = _KeepOpen(socket.SocketIO(sock, "rb"))

    def makefile(self, *args: object, **kwargs: object) -> io.BufferedReader:
        return self.file


class Pod:
    def __init__(self) -> None:
        self.pod = LocalPod("--model", "16MiB", engine="synthetic")
        self.active = self.pod.wait_armed()
        self.expected = {full: self._checksum(full) for full in (False, True)}
        self.snapshot = self._snapshot()
        self.stats: Counter[str] = Counter()

    def close(self) -> None:
        self.pod.close()

    def _checksum(self, full: bool) -> str:
        status, body = http_json(self.pod.serve_port, "/v1/checksum", {"full": full}, timeout=30)
        assert status == 200, body
        return str(body["checksum"])

    def _snapshot(self) -> dict[str, Any]:
        """What must not change: processes, restarts, who is Active at which epoch."""
        containers = self.pod.local_state()["containers"]
        engines = self.pod.engines()
        return {
            "containers": {n: (c["pid"], c["restarts"]) for n, c in containers.items()},
            "engines": sorted((e["name"], e["pid"], e["state"], e.get("epoch")) for e in engines),
        }

    def logs(self) -> list[Path]:
        return [self.pod.dir / "supervisor.out", *sorted((self.pod.dir / "logs").glob("*.log"))]

    # --- one request -----------------------------------------------------------

    def connect(self, target: str) -> socket.socket:
        if target == "engine-serving":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(self.active["serving_socket"])
            return s
        port = {
            "front": self.pod.serve_port,
            "front-status": self.pod.front_port,
            "engine-status-0": self.pod.status_ports[0],
            "engine-status-1": self.pod.status_ports[1],
        }[target]
        return socket.create_connection(("127.0.0.1", port), timeout=5)

    def send(self, req: Request) -> None:
        data = req.render()
        with contextlib.closing(self.connect(req.target)) as s:
            match req.how:
                case "half-sent":
                    s.sendall(data[: len(data) // 2])
                    return
                case "hang-up":
                    s.sendall(data)
                    return
                case "pipeline":
                    s.sendall(data + data)
                    n = 2
                case _:
                    s.sendall(data)
                    n = 1
            wait = WELL_FORMED_WAIT_S if req.well_formed else 2.0
            s.settimeout(wait)
            stream = _Stream(s)
            for _ in range(n):
                if not self._answer(stream, req):
                    break

    def _answer(self, s: _Stream, req: Request) -> bool:
        """Read and judge one answer; False when there is none (fine for bad input)."""
        resp = http.client.HTTPResponse(s, method=req.method)  # type: ignore[arg-type]
        try:
            resp.begin()
            body = resp.read()
        except (TimeoutError, http.client.HTTPException, ConnectionError) as exc:
            ensure(
                not req.well_formed or isinstance(exc, http.client.IncompleteRead),
                f"no answer to a well-formed request ({type(exc).__name__}: {exc}): {req}",
            )
            self.stats[f"{req.target}: no answer ({type(exc).__name__})"] += 1
            return False
        self.stats[f"{req.target}: {resp.status}"] += 1
        self._judge(req, resp, body)
        return not resp.will_close

    def _judge(self, req: Request, resp: http.client.HTTPResponse, body: bytes) -> None:
        status = resp.status
        if status >= 500:
            hold_expired = req.target == "front" and status == 503 and b"within the hold" in body
            ensure(hold_expired, f"{status} {body[:300]!r} for {req}")
        if status == 409 and req.target == "engine-serving":
            ensure(resp.getheader("X-Understudy-Not-Active"), f"a 409 without the header: {req}")
        if req.checksum and status == 200 and req.target in ("front", "engine-serving"):
            doc = json.loads(body)
            want = self.expected[doc.get("full") is True]
            ensure(doc.get("checksum") == want, f"wrong checksum {doc} for {req}")
        if (answer := req.checksum_answer()) is not None:
            self.stats["checksum answers predicted"] += 1
            ensure(status == answer[0], f"{status} {body[:300]!r}, not {answer[0]}, for {req}")
            if status == 200:
                ensure(json.loads(body).get("full") is answer[1], f"{body[:300]!r} for {req}")

    # --- after the program --------------------------------------------------------

    def settle(self) -> None:
        def front_idle() -> dict[str, Any] | None:
            _, view = http_json(self.pod.front_port, "/state")
            return view if view["inflight"] == 0 and view["held"] == 0 else None

        try:
            wait_for(front_idle, 10, 0.05, what="the front holds no request")
        except TimeoutError:
            raise AssertionError(
                f"the front still holds: {http_json(self.pod.front_port, '/state')}"
            ) from None
        ensure(
            self._snapshot() == self.snapshot,
            lambda: f"the pod changed: {self._snapshot()}, was {self.snapshot}",
        )
        ensure(
            self._checksum(False) == self.expected[False],
            "a well-formed request got a wrong checksum",
        )
        ensure(http_json(self.pod.front_port, "/ready")[0] == 200, "the front is not ready")

    def run(self, program: list[Request]) -> None:
        self.stats["examples"] += 1
        for req in program:
            self.send(req)
        self.settle()


@pytest.fixture(scope="module")
def pod() -> Iterator[Pod]:
    p = Pod()
    try:
        yield p
    finally:
        p.close()


@timeout_for(setup_s=60, per_example_s=4)
def test_fuzz_front_and_engines(pod: Pod) -> None:
    @fuzz_settings()
    @given(programs)
    def fuzz(program: list[Request]) -> None:
        pod.run(program)

    try:
        fuzz()
    finally:
        print(f"http fuzz: {dict(pod.stats)}")
        for log in pod.logs():
            print(log_tail(log, 30))
    found = {str(log.name): tracebacks(log) for log in pod.logs()}
    assert not any(found.values()), found
