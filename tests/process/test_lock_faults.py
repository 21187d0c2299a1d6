"""The lock server's double faults, with real processes: a damaged or missing
state file at a restart, and a full state volume."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from localpod import LocalPod, http_json
from procs import Proc, understudy, wait_for

from understudy.lockserver import client
from understudy.lockserver.statefile import copy_paths

pytestmark = [pytest.mark.process, pytest.mark.slow]


class Load(threading.Thread):
    """Clients hammering the pod's front door; every answer is kept."""

    def __init__(self, pod: LocalPod, clients: int = 4) -> None:
        super().__init__(daemon=True)
        self.pod, self.clients = pod, clients
        self.stop = threading.Event()
        self.answers: list[tuple[int, str]] = []

    def run(self) -> None:
        def one() -> None:
            while not self.stop.is_set():
                try:
                    status, body = http_json(self.pod.serve_port, "/v1/checksum", {}, timeout=30)
                    self.answers.append(
                        (status, body.get("checksum", "") if status == 200 else str(body))
                    )
                except OSError as exc:
                    self.answers.append((0, repr(exc)))

        with concurrent.futures.ThreadPoolExecutor(self.clients) as ex:
            for _ in range(self.clients):
                ex.submit(one)


@pytest.mark.parametrize("damage", ["garbage", "missing"])
def test_a_lock_server_restart_with_a_lost_record_keeps_the_pod_serving(damage: str):
    """The healthy Active engine claims its grant back; the server, which lost
    its record, re-grants it under a new epoch: no failover, no failed request,
    never two Active engines."""
    pod = LocalPod("--reconnect-window", "3", engine="synthetic")
    load = Load(pod)
    try:
        active = pod.wait_armed()
        load.start()
        time.sleep(0.5)
        _damage(pod, "both copies" if damage == "garbage" else "deleted")
        os.kill(pod.process("lockserver"), signal.SIGKILL)
        # The runner restarts it; the Active engine's client resumes.
        new = wait_for(
            lambda: next(
                (e for e in pod.engines() if (e.get("epoch") or 0) > active["epoch"]), None
            ),
            20, 0.05, what="the Active engine re-granted under a new epoch",
        )  # fmt: skip
        assert new["engine_id"] == active["engine_id"] and new["state"] == "Active"
        time.sleep(1.0)  # keep serving under the new epoch
        route = http_json(pod.front_port, "/state")[1]["route"]
        assert route == {"engine_id": active["engine_id"], "epoch": new["epoch"]}
        assert "epoch_reissued" in pod.log(active["name"])
        assert len(pod.by_state("Active")) == 1
    except BaseException:
        print(pod.diagnostics())
        raise
    finally:
        load.stop.set()
        load.join(60)
        pod.close()
    failed = [a for a in load.answers if a[0] != 200]
    assert load.answers and not failed, failed[:5]
    assert len({a[1] for a in load.answers}) == 1  # one checksum: the same weights


def _damage(pod: LocalPod, how: str) -> None:
    """Damage the lock's state file the way ``how`` says."""
    copies = copy_paths(pod.dir / "lock.state")
    match how:
        case "one copy":
            copies[0].write_bytes(b"\x00not json{")
        case "both copies":
            for c in copies:
                c.write_bytes(b"\x00not json{")
        case "deleted":
            for c in copies:
                c.unlink()


WINDOW_S = 10.0


@pytest.mark.parametrize("when", ["at once", "a second later"])
@pytest.mark.parametrize("how", ["one copy", "both copies", "deleted"])
def test_a_damaged_state_file_then_the_active_death_costs_no_more_than_a_deleted_one(
    how: str, when: str
):
    """A lock server restart over a damaged state file, then the Active
    engine's death: at once (before it can claim its grant back) or a second
    later. The pod has an Active engine again well within the reconnect
    window, whatever the damage, and no request fails."""
    pod = LocalPod("--reconnect-window", f"{WINDOW_S:g}", engine="synthetic")
    load = Load(pod)
    try:
        active = pod.wait_armed()
        load.start()
        time.sleep(0.5)
        _damage(pod, how)
        old = pod.process("lockserver")
        os.kill(old, signal.SIGKILL)
        wait_for(
            lambda: pod.process("lockserver") not in (old, pod.pid("lockserver"))
            and _answers(pod.dir / "lock.sock"),
            20, 0.01, what="the lock server back",
        )  # fmt: skip
        if when == "a second later":
            time.sleep(1.0)
        killed = time.monotonic()
        os.kill(active["pid"], signal.SIGKILL)
        wait_for(
            lambda: any(e["name"] != active["name"] for e in pod.by_state("Active")),
            WINDOW_S + 10, 0.02, what="another engine Active",
        )  # fmt: skip
        outage = time.monotonic() - killed
        log = pod.log("lockserver")
        print(f"{how}, {when}: no Active engine for {outage:.2f}s; load {os.getloadavg()}")
        assert outage < WINDOW_S / 3, log[-3000:]
        if how == "one copy":
            assert "event=state_copy_damaged" in log and "state_file_corrupt" not in log
        pod.wait_armed(60)
        assert len(pod.by_state("Active")) == 1
    except BaseException:
        print(pod.diagnostics())
        raise
    finally:
        load.stop.set()
        load.join(60)
        pod.close()
    failed = [a for a in load.answers if a[0] != 200]
    assert load.answers and not failed, failed[:5]
    assert len({a[1] for a in load.answers}) == 1  # one checksum: the same weights


@pytest.fixture
def small_volume(tmp_path: Path):
    """A 256 KiB tmpfs for the state file, so that it can really fill up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "vol"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_state_volume_defers_the_grant_and_loses_nothing(small_volume: Path, tmp_path):
    sock = tmp_path / "lock.sock"
    log = tmp_path / "lockserver.log"
    server = Proc(
        understudy("lockserver", "serve", "--socket", str(sock),
                   "--state-file", str(small_volume / "lock.state")),
        log=log,
    )  # fmt: skip
    procs = []
    try:
        wait_for(lambda: _answers(sock), 15, what="lock server")
        a = Proc(understudy("lock", "acquire", "--socket", str(sock), "--id", "a"))
        procs.append(a)
        first = a.json_line(10)
        assert first["event"] == "granted"
        b = Proc(understudy("lock", "acquire", "--socket", str(sock), "--id", "b"))
        procs.append(b)
        wait_for(lambda: client.status(sock, 2).waiters == ("b",), 10)
        filler = small_volume / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        # The holder keeps its lock: nothing already held needs the volume.
        time.sleep(0.3)
        assert client.status(sock, 2).holder == "a"
        a.kill9()  # b's grant cannot be written: it is deferred, never half-made
        wait_for(lambda: "event=grant_deferred" in log.read_text(), 10)
        st = client.status(sock, 2)
        assert st.holder is None and st.waiters == ("b",) and st.epoch == first["epoch"]
        assert b.no_line(0.5)
        assert "No space left on device" in log.read_text()
        filler.unlink()  # space again: the retry grants it
        line = b.json_line(10)
        assert line["event"] == "granted" and line["epoch"] == first["epoch"] + 1
        assert client.status(sock, 2).holder == "b"
    finally:
        for p in procs:
            p.stop()
        server.stop()


def _answers(sock: Path) -> bool:
    try:
        client.status(sock, timeout=0.5)
        return True
    except client.LockError:
        return False
