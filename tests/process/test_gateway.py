"""Streams outlive the pod (issue 28): two local pods of ``builtin:tiny-llama``
behind the fleet gateway (``understudy local up --pods 2``), the official
``openai`` client, and every process of one pod SIGKILLed at once, as a
node's loss would. Every request is answered, each greedy answer identical
to the same request's uninterrupted one, and the streams cut by the kill go
on from the other pod within a bound. A malformed request is refused by the
gateway and reaches no pod. ``understudy drill --scenario pod-kill|pod-freeze``
does the same faults round after round and loses nothing."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from localpod import free_port_block, http_json
from procs import Proc, asking, understudy, wait_for

from understudy.tools.drill_target import pod_processes

pytestmark = [pytest.mark.process, pytest.mark.slow]

CLIENTS = 8
# Long enough that streams are still open when the fault comes 0.3 s after
# both pods got work: at 48 a quiet machine had every stream answered by then
# (CI's run: "no stream was open at the fault").
TOKENS = 256
LONG_TOKENS = 1536  # a planned removal's streams that move at the grace's end
# A fault round's answers: long enough that a moment comes when every open
# stream is between its second token and three quarters of its answer, on a
# loaded CI machine too (at 256, CI once saw no such moment in 60 s).
ROUND_TOKENS = 768
# From the kill to each cut stream's next token, on this 2-core machine
# under the other tests' load (the gateway judges the pod dead at the reset;
# the continuation's prefill on the other pod is most of it).
NEXT_TOKEN_BOUND_S = 10.0
FREEZE_S = 5.0


class Fleet:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="h9-gateway-", dir="/tmp"))
        base = free_port_block(24)
        self.port = base
        self.metrics_port = base + 12
        self.gateway_metrics = base + 12 + 3 * 2
        self.proc = Proc(
            understudy(
                "local", "up", "--pods", "2", "--dir", str(self.dir),
                "--engine", "llama", "--model", "builtin:tiny-llama",
                "--port", str(base), "--status-port", str(base + 4),
                "--metrics-port", str(self.metrics_port),
                "--reconnect-window", "2", "--max-backoff", "1",
            ),
            log=self.dir / "supervisor.out",
        )  # fmt: skip

    def state(self) -> dict[str, Any]:
        return json.loads((self.dir / "local.json").read_text())

    def gateway(self) -> dict[str, Any]:
        status, body = http_json(self.gateway_metrics, "/state")
        assert status == 200, body
        return dict(body)

    def routable(self) -> int:
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            return int(self.gateway()["routable"])
        return 0

    def front_requests(self) -> float:
        """Requests the pods' fronts answered, all pods together."""
        total = 0.0
        for i in range(2):
            _, text = http_json(self.metrics_port + 3 * i + 2, "/metrics")
            total += sum(
                float(line.split()[-1])
                for line in str(text).splitlines()
                if line.startswith("understudy_front_requests_total{")
            )
        return total

    def gateway_metric(self, name: str) -> float:
        _, text = http_json(self.gateway_metrics, "/metrics")
        return sum(
            float(line.split()[-1]) for line in str(text).splitlines() if line.startswith(name)
        )

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
            timeout=120,
        )  # fmt: skip

    def through(self, base: int) -> Fleet:
        """The fleet's pods, through another gateway (port ``base``, metrics ``base + 1``)."""
        via = Fleet.__new__(Fleet)
        via.__dict__.update(self.__dict__, port=base, gateway_metrics=base + 1)
        return via

    def close(self) -> None:
        self.proc.signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            self.proc.wait(60)
        kill_pod(self.dir)  # whatever a stopped supervisor left
        self.proc.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def kill_pod(directory: Path) -> int:
    """SIGKILL every process of the pod in ``directory``, until none is left."""
    killed: set[int] = set()
    for _ in range(5):
        pids = [p for p in pod_processes(directory) if p not in killed]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
    return len(killed)


