"""``understudy local up|down`` (the whole pod as local processes) and
``understudy drill`` (kill engines under load and measure every failover).

These are tools for people and tests, not what runs in a pod's containers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from understudy.wire.engines import ENGINE_PYTHON
from understudy.wire.engines import NAMES as ENGINES


def _local_config(args: argparse.Namespace) -> Any:
    from understudy.tools.local import LocalConfig

    return LocalConfig(
        dir=Path(args.dir).absolute(),
        engine=args.engine,
        model=args.model or "",
        engine_args=tuple(args.engine_arg or ()),
        engine_python=args.engine_python or "",
        shadows=args.shadows,
        devices=tuple(int(d) for d in args.devices.split(",")),
        gms_backend=args.gms_backend,
        serve_port=args.port,
        status_port=args.status_port,
        lock_metrics_port=args.metrics_port,
        gms_metrics_port=args.metrics_port + 1,
        front_status_port=args.metrics_port + 2,
        hold_s=args.hold,
        hang_after_s=args.hang_after,
        migration_limit=args.migration_limit,
        reconnect_window_s=args.reconnect_window,
        startup_budget_s=args.startup_budget,
        wake_timeout_s=args.wake_timeout,
        remap_timeout_s=args.remap_timeout,
        max_backoff_s=args.max_backoff,
    )


def _preflight(cfg: Any) -> str | None:
    """What would make every engine fail at start, said before anything starts."""
    from understudy.tools.local import instance

    try:  # the pod that runs is the GpuInstance's: its bounds are the options'
        instance(cfg)
    except ValueError as exc:
        return str(exc)
    if cfg.gms_backend == "cuda":
        from understudy.tools.local import gpu_problem

        if (problem := gpu_problem(cfg.devices)) is not None:
            return problem
    if cfg.engine == "reference" and not cfg.model:
        from understudy.engine_shim.adapters.minilm import ModelMissing, default_model_dir

        try:
            default_model_dir()
        except ModelMissing as exc:
            return str(exc)
    return None


def cmd_local_up(args: argparse.Namespace) -> int:
    from understudy.tools.local import Supervisor
    from understudy.wire.obs import setup_logging

    if args.engine in ENGINE_PYTHON and not args.engine_python:  # vllm, torch
        from understudy.tools import checkout

        try:
            args.engine_python = checkout.vllm_python()
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"understudy local up: no python with vLLM: {exc}", file=sys.stderr)
            return 2
    if args.ready_timeout is None:
        # vLLM's imports alone take about a minute.
        args.ready_timeout = 600.0 if args.engine == "vllm" else 120.0
    cfg = _local_config(args)
    if (problem := _preflight(cfg)) is not None:
        print(f"understudy local up: {problem}", file=sys.stderr)
        return 2
    ports = [cfg.status_port + i for i in range(cfg.shadows + 1)]
    if (running := _running_pod(cfg.dir)) is not None:
        print(
            f"a local pod already runs in {cfg.dir} (pid {running}); `understudy local down` first",
            file=sys.stderr,
        )
        return 1
    if args.pods > 1:
        return _fleet_up(cfg, args)
    if args.detach:
        return _detach(cfg, args.ready_timeout, ports)
    setup_logging()
    sup = Supervisor(cfg)
    threading.Thread(target=_announce, args=(cfg, ports, args.ready_timeout), daemon=True).start()
    sup.run_forever()
    return 0


def _announce(cfg: Any, ports: list[int], ready_timeout: float) -> None:
    """Say where the pod serves once it does (or why it never will)."""
    from understudy.tools.local import KeepsFailing, wait_serving

    try:
        if wait_serving(cfg.serve_port, ports, ready_timeout, cfg.dir):
            _print_where(cfg, os.getpid())
    except KeepsFailing as exc:
        print(f"understudy local up: {exc}", file=sys.stderr, flush=True)


def _add_down(sub: argparse._SubParsersAction[argparse.ArgumentParser], default: Path) -> None:
    down = sub.add_parser("down", help="stop a local pod (or pods: --pods N)")
    down.add_argument("--dir", default=str(default))
    down.set_defaults(func=cmd_local_down)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def _fleet_up(cfg: Any, args: argparse.Namespace) -> int:
    """``local up --pods N``: N pods, each in DIR/pod-I, behind the gateway on --port."""
    from understudy.tools.fleet import Fleet, wait_fleet
    from understudy.wire.obs import setup_logging

    if args.detach:
        proc = _spawn(cfg)
        if not wait_fleet(cfg, args.pods, args.ready_timeout * args.pods):
            print(f"local pods not serving; logs in {cfg.dir}", file=sys.stderr)
            return 1
        print(json.dumps({"serving": f"http://127.0.0.1:{cfg.serve_port}", "dir": str(cfg.dir),
                          "supervisor_pid": proc.pid}), flush=True)  # fmt: skip
        return 0
    setup_logging()
    Fleet(cfg, args.pods).run_forever()
    return 0


def _running_pod(directory: Path) -> int | None:
    """The supervisor pid of a local pod still running in ``directory``."""
    from understudy.tools.local import read_state

    with contextlib.suppress(FileNotFoundError):
        pid: int = read_state(directory)["supervisor_pid"]
        if _alive(pid):
            return pid
    return None


def _detach(cfg: Any, ready_timeout: float, ports: list[int]) -> int:
    """``local up --detach``: the pod in a new session; return once it serves."""
    from understudy.tools.local import KeepsFailing, wait_serving

    proc = _spawn(cfg)
    try:
        serving = wait_serving(cfg.serve_port, ports, ready_timeout, cfg.dir)
    except KeepsFailing as exc:
        # Stop the pod: a crash loop left running only burns the CPU.
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
        print(f"understudy local up: {exc}; the pod was stopped", file=sys.stderr)
        return 1
    if not serving:
        print(f"local pod not serving within {ready_timeout}s; logs in {cfg.dir}", file=sys.stderr)
        return 1 if proc.poll() is None else proc.returncode or 1
    _print_where(cfg, proc.pid)
    return 0


def _spawn(cfg: Any) -> subprocess.Popen[bytes]:
    """This command again without --detach, in a new session, logging to DIR."""
    cfg.dir.mkdir(parents=True, exist_ok=True)
    argv = [a for a in sys.argv[1:] if a != "--detach"]
    if cfg.engine_python and "--engine-python" not in argv:
        argv += ["--engine-python", cfg.engine_python]  # resolved once, here
    with open(cfg.dir / "supervisor.log", "ab") as logf:
        return subprocess.Popen(
            [sys.executable, "-m", "understudy.cli", *argv],
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _print_where(cfg: Any, pid: int) -> None:
    print(
        json.dumps(
            {
                "serving": f"http://127.0.0.1:{cfg.serve_port}",
                "try": _try_command(cfg),
                "engines": {
                    (
                        "engine-primary" if i == 0 else f"engine-shadow-{i}"
                    ): f"http://127.0.0.1:{cfg.status_port + i}/state"
                    for i in range(cfg.shadows + 1)
                },
                "dir": str(cfg.dir),
                "supervisor_pid": pid,
            }
        ),
        flush=True,
    )


def _try_command(cfg: Any) -> str:
    url = f"http://127.0.0.1:{cfg.serve_port}"
    if cfg.engine == "reference":
        body = '{"input": "hello"}'
        return f"curl -s {url}/v1/embeddings -H 'Content-Type: application/json' -d '{body}'"
    if cfg.engine == "synthetic":
        return f"curl -s -XPOST {url}/v1/checksum"
    body = '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}'
    return f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cmd_local_down(args: argparse.Namespace) -> int:
    from understudy.tools.local import read_state

    directory = Path(args.dir).absolute()
    try:
        state = read_state(directory)
    except FileNotFoundError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    pid = state["supervisor_pid"]
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    gateway = state.get("gateway", {}).get("pid")  # local up --pods N
    for pid in [gateway, *(c.get("pid") for c in _containers(state))]:
        if pid and _alive(pid):  # in case the supervisor itself was killed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    print(json.dumps({"stopped": str(directory)}))
    return 0


def _containers(state: dict[str, Any]) -> list[dict[str, Any]]:
    """A local pod's containers; with --pods N, every pod's (those still recorded)."""
    from understudy.tools.local import read_state

    if "pods" not in state:
        return list(state["containers"].values())
    out: list[dict[str, Any]] = []
    for pod in state["pods"].values():
        with contextlib.suppress(FileNotFoundError, ValueError):
            out += read_state(Path(pod["dir"]))["containers"].values()
    return out


def _drill_usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with a drill's command line, before anything runs."""
    if args.report:
        from understudy.tools.report import ReportUnavailable, check_available

        try:  # before a drill that would end without its pictures
            check_available()
        except ReportUnavailable as exc:
            return str(exc)
        if args.sidecar:
            return "--report draws kill rounds, not --sidecar"
    if args.from_json and not args.report:
        return "--from needs --report DIR"
    from understudy.tools.drill_fleet import SCENARIOS as POD_SCENARIOS

    if args.scenario in POD_SCENARIOS and (args.kube or args.sidecar or args.target):
        return f"--scenario {args.scenario} drills a local fleet (local up --pods N) only"
    return None


