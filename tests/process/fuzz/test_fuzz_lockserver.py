"""Fuzz the live lock server: hostile clients, then check the truth.

One real ``understudy lockserver serve`` (its Unix socket, and TCP with a
token) runs for the whole test. Each hypothesis example is a program of up to
four clients that connect over either transport, send Acquire, Status and
Watch messages with random engine ids, resume epochs (near the current epoch
or anywhere) and tokens, the same with a field dropped, retyped or added,
random bodies framed or not, a length over the cap, several frames at once or
one frame cut in two, then read or do not, and disconnect: close, half-close
or a TCP reset. In half the examples a legitimate client holds the lock
throughout; a legitimate watcher follows the holder for the whole test.

While a program runs:
- every byte the server sends decodes as its messages;
- a grant goes only to a connection that asked for that engine id, once;
- at most one holder: a grant while another connection holds means that one
  was closed by the server (its EOF is there to read);
- epochs never decrease: a new grant's epoch is above every epoch known when
  it was asked for, a resumed one not below; a status or watch answer is not
  below the epoch known when it was asked; a watch's epochs never go down;
- a status names as holder and waiters only engine ids someone asked for; no
  reconnect window ever opens; no ``internal`` error.
After every example, with every fuzz client gone:
- no waiters; the lock is free, or held by the legitimate client at its epoch;
- the legitimate watcher's last holder is what status says, and it saw every
  grant (engine id and epoch) that any client received;
- a new well-formed Acquire is granted at once with the next epoch (or waits
  behind the legitimate holder), and the server process is alive.
At the end, the server's log holds no traceback.

Budget: ``UNDERSTUDY_FUZZ_EXAMPLES`` examples (default 40; fuzzkit.py), e.g.
``UNDERSTUDY_FUZZ_EXAMPLES=1000 python -m pytest tests/process/fuzz/test_fuzz_lockserver.py``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fuzzkit import (
    deep_json,
    ensure,
    frame,
    fuzz_settings,
    json_values,
    linger_reset,
    log_tail,
    mutations,
    readable,
    timeout_for,
    tracebacks,
    weighted,
)
from hypothesis import given
from hypothesis import strategies as st
from localpod import free_port_block
from procs import Proc, understudy, wait_for

from understudy.lockserver import client
from understudy.lockserver.messages import (
    MAX_FRAME,
    Acquire,
    Error,
    Granted,
    Holder,
    RemoteLockProtocolError,
    StatusReply,
    client_codec,
    server_codec,
)
from understudy.wire.framing import FrameDecoder, RemoteFrameError

pytestmark = [pytest.mark.process]

LEGIT = "legit/holder"
PROBE = "legit/probe"
TOKEN = "s3cret"
N_CONNS = 4
FUZZ_IDS = ("fz/0", "fz/1", "fz/2", LEGIT, PROBE)  # impostors too

# ------------------------------------------------------------ programs ----


@dataclass(frozen=True)
class EpochRef:
    """The current epoch (the highest the test has seen) plus ``offset``."""

    offset: int


@dataclass(frozen=True)
class Doc:
    doc: dict[str, Any]  # values may be EpochRef


@dataclass(frozen=True)
class Body:
    body: bytes  # framed as is


@dataclass(frozen=True)
class Bytes:
    data: bytes  # no frame at all


@dataclass(frozen=True)
class TooLong:
    length: int  # a header announcing more than the cap, and nothing after


Item = Doc | Body | Bytes | TooLong


@dataclass(frozen=True)
class Open:
    conn: int
    tcp: bool


@dataclass(frozen=True)
class Send:
    conn: int
    tcp: bool  # if it opens the connection
    items: tuple[Item, ...]
    cut: int | None  # send in two pieces, split at this byte


@dataclass(frozen=True)
class Close:
    conn: int
    how: str  # close | half | reset | read-then-close


@dataclass(frozen=True)
class Check:
    """A legitimate status request in the middle of the program."""


Op = Open | Send | Close | Check


@dataclass(frozen=True)
class Program:
    legit_holds: bool
    ops: tuple[Op, ...]


engine_ids = weighted(
    (st.sampled_from(FUZZ_IDS), 6),
    (st.text(max_size=6), 1),
    (st.text(min_size=255, max_size=258), 1),
)
resume_epochs = weighted(
    (st.none(), 5),
    (st.builds(EpochRef, st.integers(-2, 1)), 4),
    (st.integers(-3, 3), 1),
    (st.integers(2**53 - 2, 2**64), 1),
)
tokens = weighted(
    (st.just(TOKEN), 12), (st.none(), 4), (st.text(max_size=8), 1), (st.integers(), 1)
)


@st.composite
def valid_docs(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["acquire", "acquire", "acquire", "status", "watch"]))
    doc: dict[str, Any] = {"type": kind}
    if kind == "acquire":
        doc["engine_id"] = draw(engine_ids)
        resume = draw(resume_epochs)
        if resume is not None or draw(st.booleans()):
            doc["resume_epoch"] = resume
    token = draw(tokens)
    if token is not None or draw(st.booleans()):
        doc["token"] = token
    return doc


items: st.SearchStrategy[Item] = weighted(
    (st.builds(Doc, valid_docs()), 40),
    (st.builds(Doc, mutations(valid_docs())), 1),
    (st.builds(Doc, st.dictionaries(st.text(max_size=8), json_values, max_size=3)), 1),
    (st.builds(Body, st.binary(max_size=40)), 1),
    (st.builds(Body, st.builds(json.dumps, json_values).map(str.encode)), 1),
    (st.builds(Body, deep_json(MAX_FRAME // 2 - 2)), 1),
    (st.builds(Bytes, st.binary(min_size=1, max_size=40)), 1),
    (st.builds(TooLong, st.integers(MAX_FRAME + 1, 2**32 - 1)), 1),
)

conn_ids = st.integers(0, N_CONNS - 1)
ops: st.SearchStrategy[Op] = weighted(
    (st.builds(Open, conn_ids, st.booleans()), 1),
    (
        st.builds(
            Send,
            conn_ids,
            st.booleans(),
            st.lists(items, min_size=1, max_size=2).map(tuple),
            st.none(),
        ),
        6,
    ),
    (
        st.builds(
            Send,
            conn_ids,
            st.booleans(),
            st.lists(items, min_size=1, max_size=2).map(tuple),
            st.integers(1, 60),
        ),
        1,
    ),
    (st.builds(Close, conn_ids, st.sampled_from(["close", "half", "reset", "read-then-close"])), 2),
    (st.just(Check()), 1),
)
programs = st.builds(Program, st.booleans(), st.lists(ops, min_size=1, max_size=16).map(tuple))

# ---------------------------------------------------------- the server ----


class Server:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.sock = tmp / "lock.sock"
        self.log = tmp / "lockserver.log"
        token_file = tmp / "token"
        token_file.write_text(TOKEN + "\n")
        self.port = free_port_block(1)
        self.proc = Proc(
            understudy(
                "lockserver", "serve",
                "--socket", str(self.sock),
                "--state-file", str(tmp / "lock.state"),
                "--reconnect-window", "0.3",
                "--tcp", f"127.0.0.1:{self.port}",
                "--token-file", str(token_file),
            ),
            log=self.log,
        )  # fmt: skip
        # A fresh state file opens a short window (an unknown holder may come
        # back); wait it out, so that no window ever opens while fuzzing.
        wait_for(self._free, 20, 0.05, what="lock server up, its first window over")

    def _free(self) -> bool:
        try:
            return not client.status(self.sock, timeout=0.5).window_open
        except client.LockError:
            return False

    def status(self) -> client.StatusReply:
        return client.status(self.sock, timeout=5)

    def connect(self, tcp: bool) -> socket.socket:
        if tcp:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        else:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(str(self.sock))
        return s


# ----------------------------------------------------------- the model ----


@dataclass
class Conn:
    """One client connection and what the test knows about it."""

    name: str
    sock: socket.socket
    tcp: bool
    shadow: FrameDecoder = field(default_factory=lambda: FrameDecoder(MAX_FRAME))
    shadow_dead: bool = False  # what we sent makes the server close it
    replies: Any = field(default_factory=server_codec)
    asked: set[str] = field(default_factory=set)  # engine ids the server may grant it
    acquire_floor: int | None = None  # the epoch known at its first acquire
    status_floors: deque[int] = field(default_factory=deque)
    watch_floors: deque[int] = field(default_factory=deque)
    holder_epoch: int | None = None  # the last epoch its watch reported
    granted: Granted | None = None
    eof: bool = False
    closed: bool = False  # by the test

    @property
    def holds(self) -> bool:
        return self.granted is not None and not self.eof and not self.closed


class Fuzzer:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.epoch = server.status().epoch  # the highest epoch seen anywhere
        self.asked_ever: set[str] = {LEGIT, PROBE}
        self.grants: set[tuple[str, int]] = set()  # every (engine id, epoch) granted
        self.fresh_epochs: set[int] = set()  # epochs of grants that were not resumes
        self.stats: Counter[str] = Counter()  # what the fuzz clients got, for -s
        self.conns: dict[int, Conn] = {}  # the fuzz clients
        self.legit: Conn | None = None
        self.probe: Conn | None = None
        self.watcher = self._open("watcher", tcp=False)
        self.watch_history: list[Holder] = []
        self._send_doc(self.watcher, {"type": "watch"})
        wait_for(lambda: self._pump(0.01) or self.watch_history, 5, what="first holder")

    # --- connections ------------------------------------------------------

    def _open(self, name: str, tcp: bool) -> Conn:
        return Conn(name, self.server.connect(tcp), tcp)

    def _all(self) -> list[Conn]:
        others = [c for c in (self.legit, self.probe, self.watcher) if c is not None]
        return [*self.conns.values(), *others]

    def _send_doc(self, conn: Conn, doc: dict[str, Any]) -> None:
        self._send(conn, frame(json.dumps(doc).encode()))

    def _send(self, conn: Conn, data: bytes, cut: int | None = None) -> None:
        self._shadow(conn, data)
        with contextlib.suppress(OSError):  # the server may have closed it already
            if cut is None or not 0 < cut < len(data):
                conn.sock.sendall(data)
            else:
                conn.sock.sendall(data[:cut])
                time.sleep(0.002)
                conn.sock.sendall(data[cut:])

    def _shadow(self, conn: Conn, data: bytes) -> None:
        """Decode what we send as the server will, to know what it may act on.

        The server parses a whole read at once, so a valid message that shares
        a read with an invalid one may be dropped: what is recorded here is
        what the server *may* process (a superset), never less."""
        if conn.shadow_dead:
            return
        try:
            bodies = conn.shadow.feed(data)
        except RemoteFrameError:
            conn.shadow_dead = True
            return
        codec = client_codec()
        for body in bodies:
            try:
                msg = codec.parse(body)
            except RemoteLockProtocolError:
                conn.shadow_dead = True
                return
            if conn.tcp and msg.token != TOKEN:
                conn.shadow_dead = True
                return
            match msg.type:
                case "acquire":
                    assert isinstance(msg, Acquire)
                    conn.asked.add(msg.engine_id)
                    self.asked_ever.add(msg.engine_id)
                    if conn.acquire_floor is None:
                        conn.acquire_floor = self.epoch
                case "status":
                    conn.status_floors.append(self.epoch)
                case "watch":
                    conn.watch_floors.append(self.epoch)

    # --- reading and judging ------------------------------------------------

    def _pump(self, timeout: float) -> bool:
        """Read whatever arrived on any connection and judge it; True if anything did."""
        got = False
        for sock in readable([c.sock for c in self._all() if not c.eof and not c.closed], timeout):
            conn = next(c for c in self._all() if c.sock is sock)
            # Judging a grant may have read this socket since the select (the
            # two-holders check pumps too): a blocking recv would wait for more.
            if conn.eof or conn.closed or not readable([sock], 0):
                continue
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            got = True
            if not data:
                conn.eof = True
                self.stats["closed by the server"] += 1
                continue
            try:
                messages = conn.replies.feed(data)
            except RemoteLockProtocolError as exc:
                raise AssertionError(
                    f"{conn.name}: undecodable bytes from the server: {exc}"
                ) from None
            for msg in messages:
                self._judge(conn, msg)
        return got

    def _judge(self, conn: Conn, msg: Any) -> None:
        if conn.name.startswith("fuzz"):
            self.stats[msg.type + (f" {msg.code}" if isinstance(msg, Error) else "")] += 1
            if isinstance(msg, Granted):
                self.stats["granted, resumed"] += msg.resumed
        match msg:
            case Granted():
                self._judge_grant(conn, msg)
            case StatusReply():
                ensure(conn.status_floors, f"{conn.name}: a status reply nobody asked for: {msg}")
                floor = conn.status_floors.popleft()
                self._judge_status(msg, floor, f"{conn.name}'s status")
            case Holder():
                if conn.holder_epoch is None:
                    ensure(conn.watch_floors, f"{conn.name}: a holder nobody watched: {msg}")
                    floor = conn.watch_floors.popleft()
                else:
                    floor = conn.holder_epoch
                ensure(
                    msg.epoch >= floor,
                    f"{conn.name}: watch epoch {msg.epoch} below {floor} (epochs went down)",
                )
                ensure(not msg.window_open, f"{conn.name}: a window opened: {msg}")
                ensure(
                    msg.holder is None or msg.holder in self.asked_ever,
                    f"{conn.name}: watch names holder {msg.holder!r}, which nobody asked for",
                )
                conn.holder_epoch = msg.epoch
                self.epoch = max(self.epoch, msg.epoch)
                if conn is self.watcher:
                    self.watch_history.append(msg)
            case Error():
                ensure(msg.code != "internal", f"{conn.name}: internal error {msg}")
            case _:
                raise AssertionError(f"{conn.name}: unexpected message {msg}")

    def _judge_grant(self, conn: Conn, g: Granted) -> None:
        ensure(
            g.engine_id in conn.asked,
            f"{conn.name}: granted {g.engine_id!r}, but it asked for {sorted(conn.asked)}",
        )
        ensure(conn.granted is None, f"{conn.name}: granted twice ({conn.granted}, then {g})")
        floor = conn.acquire_floor
        assert floor is not None
        if g.resumed:
            ensure(g.epoch >= floor, f"{conn.name}: resumed at {g.epoch} below {floor}")
        else:
            ensure(g.epoch > floor, f"{conn.name}: new grant at {g.epoch}, not above {floor}")
            ensure(g.epoch not in self.fresh_epochs, f"epoch {g.epoch} granted twice")
            self.fresh_epochs.add(g.epoch)
        # Recorded first: the two-holders check below reads on, this connection too.
        conn.granted = g
        self.grants.add((g.engine_id, g.epoch))
        self.epoch = max(self.epoch, g.epoch)
        # At most one holder: any other connection that held must be gone,
        # closed by the server (its EOF is there to read), or closed by us.
        for other in self._all():
            if other is conn or not other.holds:
                continue
            deadline = time.monotonic() + 2.0
            while other.holds and time.monotonic() < deadline:
                self._pump(0.05)
            ensure(
                not other.holds,
                f"two holders: {conn.name} got {g} while {other.name} holds {other.granted}",
            )

    def _judge_status(self, st: StatusReply | client.StatusReply, floor: int, who: str) -> None:
        ensure(st.epoch >= floor, f"{who}: epoch {st.epoch} below {floor} (epochs went down)")
        ensure(not st.window_open, f"{who}: a window opened: {st}")
        ensure(
            st.holder is None or st.holder in self.asked_ever,
            f"{who}: holder {st.holder!r}, which nobody asked for",
        )
        ensure(
            set(st.waiters) <= self.asked_ever,
            f"{who}: waiters {st.waiters} include ids nobody asked for",
        )
        self.epoch = max(self.epoch, st.epoch)

    def check_status(self) -> client.StatusReply:
        floor = self.epoch
        st = self.server.status()
        self._judge_status(st, floor, "status")
        return st

    # --- a program -----------------------------------------------------------

    def render(self, item: Item) -> bytes:
        match item:
            case Doc(doc=doc):
                resolved = {
                    k: (self.epoch + v.offset if isinstance(v, EpochRef) else v)
                    for k, v in doc.items()
                }
                return frame(json.dumps(resolved).encode())
            case Body(body=body):
                return frame(body)
            case Bytes(data=data):
                return data
            case TooLong(length=length):
                return length.to_bytes(4, "big")
        raise AssertionError(item)

    def run(self, program: Program) -> None:
        self.stats["examples"] += 1
        self._set_legit(program.legit_holds)
        try:
            for op in program.ops:
                self._step(op)
                self._pump(0.005)
            while self._pump(0.02):  # read what is on its way before hanging up
                pass
        finally:
            for conn in self.conns.values():
                self._close(conn, "close")
            self.conns.clear()
        self.settle()

    def _step(self, op: Op) -> None:
        match op:
            case Open(conn=i, tcp=tcp):
                if i not in self.conns:
                    self.conns[i] = self._open(f"fuzz{i}/{'tcp' if tcp else 'unix'}", tcp)
            case Send(conn=i, tcp=tcp, items=its, cut=cut):
                if i in self.conns and self.conns[i].eof:  # the server closed it: a new one
                    self._close(self.conns.pop(i), "close")
                self._step(Open(i, tcp))
                data = b"".join(self.render(it) for it in its)
                self._send(self.conns[i], data, cut)
            case Close(conn=i, how=how):
                if i in self.conns:
                    self._close(self.conns.pop(i), how)
            case Check():
                self.check_status()

    def _close(self, conn: Conn, how: str) -> None:
        if how == "read-then-close":
            self._pump(0.05)
        with contextlib.suppress(OSError):
            if how == "half":
                conn.sock.shutdown(socket.SHUT_WR)
                self._pump(0.02)  # what it sent before the half-close is still answered
            elif how == "reset":
                linger_reset(conn.sock)
        conn.sock.close()
        conn.closed = True

    def _set_legit(self, holds: bool) -> None:
        if holds and self.legit is None:
            self.legit = self._grant_probe(LEGIT)
        elif not holds and self.legit is not None:
            self._close(self.legit, "close")
            self.legit = None
            wait_for(lambda: self.server.status().holder is None, 5, what="legit released")

    def _grant_probe(self, engine_id: str) -> Conn:
        """A well-formed Acquire on a free lock: granted at once, with the next epoch."""
        before = self.check_status()
        ensure(before.holder is None, f"the lock is not free: {before}")
        conn = self.probe = self._open(engine_id, tcp=False)
        try:
            self._send_doc(conn, {"type": "acquire", "engine_id": engine_id})
            wait_for(lambda: self._pump(0.01) and conn.granted, 5, what=f"{engine_id} granted")
        finally:
            self.probe = None
        assert conn.granted is not None
        ensure(
            conn.granted.epoch == before.epoch + 1 and not conn.granted.resumed,
            f"a well-formed acquire on a free lock at epoch {before.epoch} got {conn.granted}",
        )
        return conn

    def settle(self) -> None:
        """Every fuzz client is gone: the lock is as the legitimate client left it."""
        want = LEGIT if self.legit is not None else None

        def settled() -> client.StatusReply | None:
            self._pump(0)
            st = self.check_status()
            return st if st.holder == want and st.waiters == () else None

        try:
            st = wait_for(settled, 5, 0.01, what="no waiters, lock free or legit's")
        except TimeoutError:
            raise AssertionError(f"after the fuzz clients left: {self.server.status()}") from None
        if self.legit is not None:
            assert self.legit.granted is not None
            ensure(
                st.epoch == self.legit.granted.epoch,
                f"the legitimate holder's epoch is {self.legit.granted.epoch}, status says {st}",
            )

        def watch_agrees() -> bool:
            self._pump(0.01)
            last = self.watch_history[-1]
            return (last.holder, last.epoch) == (st.holder, st.epoch)

        wait_for(watch_agrees, 5, what=f"the watch to agree with status {st}")
        seen = {(h.holder, h.epoch) for h in self.watch_history}
        missing = {g for g in self.grants if g not in seen}
        ensure(not missing, f"grants the watch never reported: {missing}")
        ensure(self.server.proc.alive(), "the lock server died")
        # A well-formed request gets the right answer.
        if self.legit is None:
            probe = self._grant_probe(PROBE)
            self._close(probe, "close")
            wait_for(lambda: self.server.status().holder is None, 5, what="probe released")
            return
        probe = self.probe = self._open(PROBE, tcp=True)
        try:
            self._send_doc(probe, {"type": "acquire", "engine_id": PROBE, "token": TOKEN})
            wait_for(lambda: self.server.status().waiters == (PROBE,), 5, what="probe waits")
            self._pump(0.02)
            ensure(probe.granted is None, f"granted while {LEGIT} holds: {probe.granted}")
        finally:
            self.probe = None
            self._close(probe, "close")
        wait_for(lambda: self.server.status().waiters == (), 5, what="probe gone")


@timeout_for(setup_s=30, per_example_s=2)
def test_fuzz_lockserver(tmp_path: Path) -> None:
    server = Server(tmp_path)
    try:
        fuzzer = Fuzzer(server)

        @fuzz_settings()
        @given(programs)
        def fuzz(program: Program) -> None:
            fuzzer.run(program)

        try:
            fuzz()
        finally:
            print(f"lock server fuzz: {dict(fuzzer.stats)}\n{log_tail(server.log)}")
        assert server.proc.alive()
        assert tracebacks(server.log) == []
    finally:
        server.proc.stop()