@pytest.fixture(scope="module")
def fleet():
    f = Fleet()
    try:
        wait_for(lambda: f.routable() == 2, 240, 0.2, what="both pods routable")
        yield f
    finally:
        f.close()


Live = dict[tuple[int, int], list[float]]


def _request(
    f: Fleet, i: int, n: int, tokens: int = TOKENS, live: Live | None = None
) -> dict[str, Any]:
    """Client ``i``'s ``n``-th request (streaming or not, chat or completions),
    greedy: its text, and for a stream each chunk's arrival time. A stream's
    times are in ``live`` from before it is asked until its last chunk."""
    client = f.client()
    stream, chat = i % 2 == 0, i % 4 < 2
    times: list[float] = []
    if stream and live is not None:
        live[i, n] = times
    prompt = f"client {i} asks question {n}: what does an understudy do?"
    kw: dict[str, Any] = {"model": "tiny-llama", "max_tokens": tokens, "temperature": 0}
    if chat:
        messages = [{"role": "user", "content": prompt}]
        out = client.chat.completions.create(messages=messages, stream=stream, **kw)  # type: ignore[call-overload]
    else:
        out = client.completions.create(prompt=prompt, stream=stream, **kw)  # type: ignore[call-overload]
    if not stream:
        c = out.choices[0]
        return {"text": c.message.content if chat else c.text, "times": [], "ids": {out.id}}
    parts, ids = [], set()
    try:
        for chunk in out:
            times.append(time.monotonic())
            ids.add(chunk.id)
            if chunk.choices:
                c = chunk.choices[0]
                parts.append((c.delta.content if chat else c.text) or "")
    finally:
        if live is not None:
            live.pop((i, n), None)
    return {"parts": parts, "text": "".join(parts), "times": times, "ids": ids}


def test_a_malformed_request_is_refused_by_the_gateway_and_reaches_no_pod(fleet: Fleet) -> None:
    before = fleet.front_requests()
    for body in (b"[1", b"[1, 2]", b'{"prompt": "x", "understudy": {}}', b'{"stream": "yes"}'):
        conn = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=10)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = resp.read()
        conn.close()
        assert 400 <= resp.status < 500, (body, resp.status, answer)
    with socket.create_connection(("127.0.0.1", fleet.port), timeout=10) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    assert fleet.front_requests() == before


def _ready(port: int) -> bool:
    with contextlib.suppress(OSError, http.client.HTTPException):
        return http_json(port, "/ready")[0] == 200
    return False


def test_a_gateway_with_api_keys_lets_only_their_holders_through(fleet: Fleet) -> None:
    """A second gateway over the same pods, with ``--api-key-file``: the
    official client with a key gets its stream; without one, or with a wrong
    one, a 401 the client names AuthenticationError, and no pod sees the
    request; the key is never in the gateway's log."""
    keys = fleet.dir / "api-keys"
    keys.write_text("sk-understudy-test-1\nsk-understudy-test-2\n")
    base = free_port_block(2)
    log = fleet.dir / "keyed-gateway.out"
    proc = Proc(
        understudy(
            "gateway", "--pods-file", str(fleet.dir / "pods.json"), "--port", str(base),
            "--metrics-port", str(base + 1), "--api-key-file", str(keys),
        ),
        log=log,
    )  # fmt: skip
    try:
        wait_for(lambda: _ready(base + 1), 60, 0.1, what="the keyed gateway ready")

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(
                base_url=f"http://127.0.0.1:{base}/v1", api_key=key, max_retries=0, timeout=120
            )

        stream = client("sk-understudy-test-2").completions.create(
            model="tiny-llama", prompt="The capital of France is", max_tokens=8,
            temperature=0, stream=True,
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in stream if c.choices)
        before = fleet.front_requests()
        for key in ("wrong", "sk-understudy-test-1x", "sk-understudy-test"):
            with pytest.raises(openai.AuthenticationError):
                client(key).completions.create(model="tiny-llama", prompt="hi", max_tokens=4)
        conn = http.client.HTTPConnection("127.0.0.1", base, timeout=10)
        conn.request("GET", "/v1/models")  # no Authorization header at all
        resp = conn.getresponse()
        assert resp.status == 401 and resp.getheader("WWW-Authenticate", "").startswith("Bearer")
        assert json.loads(resp.read())["error"]["code"] == "invalid_api_key"
        conn.close()
        assert fleet.front_requests() == before
        _, text = http_json(base + 1, "/metrics")
        assert "understudy_gateway_unauthorized_total 4.0" in str(text)
    finally:
        proc.stop()
    assert "sk-understudy-test" not in log.read_text()


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def _completion_on_a_new_connection(port: int, n: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"prompt": f"request {n} of a client", "max_tokens": 4, "temperature": 0}
        conn.request(
            "POST", "/v1/completions", json.dumps(body),
            {"Content-Type": "application/json", "Connection": "close"},
        )  # fmt: skip
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, (resp.status, data[:200])
        return str(json.loads(data)["choices"][0]["text"])
    finally:
        conn.close()