def _redraw(args: argparse.Namespace) -> int:
    """``--from F --report DIR``: the pictures of a saved drill."""
    saved = json.loads(Path(args.from_json).read_text())
    if not isinstance(saved, dict) or "rounds" not in saved or "summary" not in saved:
        print(
            f"understudy drill: {args.from_json} is not the JSON of a kill drill "
            "(understudy drill --output)",
            file=sys.stderr,
        )
        return 2
    _report(saved, Path(args.report))
    return 0


def _drill_target(args: argparse.Namespace) -> tuple[Any, Any]:
    """The pod to drill, and the cluster observer (None for a local pod); a
    pod scenario's is the local fleet."""
    from understudy.tools.drill_fleet import SCENARIOS as POD_SCENARIOS
    from understudy.tools.drill_target import FleetTarget, LocalTarget

    target: Any
    observer = None
    if args.scenario in POD_SCENARIOS:
        target = FleetTarget(Path(args.dir).absolute())
    elif args.kube:
        from understudy.tools.drill_kube import KubeTarget

        namespace, _, name = args.kube.rpartition("/")
        target = KubeTarget(namespace or "default", name, args.kubeconfig, args.kube_pod)
        observer = target.observer
        observer.start()
    else:
        target = LocalTarget(Path(args.dir).absolute())
    if args.target:
        target.serve_url = args.target
    return target, observer


