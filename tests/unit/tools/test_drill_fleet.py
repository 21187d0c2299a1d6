"""A fleet drill's judgements of the gateway's /state (pure): which pod a
fault goes to, when the gateway stopped routing to it, when the fleet is
armed again; and what its rounds report."""

from __future__ import annotations

from typing import Any

from understudy.tools import figures
from understudy.tools.drill_result import Report, Round, pod_round_line


def pod(name: str, phase: str = "ready", generation: int = 1, **kw: Any) -> dict[str, Any]:
    return {"name": name, "phase": phase, "generation": generation, "reason": "", **kw}


ARMED = [
    {"name": "a", "state": "Active", "epoch": 3},
    {"name": "b", "state": "Standby"},
]


def test_the_fault_goes_to_the_ready_pod_with_the_most_streams_then_requests():
    pods = [
        pod("p0", streams=1, busy=5),
        pod("p1", streams=2, busy=2),
        pod("p2", "dead", streams=9, busy=9),  # not routable: not a target
    ]
    assert figures.busiest_pod(pods)["name"] == "p1"
    tie = [pod("p0", streams=1, busy=1), pod("p1", streams=1, busy=3)]
    assert figures.busiest_pod(tie)["name"] == "p1"


def test_with_nothing_in_flight_the_fault_goes_to_the_first_routable_pod():
    pods = [pod("p0", "unready"), pod("p1", streams=0, busy=0), pod("p2", streams=0, busy=0)]
    assert figures.busiest_pod(pods)["name"] == "p1"
    assert figures.busiest_pod([pod("p0", "dead"), pod("p1", "new")]) is None


def test_a_pod_is_unroutable_once_not_ready_revived_under_a_later_generation_or_gone():
    assert figures.pod_unroutable([pod("p0"), pod("p1")], "p0", 1) is None
    for phase in ("dead", "unready", "new"):
        got = figures.pod_unroutable([pod("p0", phase, reason="silent")], "p0", 1)
        assert got is not None and got["phase"] == phase
    # dead and revived between two looks: a later generation, ready again
    assert figures.pod_unroutable([pod("p0", generation=2)], "p0", 1) is not None
    assert figures.pod_unroutable([pod("p1")], "p0", 1) == {
        "name": "p0",
        "phase": "removed",
        "reason": "removed",
    }


def test_the_fleet_is_armed_when_every_pod_is_ready_and_armed_inside():
    engines = {"p0": ARMED, "p1": ARMED}
    assert figures.fleet_armed([pod("p0"), pod("p1")], engines)
    assert not figures.fleet_armed([pod("p0"), pod("p1", "dead")], engines)
    assert not figures.fleet_armed([pod("p0")], engines)  # p1 not listed
    no_standby = {"p0": ARMED, "p1": [ARMED[0], {"name": "b", "state": "Waking"}]}
    assert not figures.fleet_armed([pod("p0"), pod("p1")], no_standby)


def test_a_fleet_rounds_detection_is_in_the_summary_and_its_line():
    rounds = [
        Round(1, "pod-0", 7, 1, signal="STOP", detect_s=1.02, reason="silent", rearm_s=3.1),
        Round(2, "pod-1", 7, 1, signal="STOP", detect_s=1.10, reason="silent", rearm_s=3.5),
    ]
    s = Report(rounds=rounds, clients=8, signal="STOP +pod-freeze").summary()
    assert s["detect_s"]["n"] == 2 and s["detect_s"]["max"] == 1.10
    assert s["failovers_ok"] == 2
    line = pod_round_line(rounds[0])
    assert "SIGSTOP pod-0" in line and "1020.0 ms (silent)" in line
    assert Report(rounds=[Round(1, "a", 1, 1)]).summary()["detect_s"] is None