def test_a_gateway_killed_under_its_respawner_refuses_no_new_connection(fleet: Fleet) -> None:
    """A gateway replica as the operator renders it: under ``understudy
    respawn --spare``, which binds both ports. Its gateway process SIGKILLed
    while clients open new connections: none is refused or fails (they wait
    in the port's queue for the spare, which takes over); what the killed
    process had accepted is lost with it (a stream open on it is cut)."""
    base = free_port_block(2)
    keeper = Proc(
        understudy(
            "respawn", "--spare", "--spare-after", "0.5",
            "--listen", f"serving=127.0.0.1:{base}", "--listen", f"status=127.0.0.1:{base + 1}",
            "--", *understudy(
                "gateway", "--pods-file", str(fleet.dir / "pods.json"),
                "--port", str(base), "--metrics-port", str(base + 1),
            ),
        ),
        log=fleet.dir / "respawned-gateway.out",
    )  # fmt: skip
    via = fleet.through(base)
    try:
        wait_for(lambda: via.routable() == 2, 60, 0.1, what="the respawned gateway routes both")
        wait_for(lambda: len(_children(keeper.pid)) == 2, 60, 0.1, what="a spare gateway")

        def serving() -> int:
            with contextlib.suppress(OSError, http.client.HTTPException, AssertionError):
                return int(via.gateway()["pid"])
            return 0

        victim: int = wait_for(serving, 30, 0.1, what="the gateway's pid")
        stream = via.client().completions.create(
            model="tiny-llama", prompt="a stream on the gateway that dies",
            max_tokens=2000, temperature=0, stream=True,
        )  # fmt: skip
        assert next(iter(stream)).choices  # open and flowing on the victim
        with asking(
            lambda i, n: _completion_on_a_new_connection(base, i * 10_000 + n), 4
        ) as results:
            wait_for(lambda: len(results) >= 8, 60, 0.02, what="requests flowing")
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            back = wait_for(
                lambda: (pid := serving()) != victim and pid, 30, 0.02, what="the spare serving"
            )
            t_back = time.monotonic()
            wait_for(lambda: via.routable() == 2, 30, 0.05, what="the spare routes both")
            time.sleep(1.0)
        cut = False
        try:
            for _ in stream:
                pass
        except Exception:  # httpx's, as the client raises it mid-stream
            cut = True
        after = [(t0, exc) for t0, exc in results if t0 >= t_kill]
        failed_after = [exc for _, exc in after if exc is not None]
        lost = [exc for t0, exc in results if t0 < t_kill and exc is not None]
        print(
            f"\ngateway {victim} killed, {back} serving after {t_back - t_kill:.2f} s; "
            f"{len(after)} requests begun after the kill, {len(failed_after)} failed; "
            f"in flight at the kill and lost: {len(lost)} requests, the open stream cut: {cut}"
        )
        assert failed_after == [], failed_after[:3]
        assert len(after) >= 4
        assert cut, "the killed gateway's open stream went on: what does it hold?"
        assert t_back - t_kill < 5.0  # a spare's turn, not a cold start or a back-off
        assert keeper.popen.poll() is None and len(_children(keeper.pid)) >= 1
    finally:
        keeper.stop()


