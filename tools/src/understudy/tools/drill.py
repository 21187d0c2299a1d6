"""``understudy drill``: kill the active engine under load, N times, and measure.

Clients (16 by default) keep continuous request streams against the serving
endpoint, mixing the kinds of request the engine serves (for a generative
engine: chat and text completions, streaming and not, greedy, so every answer
of a kind must be identical). Each round: wait until the pod is armed (one
Active engine, the others Standby), kill the Active engine's process with the
chosen signal, and measure

- kill → lock granted → Active (from the new engine's ``/state``),
- the client-observed gap: the longest stretch after the kill in which no
  request completed, up to the first request that started after the kill,
- failed requests, and re-arm: kill → the killed engine back in Standby.

A watcher polls every engine's ``/state`` all along and counts split-brain
(two engines Active at once, or an epoch that does not rise), and after each
failover checks that only the new Active engine listens for requests. Exit
status 1 if any request failed, any answer differed, any check failed or a
round had no failover: an engine death may cost latency, never an error.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import itertools
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from understudy.tools import figures
from understudy.tools.figures import stats, verdict
from understudy.tools.series import KILL_WINDOW_S, Sample, Tally

REQUEST = {
    "input": "Understudy keeps a sleeping shadow engine in the same pod.",
    "encoding_format": "base64",
}


class Target(Protocol):
    serve_url: str

    def engines(self) -> list[dict[str, Any]]: ...

    def kill(self, engine: dict[str, Any], sig: int) -> None: ...

    def kill_sidecar(self, which: str) -> None: ...

    def serving_listeners(self) -> set[int] | None:
        """Pids listening on an engine serving socket (None: cannot tell)."""
        ...


class LocalTarget:
    """A pod started by ``understudy local up`` (reads its local.json)."""

    def __init__(self, directory: Path) -> None:
        from understudy.tools.local import read_state

        self.directory = directory
        state = read_state(directory)
        self.serve_url = state["serve_url"]
        self.run_dir = Path(state.get("run_dir", directory))
        self.status_ports = {
            name: c["status_port"]
            for name, c in state["containers"].items()
            if c["status_port"] is not None
        }

    def engines(self) -> list[dict[str, Any]]:
        from understudy.tools.local import read_state

        started: dict[str, bool] = {}
        with contextlib.suppress(OSError, ValueError):
            started = {
                n: c.get("started", True)
                for n, c in read_state(self.directory)["containers"].items()
            }
        out = []
        for name, port in self.status_ports.items():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=0.3)
                conn.request("GET", "/state")
                body = conn.getresponse().read()
                conn.close()
                engine = json.loads(body)
            except (OSError, ValueError, http.client.HTTPException):
                engine = {"name": name, "state": "Unreachable"}
            # the runner's startup probe passed: its liveness probe is watching
            engine["started"] = started.get(name, True)
            out.append(engine)
        return out

    def kill(self, engine: dict[str, Any], sig: int) -> None:
        os.kill(engine["pid"], sig)

    def kill_sidecar(self, which: str) -> None:
        from understudy.tools.local import read_state

        pid = read_state(self.directory)["containers"][which]["pid"]
        os.kill(container_process(pid), signal.SIGKILL)

    def front_status_urls(self) -> list[str]:
        from understudy.tools.local import read_state

        return [read_state(self.directory)["front_status_url"]]

    def kill_fronts(self) -> list[int]:
        """The front's own process: its container's process is the respawner."""
        pid = front_pid(self.front_status_urls()[0])
        os.kill(pid, signal.SIGKILL)
        return [pid]

    def serving_listeners(self) -> set[int] | None:
        return unix_listeners(self.run_dir / "serve")


def front_pid(status_url: str) -> int:
    """The serving front's pid, as its ``/state`` reports it (in the pod's PID
    namespace). Its command line cannot tell: the respawner's spare runs the
    same one, waiting for its turn."""
    url = urllib.parse.urlsplit(status_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=2)
    try:
        conn.request("GET", "/state")
        return int(json.loads(conn.getresponse().read())["pid"])
    finally:
        conn.close()


def container_process(pid: int) -> int:
    """The process a container runs: ``pid`` itself, or, when that is the
    container's respawner (``understudy respawn -- …``), its child. A death of
    the process is the fault to drill; the respawner's is the container's."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid
    if b"respawn" not in cmdline:
        return pid
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            return int(entry.name)
    return pid


