"""The pod's processes on one machine: failovers and recoveries for real.

Each test runs ``understudy local up`` (lock server, GMS, engines, restarted
like kubelet would) and acts on real processes with real signals.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from localpod import LocalPod
from procs import Proc, understudy, wait_for

pytestmark = [pytest.mark.process, pytest.mark.slow]


@pytest.fixture
def pod():
    p = LocalPod()
    yield p
    p.close()


def test_active_kill9_other_serves_identically_and_killed_rearms(pod):
    """Whichever engine won the lock (roles decide weight loading, not who
    serves first) is killed; the other serves the same bytes; the killed one
    comes back as the standby by importing the committed weights."""
    active = pod.wait_armed()
    loaders = [e for e in pod.engines() if e["weights"]["loaded"]]
    assert [e["name"] for e in loaders] == ["engine-primary"]  # only the primary wrote
    before = pod.embed()
    killed_at = time.time()
    os.kill(active["pid"], signal.SIGKILL)
    new = wait_for(
        lambda: next((e for e in pod.by_state("Active") if e["name"] != active["name"]), None),
        15,
        0.01,
    )
    assert new["epoch"] > active["epoch"]
    # what the operator reads for the last failover's duration
    assert new["active_at"] >= new["granted_at"] > active["active_at"]
    # ... from the old holder's death, detection included: the lock server's
    # release time (the killed engine's EOF) rides in the grant
    assert killed_at <= new["released_at"] <= new["granted_at"]
    assert new["released_at"] - killed_at < 1.0
    # Detection is the death (the release) to the grant reaching the engine:
    # not zero (a grant cannot precede the death it follows), and within the
    # time from the release to the engine's own grant record.
    assert 0 < new["detect_s"] <= new["granted_at"] - new["released_at"] + 0.001
    assert pod.embed() == before  # bit-identical across the failover
    rearmed = wait_for(
        lambda: next((e for e in pod.by_state("Standby") if e["name"] == active["name"]), None),
        30,
        0.05,
    )
    assert rearmed["pid"] != active["pid"]
    assert rearmed["weights"] == {"loaded": [], "imported": [0]}  # imported, not reloaded


def test_hung_active_engine_is_detected_and_replaced(pod):
    active = pod.wait_armed()
    os.kill(active["pid"], signal.SIGSTOP)
    new = wait_for(
        lambda: next((e for e in pod.by_state("Active") if e["name"] != active["name"]), None),
        20,
        0.05,
    )
    assert new["epoch"] > active["epoch"]
    # The front saw its heartbeat stop and killed it (before any liveness
    # probe would have): its death handed the lock on.
    wait_for(lambda: not _alive(active["pid"]), 10, what="hung engine killed")
    assert f"event=killing_hung_engine engine={active['engine_id']}" in pod.log("front")
    assert "liveness_failed" not in (pod.dir / "supervisor.out").read_text()
    pod.wait_armed(30)


def test_gms_killed_engines_exit_and_pod_serves_again(pod):
    pod.wait_armed()
    before = pod.embed()

    def logs() -> str:
        return pod.log("engine-primary") + pod.log("engine-shadow-1")

    loads_before = logs().count("event=weights_loaded")
    gms_pid = pod.pid("gms")
    os.kill(gms_pid, signal.SIGKILL)
    # The active engine loses its GMS connection and exits (code 4). The
    # standby, granted the lock, either fails its wake at once (the fresh GMS
    # has nothing committed and no writer: exit 1) or, if the restarted
    # primary is already loading, remaps the same layout once it is committed.
    wait_for(lambda: "code=4" in logs(), 15, what="an engine exiting on GMS loss")
    wait_for(lambda: pod.pid("gms") != gms_pid, 10, what="GMS restarted")
    pod.wait_armed(90)
    assert pod.embed() == before
    # the weights were loaded again into the fresh GMS, not imported from nowhere
    assert logs().count("event=weights_loaded") > loads_before


def test_lockserver_killed_under_healthy_active_no_failover(pod):
    active = pod.wait_armed()
    ls_pid = pod.pid("lockserver")
    os.kill(ls_pid, signal.SIGKILL)
    wait_for(lambda: pod.pid("lockserver") != ls_pid, 10, what="lock server restarted")
    time.sleep(3.5)  # longer than the 2 s reconnect window
    now = pod.armed()
    assert now is not None
    assert (now["pid"], now["epoch"]) == (active["pid"], active["epoch"])  # same engine, same grant
    assert pod.embed()
    assert "lock_resumed" in pod.log(active["name"])


def test_two_shadows_take_turns(tmp_path):
    pod = LocalPod(shadows=2)
    try:
        seen = set()
        answer = None
        for _ in range(3):
            active = pod.wait_armed(60)
            seen.add(active["name"])
            emb = pod.embed()
            assert answer in (None, emb)
            answer = emb
            os.kill(active["pid"], signal.SIGKILL)
            wait_for(
                lambda a=active: any(e["epoch"] > a["epoch"] for e in pod.by_state("Active")),
                15,
                0.01,
            )
        assert len(seen) >= 2
        epochs = [e["epoch"] for e in pod.engines() if e.get("epoch")]
        assert len(set(epochs)) == len(epochs)  # never two engines with one grant
    finally:
        pod.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------- one engine, no runner --


def _engine_env(tmp, role="primary", **extra):
    return {
        "ENGINE_ROLE": role,
        "UNDERSTUDY_ENGINE_NAME": f"engine-{role}",
        "UNDERSTUDY_RUN_DIR": str(tmp),
        "UNDERSTUDY_STATUS_PORT": "0",
        "UNDERSTUDY_SERVE_PORT": "0",
        **extra,
    }


def test_error_injected_during_init_exits_at_once(tmp_path):
    t0 = time.monotonic()
    p = Proc(
        understudy("engine", "run"),
        env=_engine_env(tmp_path, UNDERSTUDY_FAILPOINTS="engine.init=raise"),
        log=tmp_path / "engine.log",
    )
    assert p.wait(30) == 1
    assert time.monotonic() - t0 < 20  # at once, not after a probe or budget
    log = (tmp_path / "engine.log").read_text()
    exit_lines = [line for line in log.splitlines() if "event=exit" in line]
    (line,) = exit_lines
    assert "state=Init" in line and "failpoint engine.init" in line


def test_missing_gms_fails_init_within_budget(tmp_path):
    p = Proc(
        understudy("engine", "run"),
        env=_engine_env(tmp_path, UNDERSTUDY_STARTUP_BUDGET_S="2"),
        log=tmp_path / "e.log",
    )
    assert p.wait(30) in (1, 6)
    assert "event=exit" in (tmp_path / "e.log").read_text()


def test_bad_configuration_exits_2(tmp_path):
    p = Proc(understudy("engine", "run"), env={"ENGINE_ROLE": "leader"}, log=tmp_path / "e.log")
    assert p.wait(30) == 2
    assert "ENGINE_ROLE" in (tmp_path / "e.log").read_text()


def test_hung_wake_exits_on_wake_timeout(tmp_path):
    """A wake that never finishes ends the process (code 5), with one exit line."""
    run = tmp_path
    sidecars = [
        Proc(
            understudy(
                "lockserver",
                "serve",
                "--socket",
                str(run / "lock.sock"),
                "--state-file",
                str(run / "lock.state"),
            ),
            log=run / "lock.log",
        ),
        Proc(
            understudy(
                "gms",
                "serve",
                "--socket-dir",
                str(run / "gms"),
                "--devices",
                "0",
                "--backend",
                "host",
            ),
            log=run / "gms.log",
        ),
    ]
    try:
        env = _engine_env(
            run, UNDERSTUDY_FAILPOINTS="engine.wake=hang", UNDERSTUDY_WAKE_TIMEOUT_S="1.5"
        )
        engine = Proc(understudy("engine", "run"), env=env, log=run / "engine.log")
        assert engine.wait(60) == 5
        log = (run / "engine.log").read_text()
        assert "to_state=Waking" in log
        (line,) = [x for x in log.splitlines() if "event=exit" in x]
        assert "state=Waking" in line and "wake took longer than 1.5s" in line
    finally:
        for p in sidecars:
            p.stop()
