"""``understudy respawn`` with real processes: restarts in place, back-off for a
child that cannot start, signals passed on, orphans reaped, nothing left over."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# A child that records each start (pid, restarts, its open fds, its process
# group) and, unless told to fail, says READY and then waits.
CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from understudy.wire import respawn
    record, mode = sys.argv[1], sys.argv[2]
    if respawn.is_spare():  # prepared ahead of time; waits for its turn
        with open(record + ".spares", "a") as f:
            f.write(f"{os.getpid()}\\n")
        respawn.wait_turn()
    fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
    with open(record, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "restarts": respawn.restarts(),
                            "fds": fds, "pgid": os.getpgid(0), "at": time.monotonic(),
                            "notify": os.environ.get(respawn.NOTIFY_FD)}) + "\\n")
    if mode == "fail" or (mode == "ready-then-fail" and respawn.restarts() > 0):
        sys.exit(3)
    if mode == "ready-then-fail":  # the first one starts, then dies
        respawn.notify_ready()
        time.sleep(0.3)
        sys.exit(9)
    if mode == "grandchild":  # leaves a process behind in its own group
        import subprocess
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(record + ".grandchild", "w").write(str(g.pid))
    if mode == "orphan":  # a process in another session, whose parent then ends
        import subprocess
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"],
                             start_new_session=True)
        open(record + ".orphan", "w").write(str(g.pid))
    if mode == "listen":  # answer on the socket the respawner holds: our pid
        sock = respawn.inherited_socket("probe")
        respawn.notify_ready()
        while True:
            conn, _ = sock.accept()
            conn.sendall(str(os.getpid()).encode())
            conn.close()
    respawn.notify_ready()
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    signal.signal(signal.SIGUSR1, lambda *_: open(record + ".usr1", "w").write("1"))
    while True:
        time.sleep(1)
    """
)


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _until(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def respawn(tmp_path: Path):  # type: ignore[no-untyped-def]
    procs: list[subprocess.Popen[bytes]] = []

    def start(mode: str, *options: str) -> tuple[subprocess.Popen[bytes], Path]:
        record = tmp_path / f"record-{len(procs)}"
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        with open(tmp_path / f"respawn-{len(procs)}.log", "wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", "understudy.cli", "respawn", *options, "--",
                 sys.executable, str(script), str(record), mode],
                stderr=log,
            )  # fmt: skip
        procs.append(p)
        return p, record

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_child_that_started_is_restarted_in_place_at_once(respawn) -> None:  # type: ignore[no-untyped-def]
    # A back-off of 30 s, were it applied, would show; a python start would not.
    p, record = respawn("serve", "--backoff-initial", "30", "--backoff-max", "30")
    for n in range(1, 6):
        _until("a child", lambda n=n: len(_records(record)) >= n)
        first = _records(record)[-1]
        time.sleep(0.3)  # it said READY
        killed_at = time.monotonic()
        os.kill(first["pid"], signal.SIGKILL)
        _until("the next child", lambda n=n: len(_records(record)) > n)
        nxt = _records(record)[-1]
        assert nxt["restarts"] == n and nxt["pid"] != first["pid"]
        # At once: a process start (seconds at most on a busy machine), no back-off.
        assert nxt["at"] - killed_at < 10.0
    assert p.poll() is None


def test_the_child_gets_only_its_notify_pipe_and_a_group_of_its_own(respawn) -> None:  # type: ignore[no-untyped-def]
    p, record = respawn("serve")
    (child,) = _until("the child", lambda: _records(record))
    notify = int(child["notify"])
    # stdin, stdout, stderr, the notify pipe and the fd listing its own directory.
    assert notify in child["fds"] and len(set(child["fds"]) - {0, 1, 2, notify}) == 1
    assert child["pgid"] == child["pid"] != os.getpgid(p.pid)


def test_a_container_that_never_starts_is_handed_to_kubelet_at_once(respawn) -> None:  # type: ignore[no-untyped-def]
    p, record = respawn("fail")
    assert p.wait(30) == 3  # the child's code: kubelet's CrashLoopBackOff takes over
    assert len(_records(record)) == 1


def test_a_restart_that_cannot_start_is_backed_off_then_the_respawner_gives_up(respawn) -> None:  # type: ignore[no-untyped-def]
    p, record = respawn("ready-then-fail", "--backoff-initial", "0.5", "--give-up-after", "3")
    assert p.wait(30) == 3
    starts = [r["at"] for r in _records(record)]
    assert len(starts) == 4  # started, then three restarts that failed to start
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # Each gap is the previous child's life, the back-off and a python start
    # (slow on a busy machine): after the failed starts, at least 0.5 s, then
    # 1 s, as the respawner says it waited. (The started child's death costs
    # none: test_a_child_that_started_...)
    assert gaps[1] >= 0.5 and gaps[2] >= 1.0
    said = (record.parent / "respawn-0.log").read_text()
    backoffs = [line for line in said.splitlines() if "event=backoff" in line]
    delays = [line.split("delay_s=")[1].split()[0] for line in backoffs]
    assert delays == ["0.5", "1.0"], said