def _pod_requests(f: Fleet, i: int) -> float:
    _, text = http_json(f.metrics_port + 3 * i + 2, "/metrics")
    return sum(
        float(line.split()[-1])
        for line in str(text).splitlines()
        if line.startswith("understudy_front_requests_total{")
    )


def test_a_terminating_pod_takes_nothing_new_and_its_streams_finish_there_or_move_at_grace_end(
    fleet: Fleet,
) -> None:
    """Planned removal, through a second gateway over a copy of the pods
    list: a pod listed as terminating while streams run on it takes nothing
    new, and its streams finish there (grace 60 s: none moves); with a grace
    of 0.3 s the streams still on it move, counted as ``removed``. Every
    answer is the uninterrupted one's."""
    listing = json.loads((fleet.dir / "pods.json").read_text())
    mine = fleet.dir / "planned.json"
    mine.write_text(json.dumps(listing))
    base = free_port_block(2)
    proc = Proc(
        understudy(
            "gateway", "--pods-file", str(mine), "--port", str(base),
            "--metrics-port", str(base + 1), "--grace", "60",
        ),
        log=fleet.dir / "planned-gateway.out",
    )  # fmt: skip
    via = fleet.through(base)
    try:
        wait_for(lambda: via.routable() == 2, 60, 0.1, what="the second gateway routes both")
        for grace, moves in ((60.0, False), (0.3, True)):
            if moves:  # a gateway of its own for the short grace
                proc.stop()
                mine.write_text(json.dumps(listing))
                proc = Proc(
                    understudy(
                        "gateway", "--pods-file", str(mine), "--port", str(base),
                        "--metrics-port", str(base + 1), "--grace", str(grace),
                    ),
                    log=fleet.dir / "planned-gateway-short.out",
                )  # fmt: skip
                wait_for(lambda: via.routable() == 2, 60, 0.1, what="the gateway again")
            _planned_round(fleet, via, mine, listing, moves)
    finally:
        proc.stop()


def _planned_round(fleet: Fleet, via: Fleet, mine: Path, listing: list[str], moves: bool) -> None:
    # The streams that must move have to outlive the listing's poll and the
    # grace (up to 0.8 s after the pod is marked): 256 of tiny-llama's tokens
    # could all be answered by then (CI: no migration, "(0.0, 0.0)").
    tokens = LONG_TOKENS if moves else TOKENS
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
        streams = [ex.submit(_request, via, i, 0, tokens) for i in range(0, CLIENTS, 2)]

        def busiest() -> dict[str, Any] | None:
            pods = via.gateway()["pods"]
            top = max(pods, key=lambda p: p["streams"])
            return top if top["streams"] >= 1 else None

        top = wait_for(busiest, 60, 0.02, what="a stream on a pod")
        i = int(top["name"].rsplit("-", 1)[1])
        marked = [
            {"address": a, "terminating": True} if a.endswith(f"name={top['name']}") else a
            for a in listing
        ]
        mine.write_text(json.dumps(marked))
        wait_for(
            lambda: {p["name"]: p["phase"] for p in via.gateway()["pods"]}[top["name"]]
            in ("leaving", "dead"),
            10, 0.02, what="the pod leaving",
        )  # fmt: skip
        answers = [f.result(timeout=300) for f in streams]
    moved = via.gateway_metric("understudy_gateway_migrations_total")
    removed = via.gateway_metric('understudy_gateway_migrations_total{reason="removed"}')
    assert (removed > 0) is moves and moved == removed, (moved, removed)
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
        alone = list(ex.map(lambda i: _request(fleet, i, 0, tokens), range(0, CLIENTS, 2)))
    assert [a["text"] for a in answers] == [a["text"] for a in alone]
    if not moves:  # a pod still leaving takes nothing new
        before = _pod_requests(fleet, i)
        for n in range(4):
            _request(via, 1, n)
        assert _pod_requests(fleet, i) == before


