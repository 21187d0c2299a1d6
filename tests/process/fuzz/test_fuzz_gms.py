"""Fuzz a live GPU Memory Service: hostile clients, fds and hang-ups, then the truth.

One real ``gms server`` (host backend: memfds) runs for each test. Each
hypothesis example is a program of up to four clients that send every GMS
request with random arguments (hello in any mode with short timeouts,
allocate, export and export_many of ids that exist or not, metadata, commit,
state), the same with a field dropped, retyped or added, random bodies framed
or not, a length over the cap, frames cut in two, requests with an fd of their
own attached (SCM_RIGHTS), then read or do not, wait for timeouts, and hang up
(close, half-close).

Two tests:
- ``committed``: a legitimate writer process (tests/process/gms/agent.py, the
  real client library) loaded and committed a layout and keeps reading it, so
  a fuzz writer can only wait; the layout, its hash and its bytes must survive
  everything;
- ``empty``: the fuzz clients may take the writer's lock themselves: allocate,
  commit, abort by hanging up, replace each other's layouts.

While a program runs:
- every reply decodes; an ``exported`` reply carries exactly one fd and no
  other reply carries any; the fd is the allocation's size, and read-only
  unless the session is the writer's;
- a session is granted once per hello; at most one writer at a time (a grant
  while another connection holds RW means the server closed that one);
  in ``committed`` no fuzz client is ever granted RW.
After every example, with every fuzz client gone:
- no session or waiter is left but the legitimate reader;
- ``committed``: the same layout hash, allocations and bytes; ``empty``: either
  nothing committed and no allocation, or a committed layout whose hash is the
  hash of what the server lists;
- no memfd leaked: the server holds exactly the committed allocations (and its
  other fds are what they were), the test process holds none, and no fd a
  client sent was ever installed in the server;
- a well-formed client is answered right: RO with the committed hash and every
  allocation exported read-only at its size (or, nothing committed, RW that
  allocates and commits), and the server process is alive.
At the end, the legitimate reader never lost its session, its bytes are
intact, and the server's log holds no traceback.

Budget: ``UNDERSTUDY_FUZZ_EXAMPLES`` examples (default 40; fuzzkit.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Iterator
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
    log_tail,
    mutations,
    readable,
    timeout_for,
    tracebacks,
    weighted,
)
from gmsprocs import Agent, Gms, memfd_holders
from hypothesis import given
from hypothesis import strategies as st
from procs import wait_for

from understudy.gms import layout
from understudy.gms import messages as m
from understudy.gms.client import query_state
from understudy.wire.framing import FrameDecoder, RemoteFrameError
from understudy.wire.uds import recv_frame, send_frame

pytestmark = [pytest.mark.process]


@pytest.fixture
def gms(tmp_path: Path) -> Iterator[Gms]:
    g = Gms(tmp_path)
    try:
        yield g
    finally:
        g.stop()


MiB = 1 << 20
GRANULARITY = 2 * MiB  # the host backend's default
N_CONNS = 4
CLIENT_FD_NAME = "understudy-fuzz-client-fd"

# ------------------------------------------------------------ programs ----


@dataclass(frozen=True)
class AllocRef:
    """An allocation id the test knows of (the ``pick``-th, modulo), else ``pick``."""

    pick: int


@dataclass(frozen=True)
class Doc:
    doc: dict[str, Any]  # values (and list items) may be AllocRef


@dataclass(frozen=True)
class Body:
    body: bytes


@dataclass(frozen=True)
class Bytes:
    data: bytes


@dataclass(frozen=True)
class TooLong:
    length: int


Item = Doc | Body | Bytes | TooLong


@dataclass(frozen=True)
class Send:
    conn: int
    items: tuple[Item, ...]
    cut: int | None
    with_fd: bool  # attach an fd of our own (the server must never take it)
    greet: str | None = None  # a new connection first says hello in this mode


@dataclass(frozen=True)
class Close:
    conn: int
    how: str  # close | half | read-then-close


@dataclass(frozen=True)
class Pause:
    seconds: float  # let hello timeouts run out


Op = Send | Close | Pause

alloc_refs = weighted((st.builds(AllocRef, st.integers(0, 7)), 6), (st.integers(-2, 2**64), 1))
sizes = weighted(
    (st.integers(1, 3 * GRANULARITY), 8),
    (st.integers(-2, 0), 1),
    (st.integers((1 << 48) - 1, (1 << 48) + 1), 1),
)
timeouts = weighted(
    (st.just(0), 2),
    (st.floats(0.001, 0.3), 6),
    (st.floats(-1, 0) | st.floats(24 * 3600.0, 1e300) | st.just(float("inf")), 1),
)
meta_keys = weighted((st.sampled_from(["a", "b", "weights/0"]), 6), (st.text(max_size=520), 1))
meta_values = st.dictionaries(st.text(max_size=6), json_values, max_size=3)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(
        weighted(
            (st.just("hello"), 6),
            (st.just("allocate"), 4),
            (st.just("export"), 3),
            (st.just("export_many"), 2),
            (st.just("commit"), 3),
            (st.just("put_metadata"), 2),
            (st.sampled_from(["list_allocations", "get_metadata", "list_metadata"]), 2),
            (st.sampled_from(["get_layout_hash", "get_state"]), 2),
        )
    )
    doc: dict[str, Any] = {"type": kind}
    match kind:
        case "hello":
            doc["mode"] = draw(
                weighted((st.sampled_from(["RW", "RO", "RW_OR_RO"]), 8), (st.text(max_size=3), 1))
            )
            doc["timeout_s"] = draw(timeouts)
            if draw(st.booleans()):
                doc["client"] = draw(st.text(max_size=130))
        case "allocate":
            doc["size"] = draw(sizes)
            if draw(st.booleans()):
                doc["tag"] = draw(weighted((st.just("weights"), 4), (st.text(max_size=66), 1)))
        case "export":
            doc["id"] = draw(alloc_refs)
        case "export_many":
            doc["ids"] = draw(
                weighted(
                    (st.lists(alloc_refs, min_size=1, max_size=4), 8),
                    (st.just([]), 1),
                    (st.just([AllocRef(0)] * (m.MAX_EXPORT_BATCH + 1)), 1),
                )
            )
        case "put_metadata":
            doc["key"] = draw(meta_keys)
            doc["value"] = draw(meta_values)
        case "get_metadata":
            doc["key"] = draw(meta_keys)
    return doc


items: st.SearchStrategy[Item] = weighted(
    (st.builds(Doc, requests()), 30),
    (st.builds(Doc, mutations(requests())), 2),
    (st.builds(Doc, st.dictionaries(st.text(max_size=8), json_values, max_size=3)), 1),
    (st.builds(Body, st.binary(max_size=40)), 1),
    (st.builds(Body, deep_json(20_000)), 1),
    (st.builds(Bytes, st.binary(min_size=1, max_size=40)), 1),
    (st.builds(TooLong, st.integers(m.MAX_REQUEST_FRAME + 1, 2**32 - 1)), 1),
)
# Mostly one connection, so that a session gets far (hello, allocate, commit).
conn_ids = weighted((st.just(0), 6), (st.just(1), 3), (st.integers(2, N_CONNS - 1), 2))
item_lists = st.lists(items, min_size=1, max_size=2).map(tuple)
with_fds = weighted((st.just(False), 5), (st.just(True), 1))
greetings = weighted((st.sampled_from(["RW", "RO", "RW_OR_RO"]), 3), (st.none(), 1))
ops: st.SearchStrategy[Op] = weighted(
    (st.builds(Send, conn_ids, item_lists, st.none(), with_fds, greetings), 12),
    (st.builds(Send, conn_ids, item_lists, st.integers(1, 40), with_fds, greetings), 2),
    (st.builds(Close, conn_ids, st.sampled_from(["close", "half", "read-then-close"])), 3),
    (st.builds(Pause, st.floats(0.01, 0.35)), 1),
)
programs = st.lists(ops, min_size=1, max_size=16).map(tuple)

# ----------------------------------------------------- server's fds ----

_MEMFD = re.compile(r"^/memfd:understudy-gms-(\d+)-\d+-(\d+)")


@dataclass(frozen=True)
class FdTable:
    memfds: Counter[int]  # allocation id -> open fds of it
    other: Counter[str]  # everything else, by kind (socket, pipe, anon_inode:…)


def fd_table(pid: int) -> FdTable:
    memfds: Counter[int] = Counter()
    other: Counter[str] = Counter()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if match := _MEMFD.match(target):
            memfds[int(match.group(2))] += 1
        else:
            other[re.sub(r"\[\d+\]|/proc/\d+/.*|:\d+$", "", target)] += 1
    return FdTable(memfds, other)


def steady_fd_table(pid: int) -> FdTable:
    """The server's fds once the connections the test just closed are gone too."""
    seen = [fd_table(pid)]
    while len(seen) < 4 or any(t != seen[-1] for t in seen[-4:]):
        time.sleep(0.05)
        seen.append(fd_table(pid))
        ensure(len(seen) < 200, "the server's fds never settle")
    return seen[-1]