def test_sigterm_goes_to_the_child_and_its_code_is_the_respawners(respawn) -> None:  # type: ignore[no-untyped-def]
    p, record = respawn("serve")
    (child,) = _until("the child", lambda: _records(record))
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGUSR1)  # passed on as it comes
    _until("SIGUSR1 passed on", lambda: Path(f"{record}.usr1").exists())
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 7
    assert not _alive(child["pid"])
    assert len(_records(record)) == 1  # a stop is not a death: no restart


def test_what_the_dead_child_left_in_its_group_dies_with_it(respawn) -> None:  # type: ignore[no-untyped-def]
    _, record = respawn("grandchild")
    (child,) = _until("the child", lambda: _records(record))
    grandchild = int(_until("the grandchild", lambda: Path(f"{record}.grandchild").exists()
                            and Path(f"{record}.grandchild").read_text()))  # fmt: skip
    assert _alive(grandchild)
    os.kill(child["pid"], signal.SIGKILL)
    _until("the grandchild gone", lambda: not _alive(grandchild), 10)


def test_orphans_are_reaped(respawn) -> None:  # type: ignore[no-untyped-def]
    _, record = respawn("orphan")
    (child,) = _until("the child", lambda: _records(record))
    orphan = int(_until("the orphan", lambda: Path(f"{record}.orphan").exists()
                        and Path(f"{record}.orphan").read_text()))  # fmt: skip
    os.kill(child["pid"], signal.SIGKILL)  # the orphan's parent ends; it is ours now
    _until("the next child", lambda: len(_records(record)) > 1)
    # It ends after 0.5 s and is reaped: no zombie left behind.
    _until("the orphan reaped", lambda: not os.path.exists(f"/proc/{orphan}"), 10)


def test_the_child_dies_with_the_respawner(respawn) -> None:  # type: ignore[no-untyped-def]
    p, record = respawn("serve")
    (child,) = _until("the child", lambda: _records(record))
    p.kill()
    p.wait(10)
    _until("the child gone", lambda: not _alive(child["pid"]), 10)


def test_no_command_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "understudy.cli", "respawn"], capture_output=True, timeout=30
    )
    assert done.returncode == 2 and b"no command" in done.stderr


def test_with_a_spare_the_next_process_is_already_there(respawn) -> None:  # type: ignore[no-untyped-def]
    p, record = respawn("serve", "--spare")
    spares = Path(f"{record}.spares")
    for n in range(1, 4):
        _until("a spare", lambda n=n: spares.exists() and len(spares.read_text().split()) >= n)
        spare = int(spares.read_text().split()[-1])
        child = _records(record)[-1]
        assert child["pid"] != spare
        os.kill(child["pid"], signal.SIGKILL)
        _until("the next child", lambda n=n: len(_records(record)) > n)
        promoted = _records(record)[-1]
        assert promoted["pid"] == spare and promoted["restarts"] == n
        assert promoted["pgid"] == spare  # a group of its own, as any child
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 7
    last_spare = int(spares.read_text().split()[-1])
    _until("the spare ended with the respawner", lambda: not _alive(last_spare), 10)


def test_a_port_it_holds_stays_open_while_the_child_restarts(respawn) -> None:  # type: ignore[no-untyped-def]
    """--listen: a connection made while no child runs waits for the next one."""
    import socket as socket_mod

    with socket_mod.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _, record = respawn("listen", "--listen", f"probe=127.0.0.1:{port}")
    (first,) = _until("the child", lambda: _records(record))

    def ask() -> int:
        with socket_mod.create_connection(("127.0.0.1", port), timeout=20) as c:
            return int(c.recv(64))

    assert _until("an answer", lambda: _try(ask)) == first["pid"]
    os.kill(first["pid"], signal.SIGSTOP)  # it holds the socket but answers nothing
    os.kill(first["pid"], signal.SIGKILL)
    # Dead first: a signal is delivered asynchronously, and a child woken in
    # accept() by it returns a connection already queued before it dies
    # (the kernel looks at the queue before the pending signal), closing it
    # unanswered. CI met that once (the answer was b'').
    _until("the first child dead", lambda: not _alive(first["pid"]))
    # Asked at once, while no child runs: not refused, answered by the next one.
    answered_by = ask()
    assert answered_by != first["pid"]
    assert answered_by == _records(record)[-1]["pid"]


def _try(call):  # type: ignore[no-untyped-def]
    try:
        return call()
    except OSError:
        return None
