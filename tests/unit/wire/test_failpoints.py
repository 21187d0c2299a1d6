"""The failpoints: the list, the spec, each action in a real process, and the
guard that every listed point is hit by the code and armed by a test."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from understudy.wire import failpoints

ROOT = Path(__file__).resolve().parents[3]
HIT = re.compile(r"""failpoints\.(?:hit|value)\(\s*["']([\w.-]+)["']\s*\)""")


def _run(spec: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    code = "from understudy.wire import failpoints\nfailpoints.hit('engine.init')\nprint('after')"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={"UNDERSTUDY_FAILPOINTS": spec, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_parse_arms_the_named_points() -> None:
    armed = failpoints.parse(" engine.init=raise ; engine.wake=sleep(0.5);")
    assert armed == {
        "engine.init": failpoints.Action("raise"),
        "engine.wake": failpoints.Action("sleep", 0.5),
    }
    assert failpoints.parse("engine.init=exit(7)")["engine.init"] == failpoints.Action("exit", 7)
    assert failpoints.parse("") == {}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("engine.inti=raise", "names no failpoint"),
        ("engine.init", "names no failpoint"),
        ("engine.init=explode", "is not raise, hang"),
        ("engine.init=exit(x)", "is not raise, hang"),
    ],
)
def test_a_bad_spec_is_a_clear_error(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        failpoints.parse(spec)


def test_off_by_default_the_path_runs_on() -> None:
    done = _run("")
    assert done.returncode == 0 and done.stdout == "after\n"


def test_a_typo_in_the_environment_fails_at_import() -> None:
    done = _run("engine.inti=raise")
    assert done.returncode == 1 and "names no failpoint" in done.stderr


def test_raise_is_an_ordinary_exception_on_the_path() -> None:
    done = _run("engine.init=raise")
    assert done.returncode == 1 and "FailpointError: failpoint engine.init" in done.stderr
    assert "after" not in done.stdout


def test_exit_ends_the_process_with_the_code() -> None:
    done = _run("engine.init=exit(7)")
    assert done.returncode == 7 and "after" not in done.stdout


def test_sleep_delays_then_carries_on() -> None:
    t0 = time.monotonic()
    done = _run("engine.init=sleep(1.5)")
    assert done.returncode == 0 and done.stdout == "after\n"
    assert time.monotonic() - t0 >= 1.5


def test_hang_never_returns() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        _run("engine.init=hang", timeout=3)


def _sources(under: str, exclude: Path | None = None) -> dict[Path, str]:
    base = ROOT / under if under else ROOT
    files = base.glob("*/src/**/*.py") if not under else base.rglob("*.py")
    return {p: p.read_text() for p in files if p != exclude}


def test_every_listed_point_is_hit_by_the_code_and_armed_by_a_test() -> None:
    code = "\n".join(_sources("").values())
    hit = set(HIT.findall(code))
    assert hit <= set(failpoints.POINTS), f"hit but not listed: {hit - set(failpoints.POINTS)}"
    assert hit == set(failpoints.POINTS), f"listed but never hit: {set(failpoints.POINTS) - hit}"
    tests = "\n".join(_sources("tests", exclude=Path(__file__)).values())
    unarmed = {name for name in failpoints.POINTS if not re.search(rf"{re.escape(name)}=", tests)}
    assert not unarmed, f"listed but armed by no test: {unarmed}"


def _run_code(spec: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from understudy.wire import failpoints\n" + code],
        env={"UNDERSTUDY_FAILPOINTS": spec, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_kill_is_a_sigkill_at_the_point() -> None:
    done = _run_code("engine.init=kill", "failpoints.hit('engine.init'); print('after')")
    assert done.returncode == -9 and "after" not in done.stdout


def test_return_hands_the_harm_to_the_caller_and_at_n_counts_hits() -> None:
    code = "print([failpoints.hit('kv.block.corrupt') for _ in range(5)])"
    assert _run_code("", code).stdout == "[False, False, False, False, False]\n"
    assert _run_code("kv.block.corrupt=return", code).stdout == "[True, True, True, True, True]\n"
    assert _run_code("kv.block.corrupt=return@4", code).stdout == (
        "[False, False, False, True, True]\n"
    )
    done = _run_code(
        "kv.seal.torn=exit(3)@3",
        "for i in range(5): failpoints.hit('kv.seal.torn'); print(i, flush=True)",
    )
    assert done.returncode == 3 and done.stdout == "0\n1\n"
    assert failpoints.parse("kv.seal.torn=kill@40")["kv.seal.torn"] == failpoints.Action(
        "kill", 0, 40
    )
    with pytest.raises(ValueError, match="count from 1"):
        failpoints.parse("kv.seal.torn=kill@0")


def test_return_text_gives_the_point_its_value() -> None:
    code = "print([failpoints.value('engine.poison') for _ in range(3)])"
    assert _run_code("", code).stdout == "[None, None, None]\n"
    armed = _run_code("engine.poison=return(POISON PILL)@2", code)
    assert armed.stdout == "[None, 'POISON PILL', 'POISON PILL']\n", armed.stderr
    assert _run_code("engine.poison=return", code).stdout == "['', '', '']\n"
    assert _run_code("engine.poison=kill", code).returncode == -9  # the action, here
    assert failpoints.parse("engine.poison=return(x=1)")["engine.poison"] == failpoints.Action(
        "return", text="x=1"
    )
    with pytest.raises(ValueError, match="return\\(TEXT\\)"):
        failpoints.parse("engine.poison=return()")