def _stop(observer: Any) -> None:
    if observer is not None:
        observer.stop.set()
        observer.join(5)


def _emit(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


def _front_drill(args: argparse.Namespace, target: Any, observer: Any) -> int:
    from understudy.tools import drill_front

    load_start = os.getloadavg()
    try:
        result = drill_front.front_drill(
            target, args.kills or 5, args.clients, timeout=args.timeout
        )
    finally:
        _stop(observer)
    result["host"] = {"loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg())}
    if observer is not None:
        result["cluster"] = observer.report()
    _emit(args, result)
    print(json.dumps(result) if args.json else drill_front.render(result))
    return 0 if result["passed"] else 1


def _sidecar_drill(args: argparse.Namespace, target: Any, observer: Any) -> int:
    from understudy.tools.drill_sidecar import sidecar_drill

    if args.sidecar == "front":
        return _front_drill(args, target, observer)
    try:
        load_start = os.getloadavg()
        result = sidecar_drill(
            target,
            args.sidecar,
            timeout=args.timeout,
            clients=args.sidecar_clients,
            kills=args.sidecar_kills,
        )
        result["load_average"] = {"start": load_start, "end": os.getloadavg()}
    finally:
        _stop(observer)
    if observer is not None:
        result["cluster"] = observer.report()
    _emit(args, result)
    print(json.dumps(result))
    return 0


def _fleet_drill(args: argparse.Namespace, target: Any, say: Any) -> Any:
    from understudy.tools import drill_fleet

    return drill_fleet.fleet_drill(
        target,
        args.kills if args.kills is not None else 10,
        args.scenario,
        freeze_s=args.freeze_seconds,
        timeout=args.timeout,
        log=say,
        clients=args.clients,
        max_tokens=args.max_tokens,
    )


def _engine_drill(args: argparse.Namespace, target: Any, say: Any) -> Any:
    from understudy.tools import drill

    sig = [
        getattr(signal, f"SIG{name.strip().upper().removeprefix('SIG')}")
        for name in args.signal.split(",")
    ]
    return drill.drill(
        target,
        args.kills if args.kills is not None else 10,
        sig,
        timeout=args.timeout,
        log=say,
        check_serving=not args.target,
        scenario=args.scenario,
        clients=args.clients,
        max_tokens=args.max_tokens,
        takeover_delay=args.takeover_delay,
        every=args.every,
        poison=args.poison,
    )


def _kill_drill(args: argparse.Namespace, target: Any, observer: Any) -> int:
    from understudy.tools import drill_fleet, drill_result

    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    load_start = os.getloadavg()
    try:
        run = _fleet_drill if args.scenario in drill_fleet.SCENARIOS else _engine_drill
        report = run(args, target, say)
    finally:
        _stop(observer)
    result = drill_result.to_json(report, series=args.series or bool(args.report))
    result["host"] = {
        "cpus": os.cpu_count(),
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
    }
    if observer is not None:
        result["cluster"] = observer.report()
    if args.cold_start and not args.kube:
        result["cold_start"] = _cold_start(Path(args.dir).absolute(), result["summary"], say)
    _emit(args, result)
    if args.json:
        print(json.dumps(result))
    else:
        print(drill_result.render(report))
        _print_extras(result)
    if args.report:
        _report(result, Path(args.report))
    return 0 if report.passed() else 1


def _print_extras(result: dict[str, Any]) -> None:
    """The lines a human reads under the drill's table: the cold start and the cluster."""
    if "to_first_token_s" in result.get("cold_start", {}):
        print(_cold_start_line(result["cold_start"]))
    if "cluster" in result:
        c = result["cluster"]
        print(
            f"pod left the Service's endpoints: {'YES' if c['left_endpoints'] else 'never'}"
            f"; seconds not an endpoint: {c['seconds_not_an_endpoint']}"
            f"; seconds pod not Ready: {c['seconds_pod_not_ready']}"
            f"; restarts: {c['restarts']}"
        )


def cmd_drill(args: argparse.Namespace) -> int:
    if (problem := _drill_usage_error(args)) is not None:
        print(f"understudy drill: {problem}", file=sys.stderr)
        return 2
    if args.from_json:
        return _redraw(args)
    try:
        target, observer = _drill_target(args)
    except ValueError as exc:  # a pod scenario on one pod, not a fleet
        print(f"understudy drill: {exc}", file=sys.stderr)
        return 2
    if args.sidecar:
        return _sidecar_drill(args, target, observer)
    return _kill_drill(args, target, observer)


def _report(result: dict[str, Any], out: Path) -> None:
    from understudy.tools.report import write_report

    files = write_report(result, out)
    print(f"report: {files[0]} ({len(files) - 1} charts)", file=sys.stderr)


def _cold_start(directory: Path, summary: dict[str, Any], say: Any) -> dict[str, Any]:
    """vLLM's own cold start on the local pod's model and python, set against
    the drill's wake (grant -> Active) and re-arm times."""
    from understudy.tools.coldstart import vllm_cold_start
    from understudy.tools.local import read_state

    state = read_state(directory)
    if state.get("engine") != "vllm":
        say("--cold-start: the pod's engines are not vllm; nothing to compare with")
        return {"skipped": f"engine {state.get('engine')!r}"}
    say("measuring vLLM's cold start (its OpenAI server, started from nothing) ...")
    cold = vllm_cold_start(
        state["engine_python"],
        state["model"],
        state.get("engine_args", []),
        log=directory / "logs" / "vllm-cold-start.log",
    )
    first = cold["to_first_token_s"]
    for key in ("grant_to_active_s", "kill_to_active_s", "rearm_s"):
        p50 = (summary.get(key) or {}).get("p50")
        if p50:
            cold[f"{key.removesuffix('_s')}_p50_vs_cold_start"] = round(p50 / first, 4)
    return cold


def _cold_start_line(cold: dict[str, Any]) -> str:
    return (
        f"vLLM cold start (same run): healthy after {cold['to_healthy_s']:.1f} s, first token "
        f"after {cold['to_first_token_s']:.1f} s; granted -> Active p50 is "
        f"{cold.get('grant_to_active_p50_vs_cold_start', float('nan')):.1%} of it, "
        f"re-arm p50 {cold.get('rearm_p50_vs_cold_start', float('nan')):.1%}"
    )


def _target_args(dr: argparse.ArgumentParser, default_dir: Path) -> None:
    """Which pod the drill kills in, and where its load goes."""
    dr.add_argument("--dir", default=str(default_dir), help="the local pod to drill")
    dr.add_argument("--target", help="serving URL to load (default: the local pod's)")
    dr.add_argument(
        "--kube",
        metavar="NAMESPACE/NAME",
        help="drill a GpuInstance on a cluster through its Service (run on the node)",
    )
    dr.add_argument("--kubeconfig", help="kubeconfig for --kube (default: $KUBECONFIG)")
    dr.add_argument(
        "--kube-pod",
        metavar="POD",
        help="with --kube: kill in this pod of the instance's several (the load still goes "
        "through the Service: behind a gateway, to every pod)",
    )


def _stacked_fault_args(dr: argparse.ArgumentParser) -> None:
    """The drill's faults that stack: a second one in each round, rounds back
    to back, and a poison."""
    from understudy.tools import drill, drill_fleet

    dr.add_argument(
        "--scenario",
        choices=(*drill.SCENARIOS, *drill_fleet.SCENARIOS),
        help="a second fault in every round: kill the engine that took over as soon as it "
        "serves; or kill the lock server, or GMS, during the failover. Or, on a local fleet "
        "(local up --pods N), a fault to the pod serving the most streams instead of an "
        "engine: pod-kill SIGKILLs all its processes (a node's loss), pod-freeze SIGSTOPs "
        "them for --freeze-seconds (a partition that heals)",
    )
    dr.add_argument(
        "--freeze-seconds",
        type=float,
        default=5.0,
        help="pod-freeze: how long the pod's processes stay stopped",
    )
    dr.add_argument(
        "--takeover-delay",
        type=float,
        default=0.0,
        help="takeover-kill: seconds after the new engine is seen Active before it is killed",
    )
    dr.add_argument(
        "--every",
        type=float,
        help="rounds back to back: each round's kill this many seconds after the last "
        "round's, once the pod is armed again",
    )
    dr.add_argument(
        "--poison",
        metavar="MARKER",
        help="also send one request whose prompt holds MARKER (engines armed with "
        "UNDERSTUDY_FAILPOINTS=engine.poison=return(MARKER)); it must be told apart as "
        "the poison, and is reported apart from the failures",
    )


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from understudy.tools import drill_sidecar
    from understudy.tools.local import DEFAULT_DIR

    local = sub.add_parser("local", help="the whole pod as local processes")
    local_sub = local.add_subparsers(dest="local_command", required=True, metavar="COMMAND")
    up = local_sub.add_parser("up", help="start lock server, GMS and engines; restart like kubelet")
    up.add_argument(
        "--engine",
        choices=ENGINES,
        default="llama",
        help="llama: a generative Llama (built offline, chat and completions); vllm: the same "
        "model served by vLLM (its CPU build here; needs the vLLM venv); reference: "
        "all-MiniLM-L6-v2 embeddings; synthetic: weights of any size, a checksum",
    )
    up.add_argument(
        "--model",
        help="model source (llama, vllm: builtin:smollm2-135m, a real instruct model; "
        "builtin:tiny-llama, random weights, the default; or a Hugging Face directory; "
        "reference: builtin or a directory; synthetic: a size such as 1GiB)",
    )
    up.add_argument("--engine-arg", action="append", help="extra adapter argument (repeatable)")
    up.add_argument(
        "--engine-python",
        help="vllm: the python with vLLM for the engines (default: $UNDERSTUDY_VLLM_PYTHON; "
        "in a checkout, hack/vllm/venv's, built on first use)",
    )
    up.add_argument("--shadows", type=int, default=1)
    up.add_argument("--devices", default="0")
    up.add_argument(
        "--gms-backend",
        choices=("host", "cuda"),
        default="host",
        help="GMS memory: host (memfd, any machine) or cuda (CUDA VMM on the devices' GPUs: "
        "the whole pod on a GPU machine; refused at once where there is none)",
    )
    up.add_argument("--dir", default=str(DEFAULT_DIR), help="sockets, state, logs")
    up.add_argument("--port", type=int, default=8000, help="serving port")
    up.add_argument("--status-port", type=int, default=8100, help="first engine status port")
    up.add_argument(
        "--metrics-port",
        type=int,
        default=9101,
        help="lock server metrics; GMS metrics on the next port, front status on the next",
    )
    up.add_argument("--hold", type=float, default=30.0, help="front: seconds a request may wait")
    up.add_argument(
        "--hang-after", type=float, default=1.0, help="front: heartbeat silence that means hung"
    )
    up.add_argument(
        "--migration-limit", type=int, default=8, help="front: moves allowed per request"
    )
    up.add_argument("--reconnect-window", type=float, default=10.0)
    up.add_argument("--startup-budget", type=float, default=600.0)
    up.add_argument("--wake-timeout", type=float, default=30.0)
    up.add_argument("--remap-timeout", type=float, default=30.0)
    up.add_argument(
        "--max-backoff",
        type=float,
        default=300.0,
        help="cap of the restart back-off in seconds (kubelet's CrashLoopBackOff: "
        "at once, then 10 s doubling to this cap; kubelet's maxContainerRestartPeriod)",
    )
    up.add_argument(
        "--pods",
        type=_at_least_one,
        default=1,
        help="run this many pods (each in DIR/pod-I, its ports after the last pod's) behind "
        "the fleet gateway, which serves --port",
    )
    up.add_argument(
        "--detach", action="store_true", help="run in the background; return once the pod serves"
    )
    up.add_argument(
        "--ready-timeout", type=float, default=None, help="seconds (default 120; vllm: 600)"
    )
    up.set_defaults(func=cmd_local_up)
    _add_down(local_sub, DEFAULT_DIR)

    dr = sub.add_parser("drill", help="kill the active engine under load and measure failovers")
    dr.add_argument(
        "--kills", type=int, default=None, help="rounds (default 10; --sidecar front: 5)"
    )
    dr.add_argument(
        "--signal",
        default="KILL",
        help="KILL, STOP (hang) or SEGV, or a list (KILL,SEGV,STOP) cycled through the rounds",
    )
    _stacked_fault_args(dr)
    _target_args(dr, DEFAULT_DIR)
    dr.add_argument(
        "--sidecar",
        choices=(*drill_sidecar.SIDECAR_COMMANDS, "front"),
        help="instead: kill this sidecar once under load and report what happened; "
        "front: kill the front --kills times under --clients streams (no connection may "
        "be refused; losses only inside the dying front, as it reports them)",
    )
    dr.add_argument(
        "--sidecar-clients",
        type=int,
        default=1,
        help="--sidecar: concurrent request streams while the sidecar dies",
    )
    dr.add_argument(
        "--sidecar-kills",
        type=int,
        default=1,
        help="--sidecar: kill it this many times, each once the pod is settled again",
    )
    dr.add_argument("--timeout", type=float, default=60.0, help="per-round limit")
    dr.add_argument("--clients", type=int, default=16, help="concurrent request streams")
    dr.add_argument(
        "--max-tokens", type=int, default=32, help="tokens per generation request (LLM engines)"
    )
    dr.add_argument(
        "--cold-start",
        action="store_true",
        help="local vllm pods: after the kills, time vLLM's own server starting cold on the "
        "same model and python, and report the failover against it",
    )
    dr.add_argument("--json", action="store_true", help="print the report as one JSON line")
    dr.add_argument("--output", help="also write the JSON report to this file")
    dr.add_argument(
        "--report",
        metavar="DIR",
        help="also write an HTML page with PNG charts into DIR (needs understudy-tools[report]); "
        "the JSON then carries every request (--series)",
    )
    dr.add_argument(
        "--series",
        action="store_true",
        help="put every request (start, latency, kind, ok) in the JSON, thinned out in long drills",
    )
    dr.add_argument(
        "--from",
        dest="from_json",
        metavar="FILE",
        help="with --report: draw the report of a saved drill JSON instead of drilling",
    )
    dr.set_defaults(func=cmd_drill)
