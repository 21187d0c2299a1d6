"""The drill's load: clients that keep request streams going against a pod.

Each ``Client`` thread sends one request at a time, cycling through the
``Kind`` s of request the engine serves (``kinds_for``), and records a
``series.Sample`` per request: when it started and ended, whether its answer
was right and its digest, and for a stream the arrival time of each token
(from which ``stalls`` reads a stream's stall at a kill).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from understudy.tools.series import Sample, Tally

REQUEST = {
    "input": "Understudy keeps a sleeping shadow engine in the same pod.",
    "encoding_format": "base64",
}


@dataclass(frozen=True)
class Kind:
    """One kind of request a drill client sends, and how to read its answer."""

    name: str
    path: str
    body: dict[str, Any]
    streaming: bool = False


def kinds_for(adapter: str, max_tokens: int = 32) -> list[Kind]:
    """What the drill sends to an engine of this adapter: every answer of a
    kind must be identical (the same request each time, greedy decoding)."""
    if adapter == "synthetic":
        return [Kind("checksum", "/v1/checksum", {})]
    if adapter == "reference":
        return [Kind("embeddings", "/v1/embeddings", REQUEST)]
    chat = {
        "messages": [{"role": "user", "content": "Tell me about understudies."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    completion = {
        "prompt": "An understudy learns the lines of",
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return [
        Kind("chat-stream", "/v1/chat/completions", {**chat, "stream": True}, streaming=True),
        Kind("completion", "/v1/completions", completion),
        Kind(
            "completion-stream",
            "/v1/completions",
            {**completion, "stream": True, "stream_options": {"include_usage": True}},
            streaming=True,
        ),
        Kind("chat", "/v1/chat/completions", chat),
    ]


def _answer(
    kind: Kind, data: bytes, arrivals: Sequence[float] = ()
) -> tuple[bytes, tuple[float, ...]]:
    """The part of an answer that must be identical every time, and for a
    stream its tokens' arrival times (``arrivals``: each event's)."""
    if kind.name == "checksum":
        return str(json.loads(data)["checksum"]).encode(), ()
    if kind.name == "embeddings":
        return base64.b64decode(json.loads(data)["data"][0]["embedding"]), ()
    if not kind.streaming:
        choice = json.loads(data)["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return json.dumps([text, choice["finish_reason"]]).encode(), ()
    # A stream: the text and the finish reason, from its events in order; the
    # stream must end with [DONE] and carry no error event.
    parts: list[str] = []
    tokens: list[float] = []
    finish = None
    events = data.split(b"\n\n")
    if events[-2:] != [b"data: [DONE]", b""]:
        raise ValueError("stream did not end with [DONE]")
    for i, ev in enumerate(events[:-2]):
        if not ev.startswith(b"data: "):
            raise ValueError(f"not an SSE data event: {ev[:60]!r}")
        doc = json.loads(ev[6:])
        if "error" in doc:
            raise ValueError(f"error event: {doc['error']}")
        text = ""
        for choice in doc.get("choices", []):
            text += choice.get("delta", {}).get("content") or choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
        parts.append(text)
        if text and i < len(arrivals):  # the role's and the usage's events carry none
            tokens.append(arrivals[i])
    return json.dumps(["".join(parts), finish]).encode(), tuple(tokens)


def _read(resp: http.client.HTTPResponse, streaming: bool) -> tuple[bytes, list[float]]:
    """The response's body, and for a stream when each of its events arrived
    (one ``data:`` line each, read as it comes)."""
    if not streaming or resp.status != 200:
        return resp.read(), []
    lines: list[bytes] = []
    arrivals: list[float] = []
    for line in resp:
        lines.append(line)
        if line.startswith(b"data: "):
            arrivals.append(time.monotonic())
    return b"".join(lines), arrivals


def stream_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style stream as they arrive (an
    ``http.client`` response iterates by line), up to ``[DONE]``; an error
    event raises ``ValueError``."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            return
        doc = json.loads(line[6:])
        if "error" in doc:
            raise ValueError(f"error event: {doc['error']}")
        yield doc


class Client(threading.Thread):
    """A continuous request stream, one request at a time, a new connection for
    each: every kind once in each round of ``len(kinds)`` requests, in an order
    of its own each round (from a generator seeded by ``index``).

    Not a fixed cycle: the clients move in step, and a kill sends the streams
    it catches on to their next kind sooner than the rest (a stream continues;
    an answer not yet begun starts over). In one drill of 8 clients the cycles
    so came to put every client on a kind that does not stream at every
    later kill: 10 kills caught 4 streams."""

    def __init__(self, url: str, kinds: list[Kind], index: int = 0, timeout: float = 60.0) -> None:
        super().__init__(name=f"drill-client-{index}", daemon=True)
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.kinds = kinds
        self.index = index
        self.timeout = timeout
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def _once(self, kind: Kind) -> Sample:
        t0 = time.monotonic()
        step, port = "connecting", 0
        try:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            conn.connect()
            port = conn.sock.getsockname()[1]
            step = "sending"
            conn.request(
                "POST", kind.path, json.dumps(kind.body), {"Content-Type": "application/json"}
            )
            step = "waiting for the answer"
            resp = conn.getresponse()
            step = "reading the answer"
            data, arrivals = _read(resp, kind.streaming)
            conn.close()
        except (OSError, http.client.HTTPException) as exc:
            return Sample(
                t0, time.monotonic(), False, error=type(exc).__name__, kind=kind.name,
                detail=f"{step}, port {port}",
            )  # fmt: skip
        t1 = time.monotonic()
        if resp.status != 200:
            return Sample(t0, t1, False, error=f"HTTP {resp.status}", kind=kind.name)
        try:
            answer, tokens = _answer(kind, data, arrivals)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return Sample(t0, t1, False, error=f"bad response: {exc}"[:200], kind=kind.name)
        # interned: the answers of a kind are (should be) all the same, so a
        # long drill keeps one copy of each digest, not one per request
        digest = sys.intern(hashlib.sha256(answer).hexdigest())
        return Sample(t0, t1, True, digest, kind=kind.name, tokens=tokens)

    def run(self) -> None:
        rng = random.Random(self.index)
        while True:
            for kind in rng.sample(self.kinds, len(self.kinds)):
                if self.stop.is_set():
                    return
                s = self._once(kind)
                self.samples.append(s)
                if not s.ok:
                    time.sleep(0.002)  # refused at once while nobody serves: don't spin


class Poisoner(threading.Thread):
    """One poison request (its prompt holds the marker that failpoint
    ``engine.poison`` was armed with), sent once: a pod is to run it alone
    and tell its client, after at most three engine deaths, and fail nothing
    else (docs/poison.md). What it was answered is ``result``."""

    def __init__(self, url: str, marker: str, timeout: float = 120.0) -> None:
        super().__init__(name="drill-poison", daemon=True)
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.body = {"prompt": f"Tell me about {marker}.", "max_tokens": 8, "temperature": 0}
        self.timeout = timeout
        self.result: dict[str, Any] = {"sent": 1, "told": 0}

    def run(self) -> None:
        time.sleep(1.0)  # among the others' requests, not before them
        t0 = time.monotonic()
        try:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            conn.request("POST", "/v1/completions", json.dumps(self.body), _JSON)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
        except (OSError, http.client.HTTPException) as exc:
            self.result["error"] = type(exc).__name__
            return
        self.result["status"], self.result["seconds"] = resp.status, time.monotonic() - t0
        try:
            message = str(json.loads(data)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = data[:200].decode(errors="replace")
        self.result["message"] = message
        # Told as the poison: a 4xx that says why (the front's isolation).
        self.result["told"] = int(400 <= resp.status < 500 and "alone" in message)


_JSON = {"Content-Type": "application/json"}


def fold(pool: list[Client], tally: Tally, before: float, kills: list[float]) -> None:
    """Move the requests that ended before ``before`` from the clients into the
    tally. A client's requests are one at a time, so they end in order; only
    this thread removes from its list, the client only appends to it."""
    for c in pool:
        n = 0
        for s in c.samples:
            if s.end >= before:
                break
            n += 1
        if n:
            taken = c.samples[:n]
            del c.samples[:n]
            tally.add(taken, kills)
