"""The pod's processes on one machine: failovers and recoveries for real.

Each test runs ``understudy local up`` (lock server, GMS, engines, restarted
like kubelet would) and acts on real processes with real signals.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from localpod import LocalPod, http_json
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


def _logs(pod: LocalPod) -> str:
    return pod.log("engine-primary") + pod.log("engine-shadow-1")


def _kill_gms(pod: LocalPod) -> None:
    """SIGKILL the GMS container's process (its supervisor), not its respawner."""
    from understudy.tools.drill_target import container_process

    os.kill(container_process(pod.pid("gms")), signal.SIGKILL)


def test_gms_killed_the_active_engine_serves_on_and_gives_the_weights_back(pod):
    """GMS dies under load: no engine restarts, nothing is read from the
    checkpoint, every request is answered the same, and the restarted GMS
    holds the same layout, which the standby then wakes over."""
    from understudy.gms.client import query_state

    active = pod.wait_armed()
    answer = pod.embed()
    ids = {e["name"]: e["engine_id"] for e in pod.engines()}
    socket = pod.dir / "gms" / "gms_0_weights.sock"
    layout = query_state(socket, 5).layout_hash
    loads = _logs(pod).count("event=weights_loaded")
    _kill_gms(pod)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert pod.embed() == answer  # served from the mappings throughout
        now = next(e for e in pod.engines() if e["name"] == active["name"])
        if now.get("readoptions") == 1 and not now.get("readopting"):
            break
    else:
        pytest.fail(f"no re-adoption within 60 s\n{pod.diagnostics()}")
    assert {e["name"]: e["engine_id"] for e in pod.engines()} == ids  # no engine restarted
    assert _logs(pod).count("event=weights_loaded") == loads  # no checkpoint read
    state = query_state(socket, 5)
    assert state.committed and state.layout_hash == layout
    # The standby wakes over the adopted layout.
    os.kill(active["pid"], signal.SIGKILL)
    wait_for(lambda: any(e["epoch"] > active["epoch"] for e in pod.by_state("Active")), 30)
    assert pod.embed() == answer


def test_a_readoption_that_fails_falls_back_to_a_reload(monkeypatch):
    """The Active engine cannot give the weights back (failpoint gms.readopt):
    it exits, and the pod takes today's path: after the adoption window the
    restarted primary loads the checkpoint, the standby wakes over it, and the
    front holds the requests meanwhile."""
    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", "gms.readopt=raise")
    pod = LocalPod()
    try:
        pod.wait_armed()
        answer = pod.embed()
        loads = _logs(pod).count("event=weights_loaded")
        _kill_gms(pod)
        wait_for(lambda: "failpoint gms.readopt" in _logs(pod), 60, what="the failed re-adoption")
        status, body = http_json(
            pod.serve_port,
            "/v1/embeddings",
            {"input": "the same question, every time", "encoding_format": "base64"},
            timeout=90,
        )  # held by the front through the reload, then served
        assert status == 200 and body["data"][0]["embedding"] == answer
        pod.wait_armed(120)
        assert pod.embed() == answer
        assert _logs(pod).count("event=weights_loaded") > loads  # loaded anew
    finally:
        pod.close()


def test_gms_killed_inside_a_wake_the_waking_engine_gives_the_weights_back(monkeypatch):
    """GMS dies while the standby wakes, after its remap's exports arrived and
    before the session counts as mapped (failpoint gms.remap.mapped holds it
    there): the waking engine holds the weights, so it gives them back to the
    restarted GMS and takes over. Nothing is read from the checkpoint, the
    front holds the request meanwhile, and the restarted GMS holds the same
    layout. Until 2026-12-05 the waking engine exited, and the pod waited for
    a cold load (docs/pod.md, GMS re-adoption)."""
    from understudy.gms.client import query_state

    monkeypatch.setenv("UNDERSTUDY_FAILPOINTS", "gms.remap.mapped=sleep(3)")
    pod = LocalPod()
    try:
        active = pod.wait_armed(60)  # its own wake held 3 s too
        answer = pod.embed()
        socket = pod.dir / "gms" / "gms_0_weights.sock"
        layout = query_state(socket, 5).layout_hash
        loads = _logs(pod).count("event=weights_loaded")
        standby = next(e for e in pod.engines() if e["name"] != active["name"])
        os.kill(active["pid"], signal.SIGKILL)
        wait_for(
            lambda: any(e["name"] == standby["name"] for e in pod.by_state("Waking")),
            15,
            0.01,
            what="the standby's wake",
        )
        # Its remap's exports take milliseconds from the grant: well inside the
        # failpoint's 3 s when GMS dies.
        time.sleep(0.5)
        _kill_gms(pod)
        status, body = http_json(
            pod.serve_port,
            "/v1/embeddings",
            {"input": "the same question, every time", "encoding_format": "base64"},
            timeout=60,
        )
        assert status == 200 and body["data"][0]["embedding"] == answer, body

        def given_back() -> bool:
            now = next(e for e in pod.engines() if e.get("name") == standby["name"])
            return now.get("state") == "Active" and now.get("readoptions") == 1

        wait_for(given_back, 30, what=f"the woken standby's re-adoption\n{pod.diagnostics()}")
        now = next(e for e in pod.engines() if e.get("name") == standby["name"])
        assert now["engine_id"] == standby["engine_id"] and not now["readopting"]
        assert _logs(pod).count("event=weights_loaded") == loads  # no checkpoint read
        state = query_state(socket, 5)
        assert state.committed and state.layout_hash == layout
    finally:
        pod.close()


def test_lockserver_killed_under_healthy_active_no_failover(pod):
    active = pod.wait_armed()
    ls_pid = pod.process("lockserver")
    os.kill(ls_pid, signal.SIGKILL)
    wait_for(lambda: pod.process("lockserver") not in (ls_pid, pod.pid("lockserver")), 10,
             what="lock server restarted")  # fmt: skip
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


def test_engines_are_restarted_in_place_under_kubelets_default_back_off(pod):
    """The runner keeps kubelet's default CrashLoopBackOff (10 s, then 20 s,
    ...): a container restarted by it would re-arm in 10 s or more from its
    second death on. Killed four times, each engine is instead restarted in
    place by its container's respawner (docs/pod.md): the container never
    exits, the engine's restart count rises, and each re-arm is a process
    start away (the bound is wide for a loaded machine, and still under the
    10 s that the back-off alone would cost)."""
    for kill in range(4):
        active = pod.wait_armed()
        before = active.get("restarts", 0)
        killed_at = time.monotonic()
        os.kill(active["pid"], signal.SIGKILL)
        back = wait_for(
            lambda a=active: next(
                (
                    e
                    for e in pod.by_state("Standby")
                    if e["name"] == a["name"] and e["pid"] != a["pid"]
                ),
                None,
            ),
            30,
            0.02,
            what=f"kill {kill}: {active['name']} back in Standby",
        )
        rearm = time.monotonic() - killed_at
        assert back["restarts"] == before + 1, back
        assert rearm < 8.0, (kill, rearm)
    containers = pod.local_state()["containers"]
    assert all(containers[n]["restarts"] == 0 for n in containers), containers
    # The status port stayed open through every restart (the respawner holds
    # it): the runner's liveness probe never failed three times in a row.
    assert "liveness_failed" not in (pod.dir / "supervisor.out").read_text()