def _stall(times: list[float], fault_at: float) -> float:
    """A stream's longest wait for its next token from ``fault_at`` on (tokens
    already on their way when a pod froze arrive after it: the stall follows)."""
    after = [fault_at, *(t for t in times if t > fault_at)]
    return max(b - a for a, b in itertools.pairwise(after))


def _round(fleet: Fleet, fault: Callable[[Path], int]) -> tuple[int, list[float]]:
    """Eight clients' requests, twice each, with ``fault`` done to the pod
    serving the most of them while they are answered: what ``fault`` said,
    and each stream's next token after it (those open when it began).
    Every request answered, each as its uninterrupted run answered it."""
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
        baseline = {
            (i, n): ex.submit(_request, fleet, i, n, ROUND_TOKENS)
            for i in range(CLIENTS)
            for n in range(2)
        }
        want = {k: v.result(timeout=300) for k, v in baseline.items()}
    answers: dict[tuple[int, int], Any] = {}
    live: Live = {}

    def client(i: int) -> None:
        for n in range(2):
            got: Any = None
            try:
                got = _request(fleet, i, n, ROUND_TOKENS, live)
            except Exception as exc:
                got = exc
            answers[i, n] = got

    # The pod a previous round struck serves again (a round that failed
    # before its own wait must not fail the next one).
    wait_for(lambda: fleet.routable() == 2, 180, 0.2, what="both pods routable")
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
        clients = [ex.submit(client, i) for i in range(CLIENTS)]
        wait_for(
            lambda: all(p["busy"] > 0 for p in fleet.gateway()["pods"])
            and any(p["streams"] > 0 for p in fleet.gateway()["pods"]),
            60, 0.01, what="both pods serving, a stream open",
        )  # fmt: skip

        def mid_answer() -> dict[str, Any] | None:
            # The pod with the most streams open, at a moment when the streams
            # the gateway counts are the clients' own open ones (none at its
            # end yet counted, none new), and each has had tokens and has a
            # quarter of its answer or more to come: tiny-llama decodes fast,
            # and a stream the gateway counts may have no token yet (CI: "no
            # stream was open at the fault") or be over (a pod struck with
            # nothing in flight).
            pods = fleet.gateway()["pods"]
            counts = [len(t) for t in list(live.values())]
            if sum(p["streams"] for p in pods) != len(counts) or not all(
                2 <= k <= ROUND_TOKENS * 3 // 4 for k in counts
            ):
                return None
            top = max(pods, key=lambda p: (p["streams"], p["busy"]))
            return top if top["streams"] > 0 else None

        busiest = wait_for(mid_answer, 60, 0.005, what="a pod with a stream mid-answer")
        directory = Path(fleet.state()["pods"][busiest["name"]]["dir"])
        fault_at = time.monotonic()
        said = fault(directory)
        for c in clients:
            c.result(timeout=300)
    failed = {k: repr(v) for k, v in answers.items() if isinstance(v, Exception)}
    assert not failed, failed
    for key, got in answers.items():
        assert got["text"] == want[key]["text"], key
        assert len(got["ids"]) == 1, (key, got["ids"])  # one answer id across pods
        if "parts" in got:
            assert got["parts"] == want[key]["parts"], key
    gaps = [  # every stream open at the fault, a client's first request or its second
        _stall(a["times"], fault_at)
        for a in answers.values()
        if a["times"] and a["times"][0] < fault_at < a["times"][-1]
    ]
    assert gaps, "no stream was open at the fault"
    log = (fleet.dir / "logs" / "gateway.log").read_text()
    assert "event=migrating kind=ongoing" in log  # a stream went on from the other pod
    # The pod comes back (restarted by the supervisor as kubelet would, or
    # thawed), and the gateway routes to it again.
    wait_for(lambda: fleet.routable() == 2, 180, 0.2, what="the pod routable again")
    return said, gaps