# /proc/net/unix: "Num RefCount Protocol Flags Type St Inode Path"; a
# listening socket has __SO_ACCEPTCON (0x10000) in Flags.
_ACCEPTCON = 0x10000


def unix_listeners(directory: Path) -> set[int]:
    """Pids of the processes listening on Unix sockets in ``directory``."""
    prefix = str(directory) + "/"
    inodes = set()
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            listening = len(parts) >= 8 and int(parts[3], 16) & _ACCEPTCON
            if listening and parts[7].startswith(prefix):
                inodes.add(parts[6])
    pids: set[int] = set()
    if not inodes:
        return pids
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        pids.add(int(pid))
    return pids


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


def _answer(kind: Kind, data: bytes) -> bytes:
    """The part of an answer that must be identical every time."""
    if kind.name == "checksum":
        return str(json.loads(data)["checksum"]).encode()
    if kind.name == "embeddings":
        return base64.b64decode(json.loads(data)["data"][0]["embedding"])
    if not kind.streaming:
        choice = json.loads(data)["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return json.dumps([text, choice["finish_reason"]]).encode()
    # A stream: the text and the finish reason, from its events in order; the
    # stream must end with [DONE] and carry no error event.
    parts: list[str] = []
    finish = None
    events = data.split(b"\n\n")
    if events[-2:] != [b"data: [DONE]", b""]:
        raise ValueError("stream did not end with [DONE]")
    for ev in events[:-2]:
        if not ev.startswith(b"data: "):
            raise ValueError(f"not an SSE data event: {ev[:60]!r}")
        doc = json.loads(ev[6:])
        if "error" in doc:
            raise ValueError(f"error event: {doc['error']}")
        for choice in doc.get("choices", []):
            delta = choice.get("delta", {})
            parts.append(delta.get("content") or choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
    return json.dumps(["".join(parts), finish]).encode()


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
    each; client ``index`` cycles through the kinds starting at its own."""

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
        try:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            conn.request(
                "POST", kind.path, json.dumps(kind.body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
        except (OSError, http.client.HTTPException) as exc:
            return Sample(t0, time.monotonic(), False, error=type(exc).__name__, kind=kind.name)
        t1 = time.monotonic()
        if resp.status != 200:
            return Sample(t0, t1, False, error=f"HTTP {resp.status}", kind=kind.name)
        try:
            answer = _answer(kind, data)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return Sample(t0, t1, False, error=f"bad response: {exc}"[:200], kind=kind.name)
        # interned: the answers of a kind are (should be) all the same, so a
        # long drill keeps one copy of each digest, not one per request
        digest = sys.intern(hashlib.sha256(answer).hexdigest())
        return Sample(t0, t1, True, digest, kind=kind.name)

    def run(self) -> None:
        for n in itertools.count(self.index):
            if self.stop.is_set():
                return
            s = self._once(self.kinds[n % len(self.kinds)])
            self.samples.append(s)
            if not s.ok:
                time.sleep(0.002)  # refused at once while nobody serves: don't spin


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


class Watcher(threading.Thread):
    """Polls every engine's /state; records Active engines and checks safety.

    It also keeps ``timeline``: ``(monotonic time, Standby count)`` at every
    change, from which the drill computes how long the pod had no shadow
    (``figures.unarmed_spans``)."""

    def __init__(self, target: Target, period: float = 0.01) -> None:
        super().__init__(name="drill-watcher", daemon=True)
        self.target = target
        self.period = period
        self.stop = threading.Event()
        self.latest: list[dict[str, Any]] = []
        self.split_brain: list[dict[str, Any]] = []
        self.epoch_regressions: list[dict[str, Any]] = []
        self.timeline: list[tuple[float, int]] = []
        # engine id -> (container name, when it was first seen in Standby): the
        # re-arm is read from here, not from when the drill got round to looking
        self.standby_seen: dict[str, tuple[str, float]] = {}
        self.max_epoch = -1
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stop.is_set():
            engines = self.target.engines()
            now = time.monotonic()
            with self.lock:
                self.latest = engines
                self._check(engines, now)
            time.sleep(self.period)

    def _check(self, engines: list[dict[str, Any]], now: float) -> None:
        active = [e for e in engines if e.get("state") == "Active"]
        if len(active) > 1:
            self.split_brain.append(
                {
                    "at": time.time(),
                    "active": [{k: e.get(k) for k in ("name", "pid", "epoch")} for e in active],
                }
            )
        for e in active:
            epoch = e.get("epoch") or 0
            if epoch < self.max_epoch:
                self.epoch_regressions.append(
                    {"name": e.get("name"), "epoch": epoch, "max_seen": self.max_epoch}
                )
            self.max_epoch = max(self.max_epoch, epoch)
        for e in engines:
            if e.get("state") == "Standby" and e.get("engine_id"):
                self.standby_seen.setdefault(e["engine_id"], (e.get("name") or "", now))
        standbys = sum(1 for e in engines if e.get("state") == "Standby")
        if not self.timeline or self.timeline[-1][1] != standbys:
            self.timeline.append((now, standbys))

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.latest)

    def until(self, cond: Callable[[list[dict[str, Any]]], Any], timeout: float) -> Any:
        """The first truthy ``cond(engines)`` within ``timeout``, else None."""
        return _wait(lambda: cond(self.snapshot()), timeout)


@dataclass
class Round:
    index: int
    killed: str
    killed_pid: int
    killed_epoch: int
    killed_engine_id: str = ""
    signal: str = ""
    also_killed: str = ""  # what the scenario killed on top (an engine or a sidecar)
    new_active: str = ""
    new_epoch: int = 0
    kill_to_grant_s: float | None = None
    grant_to_active_s: float | None = None
    kill_to_active_s: float | None = None
    gap_s: float | None = None
    first_served_s: float | None = None  # kill -> end of the first request started after it
    # The longest wait between answers in the STEADY_S before the kill (no failover)
    steady_gap_s: float | None = None
    failed_requests: int = 0
    rearm_s: float | None = None
    serving_ok: bool | None = None  # only the new Active engine listens for requests
    error: str = ""
    kill_at_s: float | None = None  # when the kill was sent, seconds since the clients started


@dataclass
class Report:
    rounds: list[Round] = field(default_factory=list)
    requests: int = 0
    failed_requests: int = 0
    wrong_answers: int = 0
    split_brain: list[dict[str, Any]] = field(default_factory=list)
    epoch_regressions: list[dict[str, Any]] = field(default_factory=list)
    signal: str = "KILL"
    clients: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)  # request_series()
    # No Standby at all: what a second death would have found (figures.unarmed_figures)
    unarmed: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def col(name: str) -> list[float]:
            return [v for r in self.rounds if (v := getattr(r, name)) is not None]

        return {
            "kills": len(self.rounds),
            "signal": self.signal,
            "failovers_ok": sum(1 for r in self.rounds if not r.error),
            "requests": self.requests,
            "failed_requests": self.failed_requests,
            "wrong_answers": self.wrong_answers,
            "split_brain": len(self.split_brain),
            "epoch_regressions": len(self.epoch_regressions),
            "serving_violations": sum(1 for r in self.rounds if r.serving_ok is False),
            "clients": self.clients,
            "requests_by_kind": self.by_kind,
            "gap_s": stats(col("gap_s")),
            "steady_gap_s": stats(col("steady_gap_s")),
            "first_served_s": stats(col("first_served_s")),
            "kill_to_grant_s": stats(col("kill_to_grant_s")),
            "grant_to_active_s": stats(col("grant_to_active_s")),
            "kill_to_active_s": stats(col("kill_to_active_s")),
            "rearm_s": stats(col("rearm_s")),
            **self.unarmed,
        }

    def passed(self) -> bool:
        return verdict(self.summary())


def _wait(cond: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.005)
    return None


SCENARIOS = ("takeover-kill", "lockserver", "gms")
STEADY_S = 30.0  # the stretch before each kill whose gaps between answers are the baseline


class _Session:
    """One drill's moving parts: the clients, the watcher, the tally of what
    they recorded and the rounds so far. The figures come from ``figures``."""

    def __init__(self, target: Target, watcher: Watcher, kinds: list[Kind], clients: int) -> None:
        self.target = target
        self.watcher = watcher
        self.kinds = kinds
        self.pool = [Client(target.serve_url, kinds, i) for i in range(clients)]
        self.tally = Tally()
        self.rounds: list[Round] = []
        self.origin = time.monotonic()
        for c in self.pool:
            c.start()

    def samples(self) -> list[Sample]:
        return [s for c in self.pool for s in list(c.samples)]

    def killed_at(self) -> list[float]:
        return [self.origin + r.kill_at_s for r in self.rounds if r.kill_at_s is not None]

    def fold(self, before: float) -> None:
        fold(self.pool, self.tally, before, self.killed_at())

    def steady_since(self) -> float:
        """Where the steady stretch before the next kill starts: STEADY_S ago,
        or once the previous failover had served again, if later."""
        t0 = time.monotonic() - STEADY_S
        if self.rounds and (last := self.rounds[-1]).kill_at_s is not None:
            settle = last.first_served_s or KILL_WINDOW_S[1]
            t0 = max(t0, self.origin + last.kill_at_s + settle)
        return t0

    def close(self) -> None:
        for c in self.pool:
            c.stop.set()
        for c in self.pool:
            c.join(120)
        self.watcher.stop.set()
        self.watcher.join(5)
        self.fold(float("inf"))


@dataclass(frozen=True)
class _Plan:
    """What every round of one drill does."""

    sigs: list[int]
    names: list[str]
    scenario: str | None
    timeout: float
    rearm: bool
    check_serving: bool


def _kill(ses: _Session, plan: _Plan, rnd: Round, active: dict[str, Any]) -> tuple[float, float]:
    """Kill the Active engine (and, by scenario, a second thing inside the
    failover); returns the kill's monotonic and wall-clock times."""
    sig = plan.sigs[(rnd.index - 1) % len(plan.sigs)]
    time.sleep(0.2)  # steady traffic before the kill
    t_kill, wall_kill = time.monotonic(), time.time()
    ses.target.kill(active, sig)
    rnd.kill_at_s = t_kill - ses.origin
    if plan.scenario in ("lockserver", "gms"):
        # A second fault inside the failover: the sidecar dies while the next
        # engine is being granted (lock server) or wakes (GMS).
        ses.target.kill_sidecar(plan.scenario)
        rnd.also_killed = plan.scenario
    elif plan.scenario == "takeover-kill":
        taker = ses.watcher.until(lambda es: figures.successor(es, rnd.killed_epoch), plan.timeout)
        if taker is not None:
            # The engine that just took over dies too, as soon as it serves.
            ses.target.kill(taker, sig)
            rnd.also_killed = taker["name"]
            rnd.killed_epoch = taker.get("epoch") or rnd.killed_epoch
    return t_kill, wall_kill


def _measure(ses: _Session, plan: _Plan, rnd: Round, t_kill: float, wall_kill: float) -> None:
    """Wait for the successor and the first request it serves; fill in the round."""
    new = ses.watcher.until(lambda es: figures.successor(es, rnd.killed_epoch), plan.timeout)
    if new is None:
        rnd.error = f"no new Active engine within {plan.timeout}s"
        return
    rnd.new_active, rnd.new_epoch = new["name"], new.get("epoch") or 0
    if (w := figures.wake(new, wall_kill)) is not None:
        rnd.kill_to_grant_s, rnd.grant_to_active_s = w.kill_to_grant_s, w.grant_to_active_s
        rnd.kill_to_active_s = w.kill_to_active_s
    if plan.check_serving and (listeners := ses.target.serving_listeners()) is not None:
        rnd.serving_ok = listeners == {new.get("pid")}
    ok = _wait(lambda: figures.first_served(ses.samples(), t_kill), plan.timeout)
    if ok is None:
        rnd.error = f"no successful request within {plan.timeout}s of the kill"
    else:
        samples = ses.samples()
        rnd.first_served_s = ok.end - t_kill
        rnd.gap_s = figures.client_gap(samples, t_kill, ok)
        rnd.failed_requests = figures.failed_between(samples, t_kill, ok.end + plan.timeout)
    if plan.rearm:
        back = ses.watcher.until(
            lambda es: figures.rearmed(es, rnd.killed, rnd.killed_engine_id), plan.timeout
        )
        if back:
            with ses.watcher.lock:
                seen = dict(ses.watcher.standby_seen)
            rnd.rearm_s = figures.rearm_s(seen, rnd.killed, rnd.killed_engine_id, t_kill)


def _round(ses: _Session, plan: _Plan, i: int, log: Callable[[str], None]) -> bool:
    """One kill and its measurements; False when the pod was never armed."""
    got = ses.watcher.until(figures.armed, plan.timeout)
    if got is None:
        ses.rounds.append(Round(i, "?", 0, 0, error="pod not armed"))
        return False
    active = got[0]
    rnd = Round(
        i,
        active["name"],
        active["pid"],
        active.get("epoch") or 0,
        killed_engine_id=active.get("engine_id", ""),
        signal=plan.names[(i - 1) % len(plan.names)],
        steady_gap_s=figures.steady_gap(ses.samples(), ses.steady_since(), time.monotonic()),
    )
    # what ended well before this round's kill is needed only as counts
    ses.fold(time.monotonic() + KILL_WINDOW_S[0] - 0.5)
    t_kill, wall_kill = _kill(ses, plan, rnd, active)
    _measure(ses, plan, rnd, t_kill, wall_kill)
    ses.rounds.append(rnd)
    log(f"round {i}: {rnd.error}" if rnd.error else _round_line(rnd))
    return True


def drill(
    target: Target,
    kills: int,
    sig: int | list[int],
    *,
    scenario: str | None = None,
    timeout: float = 60.0,
    rearm: bool = True,
    log: Callable[[str], None] = print,
    check_serving: bool = True,
    clients: int = 16,
    max_tokens: int = 32,
) -> Report:
    """``kills`` rounds of: wait until armed, kill the Active engine, measure."""
    sigs = sig if isinstance(sig, list) else [sig]
    names = [signal.Signals(x).name.removeprefix("SIG") for x in sigs]
    plan = _Plan(sigs, names, scenario, timeout, rearm, check_serving)
    watcher = Watcher(target)
    watcher.start()
    first = watcher.until(figures.armed, timeout)
    if first is None:
        watcher.stop.set()
        raise RuntimeError(f"pod not armed (one Active, at least one Standby) within {timeout}s")
    kinds = kinds_for(first[0].get("adapter", "reference"), max_tokens)
    ses = _Session(target, watcher, kinds, clients)
    try:
        for i in range(1, kills + 1):
            if not _round(ses, plan, i, log):
                break
    finally:
        ses.close()
    return _report(ses, plan, clients)


def _report(ses: _Session, plan: _Plan, clients: int) -> Report:
    w, tally = ses.watcher, ses.tally
    end = time.monotonic()
    return Report(
        rounds=ses.rounds,
        requests=tally.requests,
        failed_requests=tally.failed,
        wrong_answers=tally.wrong_answers(),
        split_brain=w.split_brain,
        epoch_regressions=w.epoch_regressions,
        signal=",".join(plan.names) + (f" +{plan.scenario}" if plan.scenario else ""),
        clients=clients,
        by_kind=tally.by_kind,
        errors=tally.errors,
        series=tally.series(ses.kinds, ses.origin, ses.killed_at()),
        unarmed=figures.unarmed_figures(
            figures.unarmed_spans(w.timeline, ses.origin, end),
            end - ses.origin,
        ),
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _round_line(r: Round) -> str:
    return (
        f"round {r.index:>3}: SIG{r.signal} {r.killed}"
        + (f" + {r.also_killed}" if r.also_killed else "")
        + f" (epoch {r.killed_epoch}) -> {r.new_active} "
        f"(epoch {r.new_epoch}): kill->grant {_ms(r.kill_to_grant_s)} ms, grant->active "
        f"{_ms(r.grant_to_active_s)} ms, client gap {_ms(r.gap_s)} ms, failed "
        f"{r.failed_requests}, re-arm {_ms(r.rearm_s)} ms"
    )


def render(report: Report) -> str:
    s = report.summary()
    lines = [
        f"\ndrill: {s['kills']} kills (SIG{s['signal']}), {s['failovers_ok']} failovers, "
        f"{s['requests']} requests, {s['failed_requests']} failed, "
        f"{s['wrong_answers']} wrong answers, {s['split_brain']} split-brain, "
        f"{s['epoch_regressions']} epoch regressions, "
        f"{s['serving_violations']} serving violations ({s['clients']} clients)",
        f"{'':22} {'p50':>9} {'p95':>9} {'p99':>9} {'max':>9}  (ms)",
    ]
    for key, label in (
        ("gap_s", "client-observed gap"),
        ("steady_gap_s", "gap, no failover"),
        ("first_served_s", "first new request done"),
        ("kill_to_grant_s", "kill -> lock granted"),
        ("grant_to_active_s", "granted -> Active"),
        ("kill_to_active_s", "kill -> Active"),
        ("rearm_s", "re-arm (Standby)"),
    ):
        st = s[key]
        if st:
            lines.append(
                f"{label:22} {_ms(st['p50']):>9} {_ms(st['p95']):>9} "
                f"{_ms(st['p99']):>9} {_ms(st['max']):>9}"
            )
    if "unarmed_s" in s:
        lines.append(
            f"pod unarmed (no Standby): {s['unarmed_s']:.1f} s in {s['unarmed_spans']} "
            f"stretches, longest {s['unarmed_longest_s']:.1f} s "
            f"({100 * s['unarmed_fraction']:.0f} % of the drill)"
        )
    lines.append("PASS" if report.passed() else "FAIL")
    return "\n".join(lines)


def to_json(report: Report, *, series: bool = False) -> dict[str, Any]:
    """The drill's JSON; with ``series``, also every request (thinned out in a
    long drill: see request_series) for ``understudy drill --report``."""
    out = {
        "summary": report.summary(),
        "errors": report.errors,
        "rounds": [asdict(r) for r in report.rounds],
        "split_brain": report.split_brain,
        "epoch_regressions": report.epoch_regressions,
    }
    if series:
        out["series"] = report.series
    return out


SIDECAR_COMMANDS = {"lockserver": "lockserver serve", "gms": "gms serve"}


def _sidecar_kill(
    target: Any, which: str, watcher: Watcher, timeout: float, settle: float
) -> dict[str, Any]:
    """One kill of the sidecar; watch through ``settle`` (past the lock
    server's reconnect window): when the pod stopped being armed, and when it
    was armed again; what became of the engines."""
    engines_before = watcher.snapshot()
    before = figures.settled(engines_before)
    t_kill = time.monotonic()
    target.kill_sidecar(which)
    unarmed_at: float | None = None
    rearmed_at: float | None = None
    while time.monotonic() - t_kill < settle or (unarmed_at and not rearmed_at):
        if time.monotonic() - t_kill > timeout:
            break
        now, ok_now = time.monotonic(), figures.settled(watcher.snapshot()) is not None
        if not ok_now and unarmed_at is None:
            unarmed_at = now
        elif ok_now and unarmed_at is not None and rearmed_at is None:
            rearmed_at = now
        time.sleep(0.01)
    # Then until the weights are given back (or the limit), so that the engines'
    # figures are read from the finished outcome.
    watcher.until(figures.whole, max(0.0, timeout - (time.monotonic() - t_kill)))
    engines_after = watcher.snapshot()
    after = figures.settled(engines_after)
    changed = figures.engine_changes(engines_before, engines_after)
    return {
        "t_kill": t_kill,
        "failover": before is None
        or after is None
        or (after.get("engine_id"), after.get("epoch"))
        != (before.get("engine_id"), before.get("epoch")),
        "active_before": {k: before.get(k) for k in ("name", "engine_id", "epoch")}
        if before
        else None,
        "active_after": {k: after.get(k) for k in ("name", "engine_id", "epoch")}
        if after
        else None,
        "recovered_s": (
            0.0 if unarmed_at is None else (rearmed_at - t_kill if rearmed_at is not None else None)
        ),
        # GMS: re-adoption means no engine restarts and nothing reloads
        "engine_restarts": changed.restarts,
        "checkpoint_reads": changed.reloads,
        "readoptions": changed.readoptions,
    }


@contextlib.contextmanager
def settled_under_load(
    target: Target, clients: int, timeout: float
) -> Iterator[tuple[Watcher, list[Client]]]:
    """A sidecar drill's stage: a watcher on the pod and ``clients`` request
    streams, started once the pod is settled, all stopped on the way out."""
    watcher = Watcher(target)
    watcher.start()
    pool: list[Client] = []
    try:
        first = watcher.until(figures.settled, timeout)
        if first is None:
            raise RuntimeError(f"pod not armed within {timeout}s")
        kinds = kinds_for(first.get("adapter", "reference"))
        pool = [Client(target.serve_url, kinds, i) for i in range(clients)]
        for c in pool:
            c.start()
        yield watcher, pool
    finally:
        for c in pool:
            c.stop.set()
        for c in pool:
            c.join(5)
        watcher.stop.set()
        watcher.join(5)


def sidecar_drill(
    target: Any,
    which: str,
    *,
    timeout: float = 120.0,
    settle: float = 5.0,
    clients: int = 1,
    kills: int = 1,
) -> dict[str, Any]:
    """Kill a sidecar (``lockserver`` or ``gms``) ``kills`` times under the
    request stream, each time once the pod is settled again.

    Expected outcomes: the lock server's death causes no failover (the holder
    resumes its grant, same engine, same epoch); GMS's death neither: the
    Active engine serves on from its mappings and gives them back to the
    restarted GMS (no engine restarts, nothing is read from the checkpoint).
    Reports what happened rather than judging it; the top-level figures are
    over every kill (the first kill's fields as they were, for one kill).
    """
    rounds: list[dict[str, Any]] = []
    with settled_under_load(target, clients, timeout) as (watcher, pool):
        time.sleep(0.5)
        for _ in range(kills):
            if watcher.until(figures.whole, timeout) is None:
                break
            time.sleep(0.5)  # steady traffic before the kill
            rounds.append(_sidecar_kill(target, which, watcher, timeout, settle))
        time.sleep(0.5)
    samples = [s for c in pool for s in c.samples]
    t_first = rounds[0]["t_kill"] if rounds else time.monotonic()
    after_kill = [s for s in samples if s.start >= t_first]
    gaps = figures.gaps_between_kills(samples, [r["t_kill"] for r in rounds])
    for r, gap in zip(rounds, gaps, strict=True):
        r["longest_gap_s"] = gap
        r["kill_at_s"] = r.pop("t_kill") - t_first
    last = rounds[-1] if rounds else {}
    return {
        "sidecar": which,
        "kills": len(rounds),
        "failover": any(r["failover"] for r in rounds),
        "active_before": rounds[0]["active_before"] if rounds else None,
        "active_after": last.get("active_after"),
        "recovered_s": max((r["recovered_s"] for r in rounds), default=None, key=_none_last),
        "longest_gap_s": max((g for g in gaps if g is not None), default=None),
        "gap_s": stats([g for g in gaps if g is not None]),
        "requests_after_kill": len(after_kill),
        "failed_after_kill": sum(1 for s in after_kill if not s.ok),
        "distinct_answers": len({s.digest for s in samples if s.ok}),
        "split_brain": len(watcher.split_brain),
        "engine_restarts": sum(r["engine_restarts"] for r in rounds),
        "checkpoint_reads": sum(r["checkpoint_reads"] for r in rounds),
        "readoptions": sum(r["readoptions"] for r in rounds),
        "rounds": rounds,
    }


def _none_last(value: float | None) -> float:
    """Order recovery times with "never recovered" above every number."""
    return float("inf") if value is None else value