def own_memfds(pid: int) -> list[str]:
    """This test process's fds of the server's memfds (received and not closed)."""
    out = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if f"understudy-gms-{pid}-" in os.readlink(fd):
                out.append(fd.name)
    return out


# ----------------------------------------------------------- the model ----


@dataclass
class Conn:
    name: str
    sock: socket.socket
    shadow: FrameDecoder = field(default_factory=lambda: FrameDecoder(m.MAX_REQUEST_FRAME))
    shadow_dead: bool = False
    hellos: int = 0  # valid hellos the server may process
    granted: m.Granted | None = None
    committed: bool = False
    eof: bool = False
    closed: bool = False

    @property
    def writes(self) -> bool:
        return (
            self.granted is m.Granted.RW and not self.committed and not self.eof and not self.closed
        )


class Fuzzer:
    def __init__(self, gms: Gms, pid: int, committed: bool) -> None:
        self.gms = gms
        self.path = gms.path()
        self.pid = pid
        self.legit_reader = committed  # the committed test keeps a legit RO session
        self.conns: dict[int, Conn] = {}
        self.ids: list[int] = []  # allocation ids the test has seen
        self.stats: Counter[str] = Counter()
        self.client_fd = os.memfd_create(CLIENT_FD_NAME)
        os.ftruncate(self.client_fd, 4096)
        self.expected: m.StateReport | None = None
        if committed:
            self.expected = self.state()
            self.ids = [a.id for a in self.probe_ro(self.expected.layout_hash)]
        self.baseline = steady_fd_table(pid)

    def close(self) -> None:
        os.close(self.client_fd)

    def state(self) -> m.StateReport:
        return query_state(self.path, 5)

    # --- sending ------------------------------------------------------------

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, AllocRef):
            return self.ids[value.pick % len(self.ids)] if self.ids else value.pick
        if isinstance(value, list):
            return [self._resolve(v) for v in value]
        return value

    def render(self, item: Item) -> bytes:
        match item:
            case Doc(doc=doc):
                return frame(json.dumps({k: self._resolve(v) for k, v in doc.items()}).encode())
            case Body(body=body):
                return frame(body)
            case Bytes(data=data):
                return data
            case TooLong(length=length):
                return length.to_bytes(4, "big")
        raise AssertionError(item)

    def _shadow(self, conn: Conn, data: bytes) -> None:
        """What the server may act on (as in the lock server's fuzzer)."""
        if conn.shadow_dead:
            return
        try:
            bodies = conn.shadow.feed(data)
        except RemoteFrameError:
            conn.shadow_dead = True
            return
        for body in bodies:
            try:
                req = m.REQUEST_ADAPTER.validate_json(body)
            except ValueError:
                conn.shadow_dead = True
                return
            if isinstance(req, m.Hello):
                conn.hellos += 1

    def send(self, conn: Conn, data: bytes, cut: int | None, with_fd: bool) -> None:
        self._shadow(conn, data)
        first, rest = (data[:cut], data[cut:]) if cut and 0 < cut < len(data) else (data, b"")
        with contextlib.suppress(OSError):
            send_frame(conn.sock, first, self.client_fd if with_fd else None)
            if rest:
                time.sleep(0.002)
                conn.sock.sendall(rest)

    # --- reading and judging --------------------------------------------------

    def pump(self, timeout: float) -> bool:
        got = False
        live = [c for c in self.conns.values() if not c.eof and not c.closed]
        for sock in readable([c.sock for c in live], timeout):
            conn = next(c for c in live if c.sock is sock)
            # Judging a grant may have read this socket since the select (the
            # two-writers check pumps too): a blocking read would wait for more.
            if conn.eof or conn.closed or not readable([sock], 0):
                continue
            got = True
            try:
                body, fd = recv_frame(sock, m.MAX_REPLY_FRAME)
            except (ConnectionError, TimeoutError):
                conn.eof = True
                self.stats["closed by the server"] += 1
                continue
            except RemoteFrameError as exc:
                raise AssertionError(f"{conn.name}: the server sent a bad frame: {exc}") from None
            try:
                reply = m.REPLY_ADAPTER.validate_json(body)
            except ValueError as exc:
                raise AssertionError(f"{conn.name}: undecodable reply {body[:200]!r}") from exc
            try:
                self.judge(conn, reply, fd.fd if fd else None)
            finally:
                if fd is not None:
                    fd.close()
        return got

    def judge(self, conn: Conn, reply: m.Reply, fd: int | None) -> None:
        self.stats[reply.type + (f" {reply.code}" if isinstance(reply, m.ErrorReply) else "")] += 1
        ensure(
            (fd is not None) == isinstance(reply, m.Exported),
            f"{conn.name}: {reply.type} with fd {fd}",
        )
        match reply:
            case m.Exported(allocation=a):
                assert fd is not None
                self._judge_export(conn, a, fd)
            case m.HelloOk(granted=granted):
                self._judge_grant(conn, granted)
            case m.Allocated(allocation=a):
                ensure(conn.writes, f"{conn.name}: allocated outside an RW session: {a}")
                ensure(a.size % GRANULARITY == 0 and a.size >= a.requested, f"bad alignment {a}")
                self._learn(a.id)
            case m.Committed():
                ensure(conn.writes, f"{conn.name}: a commit outside an RW session")
                conn.committed = True
            case m.ErrorReply(code=code):
                if code is m.ErrorCode.TIMEOUT:
                    conn.hellos = max(0, conn.hellos - 1)  # the wait ended; it may ask again
            case m.Allocations(allocations=infos):
                for a in infos:
                    self._learn(a.id)

    def _judge_export(self, conn: Conn, a: m.AllocationInfo, fd: int) -> None:
        size = os.fstat(fd).st_size
        ensure(size == a.size, f"{conn.name}: fd of {size} bytes for {a}")
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        ensure(conn.granted is not None, f"{conn.name}: an export before any grant")
        if conn.granted is m.Granted.RO or conn.committed:
            ensure(mode == os.O_RDONLY, f"{conn.name}: a writable fd in an RO session: {a}")
        self._learn(a.id)

    def _judge_grant(self, conn: Conn, granted: m.Granted) -> None:
        ensure(conn.hellos > 0, f"{conn.name}: granted {granted} without a hello")
        ensure(conn.granted is None, f"{conn.name}: granted {granted} after {conn.granted}")
        conn.hellos -= 1
        # Recorded first: the two-writers check reads on, this connection too.
        conn.granted = granted
        if granted is m.Granted.RW:
            ensure(not self.legit_reader, f"{conn.name}: RW granted over a reader")
            self._one_writer(conn)

    def _learn(self, alloc_id: int) -> None:
        if alloc_id not in self.ids:
            self.ids.append(alloc_id)

    def _one_writer(self, conn: Conn) -> None:
        for other in self.conns.values():
            if other is conn or not other.writes:
                continue
            deadline = time.monotonic() + 2.0
            while other.writes and time.monotonic() < deadline:
                self.pump(0.05)
            ensure(not other.writes, f"two writers: {conn.name} and {other.name}")

    # --- a program -----------------------------------------------------------

    def _conn(self, i: int) -> Conn:
        conn = self.conns.get(i)
        if conn is not None and conn.eof:
            self.hang_up(self.conns.pop(i), "close")
            conn = None
        if conn is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(str(self.path))
            conn = self.conns[i] = Conn(f"fuzz{i}", s)
        return conn

    def hang_up(self, conn: Conn, how: str) -> None:
        if how == "read-then-close":
            self.pump(0.05)
        if how == "half":
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
            self.pump(0.02)
        conn.sock.close()
        conn.closed = True

    def run(self, program: tuple[Op, ...]) -> None:
        self.stats["examples"] += 1
        try:
            for op in program:
                match op:
                    case Send(conn=i, items=its, cut=cut, with_fd=with_fd, greet=greet):
                        fresh = i not in self.conns or self.conns[i].eof
                        conn = self._conn(i)
                        if fresh and greet is not None:
                            hello = {"type": "hello", "mode": greet, "timeout_s": 0.2}
                            self.send(conn, frame(json.dumps(hello).encode()), None, False)
                        data = b"".join(self.render(it) for it in its)
                        self.send(conn, data, cut, with_fd)
                    case Close(conn=i, how=how):
                        if i in self.conns:
                            self.hang_up(self.conns.pop(i), how)
                    case Pause(seconds=seconds):
                        self.pump(seconds)
                self.pump(0.005)
            while self.pump(0.02):
                pass
        finally:
            for conn in self.conns.values():
                self.hang_up(conn, "close")
            self.conns.clear()
        self.settle()

    # --- after the program ----------------------------------------------------

    def settle(self) -> None:
        readers = 1 if self.legit_reader else 0

        def quiet() -> m.StateReport | None:
            st = self.state()
            idle = st.sessions == {m.Granted.RW: 0, m.Granted.RO: readers} and st.waiting == 0
            return st if idle else None

        try:
            st = wait_for(quiet, 5, 0.01, what="every fuzz session gone")
        except TimeoutError:
            raise AssertionError(f"sessions left after the fuzz clients: {self.state()}") from None
        if self.expected is not None:
            ensure(
                st.model_dump(exclude={"gpu"}) == self.expected.model_dump(exclude={"gpu"}),
                f"the committed layout changed: {st}, was {self.expected}",
            )
        elif not st.committed:
            ensure(
                st.state is m.LockState.EMPTY
                and st.allocations == 0
                and st.bytes == 0
                and st.layout_hash is None,
                f"nothing committed, yet {st}",
            )
        # The well-formed client, and what it lists is what the server holds.
        infos = self.probe_ro(st.layout_hash) if st.committed else self.probe_rw()
        committed_ids = Counter(a.id for a in infos)

        def fds_settled() -> FdTable | None:
            table = fd_table(self.pid)
            ok = set(table.memfds) == set(committed_ids) and all(
                n <= 2 for n in table.memfds.values()
            )
            return table if ok and table.other == self.baseline.other else None

        try:
            wait_for(fds_settled, 5, 0.02, what="the server's fds back to the committed layout's")
        except TimeoutError:
            table = fd_table(self.pid)
            raise AssertionError(
                f"server fds: memfds {dict(table.memfds)} for allocations {sorted(committed_ids)};"
                f" other {dict(table.other)}, was {dict(self.baseline.other)}"
            ) from None
        ensure(not own_memfds(self.pid), "the test kept memfds it received")
        taken = [h for h in memfd_holders(CLIENT_FD_NAME) if h.startswith(f"{self.pid} ")]
        ensure(not taken, f"the server took fds a client sent: {taken}")

    def _raw(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(str(self.path))
        return s

    def _ask(
        self, s: socket.socket, doc: dict[str, Any], n: int = 1
    ) -> list[tuple[m.Reply, int | None]]:
        s.sendall(frame(json.dumps(doc).encode()))
        out = []
        for _ in range(n):
            body, fd = recv_frame(s, m.MAX_REPLY_FRAME)
            out.append((m.REPLY_ADAPTER.validate_json(body), fd.detach() if fd else None))
        return out

    def probe_ro(self, layout_hash: str | None) -> list[m.AllocationInfo]:
        """A well-formed reader: granted RO on the committed hash; every allocation
        exported read-only at its size; the hash is that of what it lists."""
        with self._raw() as s:
            ((hello, _),) = self._ask(s, {"type": "hello", "mode": "RO", "timeout_s": 5})
            ensure(
                isinstance(hello, m.HelloOk)
                and hello.granted is m.Granted.RO
                and hello.layout_hash == layout_hash,
                f"a well-formed reader got {hello}, the committed hash is {layout_hash}",
            )
            ((listed, _),) = self._ask(s, {"type": "list_allocations"})
            ((meta, _),) = self._ask(s, {"type": "list_metadata"})
            assert isinstance(listed, m.Allocations) and isinstance(meta, m.MetadataList)
            infos = list(listed.allocations)
            records = [layout.AllocationRecord(a.id, a.size, a.requested, a.tag) for a in infos]
            metadata = [
                layout.MetadataRecord(k, layout.canonical_json(v)) for k, v in meta.items.items()
            ]
            ensure(
                layout.layout_hash(records, metadata) == layout_hash,
                f"the committed hash {layout_hash} is not the hash of {infos}, {meta.items}",
            )
            if infos:
                ids = [a.id for a in infos]
                for (reply, fd), a in zip(
                    self._ask(s, {"type": "export_many", "ids": ids}, len(ids)), infos, strict=True
                ):
                    try:
                        ensure(
                            isinstance(reply, m.Exported) and reply.allocation == a,
                            f"export of {a}: {reply}",
                        )
                        assert fd is not None
                        ensure(os.fstat(fd).st_size == a.size, f"fd size for {a}")
                        ensure(
                            fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY,
                            f"writable RO export {a}",
                        )
                    finally:
                        if fd is not None:
                            os.close(fd)
        return infos

    def probe_rw(self) -> list[m.AllocationInfo]:
        """Nothing committed: a well-formed writer allocates and commits."""
        with self._raw() as s:
            ((hello, _),) = self._ask(s, {"type": "hello", "mode": "RW_OR_RO", "timeout_s": 5})
            ensure(
                isinstance(hello, m.HelloOk) and hello.granted is m.Granted.RW,
                f"writer got {hello}",
            )
            ((alloc, _),) = self._ask(s, {"type": "allocate", "size": 4096})
            ensure(
                isinstance(alloc, m.Allocated) and alloc.allocation.size == GRANULARITY, f"{alloc}"
            )
            ((done, _),) = self._ask(s, {"type": "commit"})
            ensure(isinstance(done, m.Committed), f"commit got {done}")
            assert isinstance(alloc, m.Allocated)
            return [alloc.allocation]


def _fuzz(fuzzer: Fuzzer, server_log: Path) -> None:
    @fuzz_settings()
    @given(programs)
    def fuzz(program: tuple[Op, ...]) -> None:
        fuzzer.run(program)

    try:
        fuzz()
    finally:
        print(f"gms fuzz: {dict(fuzzer.stats)}\n{log_tail(server_log)}")
    assert tracebacks(server_log) == []


@timeout_for(setup_s=30, per_example_s=2)
def test_fuzz_gms_committed(gms: Gms) -> None:
    server = gms.server()
    writer: Agent = gms.agent("writer")
    writer.ok("connect", path=str(gms.path()), mode="RW", timeout=10)
    for i, size in enumerate((MiB, 3 * MiB, 4096)):
        writer.ok("allocate", size=size)
        writer.ok("fill", index=i, seed=i + 7)
    writer.ok("put_metadata", key="weights", value={"layers": [1, 2, 3]})
    writer.ok("commit")  # the writer keeps its session, read-only: the legit reader
    fuzzer = Fuzzer(gms, server.pid, committed=True)
    try:
        _fuzz(fuzzer, gms.tmp / "server0.log")
    finally:
        fuzzer.close()
    assert server.alive()
    for i in range(3):
        assert writer.ok("verify", index=i, seed=i + 7)["equal"]
    assert not [e for e in writer.events if e.get("event") == "lost"]


@timeout_for(setup_s=30, per_example_s=2)
def test_fuzz_gms_empty(gms: Gms) -> None:
    server = gms.server()
    fuzzer = Fuzzer(gms, server.pid, committed=False)
    try:
        _fuzz(fuzzer, gms.tmp / "server0.log")
    finally:
        fuzzer.close()
    assert server.alive()