def test_a_pod_killed_whole_loses_no_request_and_its_streams_go_on_token_exact(
    fleet: Fleet,
) -> None:
    killed, gaps = _round(fleet, kill_pod)
    assert killed >= 6, killed  # lock server, GMS, front, engines and their respawners
    assert max(gaps) <= NEXT_TOKEN_BOUND_S, sorted(gaps)
    assert fleet.gateway_metric('understudy_gateway_migrations_total{reason="reset"}') >= 1
    print(f"kill -> stall: max {max(gaps):.3f}s over {len(gaps)} streams; "
          f"load {os.getloadavg()}")  # fmt: skip


def freeze_pod(directory: Path) -> int:
    """SIGSTOP every process of the pod for FREEZE_S, then SIGCONT (a
    partition that heals, a node that stalls)."""
    pids = pod_processes(directory)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    time.sleep(FREEZE_S)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return len(pids)


def test_a_frozen_pod_is_found_silent_and_its_requests_go_on_elsewhere(fleet: Fleet) -> None:
    frozen, gaps = _round(fleet, freeze_pod)
    assert frozen >= 6, frozen
    # Its streams stalled until it was found silent past --silence (1 s: its
    # probes and its streams' heartbeats), then went on from the other pod,
    # long before the pod thawed.
    assert 0.5 <= max(gaps) <= min(NEXT_TOKEN_BOUND_S, FREEZE_S), sorted(gaps)
    assert fleet.gateway_metric('understudy_gateway_migrations_total{reason="silent"}') >= 1
    print(f"freeze -> stall (detection included): max {max(gaps):.3f}s over "
          f"{len(gaps)} streams; load {os.getloadavg()}")  # fmt: skip


def _drill(f: Fleet, scenario: str, rounds: int, *extra: str) -> dict[str, Any]:
    run = subprocess.run(
        understudy(
            "drill", "--dir", str(f.dir), "--scenario", scenario, "--kills", str(rounds),
            "--clients", str(CLIENTS), "--max-tokens", "64", "--timeout", "120", "--json", *extra,
        ),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return dict(json.loads(run.stdout))


@pytest.mark.timeout(600)
def test_the_drill_kills_and_freezes_pods_under_load_and_loses_nothing(fleet: Fleet) -> None:
    """``understudy drill --scenario pod-kill|pod-freeze``: the busiest pod
    killed whole three times, then frozen for 3 s twice, each round once the
    fleet is armed again; no request fails, every answer is its kind's."""
    wait_for(lambda: fleet.routable() == 2, 180, 0.2, what="both pods routable")
    kill = _drill(fleet, "pod-kill", 3)
    freeze = _drill(fleet, "pod-freeze", 2, "--freeze-seconds", "3")
    for result, rounds in ((kill, 3), (freeze, 2)):
        s = result["summary"]
        assert (s["kills"], s["failovers_ok"]) == (rounds, rounds), result["rounds"]
        assert s["failed_requests"] == 0 and s["wrong_answers"] == 0, result["errors"]
        assert s["split_brain"] == 0, result["split_brain"]
        assert s["streams_caught"] >= 1, s
        assert s["stall_s"]["max"] < NEXT_TOKEN_BOUND_S, s["stall_s"]
        assert s["detect_s"]["n"] == rounds, s
    assert {r["reason"] for r in kill["rounds"]} <= {"reset", "refused"}, kill["rounds"]
    # A frozen pod answers nothing: found silent past --silence (1 s), long
    # before it thaws.
    assert {r["reason"] for r in freeze["rounds"]} == {"silent"}, freeze["rounds"]
    assert 0.5 <= freeze["summary"]["detect_s"]["max"] < 3.0, freeze["summary"]["detect_s"]
    print(
        f"pod-kill: stall p50 {kill['summary']['stall_s']['p50']:.3f}s max "
        f"{kill['summary']['stall_s']['max']:.3f}s; pod-freeze: stall max "
        f"{freeze['summary']['stall_s']['max']:.3f}s, detection max "
        f"{freeze['summary']['detect_s']['max']:.3f}s; load {os.getloadavg()}"
    )
