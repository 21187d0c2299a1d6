"""``understudy front serve`` (or ``python -m understudy.front serve``): the
pod's front door (a native sidecar).

A restarted front's start is the wait of every client whose connection queued
meanwhile, so this module imports only argparse until it runs, and the front
accepts before it imports anything it does not need to accept
(``proxy.run``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def since_exec() -> float:
    """Seconds since this process was exec'd (its start time, from /proc)."""
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as f:
            # Field 22, after the command in parentheses (which may hold spaces).
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


_FRONT_MODULES = (
    "asyncio",
    "uvloop",
    "understudy.front.config",
    "understudy.front.proxy",
    "understudy.front.metrics",
    "understudy.lockserver",
    "prometheus_client",
    "prometheus_client.exposition",
    "understudy.wire.obs",
)
# A gateway's: its EndpointSlices client is most of its import time.
_GATEWAY_MODULES = (
    "asyncio",
    "uvloop",
    "understudy.front.gateway",
    "understudy.front.slicewatch",
    "kubernetes.client",
    "kubernetes.watch",
    "prometheus_client.exposition",
    "understudy.wire.obs",
)


def _prepare_if_spare(
    modules: Sequence[str] = _FRONT_MODULES, before_turn: Callable[[], object] = lambda: None
) -> float | None:
    """A spare front (``understudy respawn --spare``) imports everything a front
    ever loads, then waits for its turn: the front it stands behind died. It
    binds nothing and connects to nothing before that (the serving socket is
    the lock server's to hand over), so its turn costs only the hand-over:
    a cold start of Python and these imports is most of a second on a busy
    node, all of it time that queued connections wait. Returns the monotonic
    time of the turn (None: not a spare), where this front's start begins.
    A spare gateway does the same with its own ``modules``; its ports are
    the respawner's (``--listen``). ``before_turn`` runs in a spare once it
    is prepared, before its turn (off the turn's path)."""
    from understudy.wire import respawn

    if not respawn.is_spare():
        return None
    import importlib

    for module in modules:
        with contextlib.suppress(ImportError):  # the command says what is missing
            importlib.import_module(module)
    before_turn()
    respawn.wait_turn()
    return time.monotonic()


def cmd_serve(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)

    def witness() -> None:
        # Before any thread: the witness shares this process's descriptor
        # table, so that no accepted connection is ever in one process only.
        from understudy.front import witness

        witness.start(run_dir, args.port)

    # A spare makes it before its turn (off the turn's path); any other front now.
    turn = _prepare_if_spare(before_turn=witness)
    if turn is None:
        witness()
    import asyncio

    import uvloop

    from understudy.front.config import FrontConfig
    from understudy.front.proxy import run
    from understudy.wire.obs import setup_logging

    setup_logging()
    cfg = FrontConfig(
        run_dir=run_dir,
        lock_socket=args.lock_socket or str(run_dir / "lock.sock"),
        port=args.port,
        host=args.host,
        status_port=args.status_port,
        hold_s=args.hold,
        migration_limit=args.migration_limit,
        hang_after_s=args.hang_after,
        working_hang_after_s=args.working_hang_after,
        drain_s=args.drain,
        idle_s=args.idle_timeout,
    )
    # uvloop: the loop and its transports in C. The front's own CPU is most
    # of the latency it adds to a request (bench/front_overhead.py), and
    # asyncio's pure-Python loop was about a third of that.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        started = since_exec() if turn is None else time.monotonic() - turn
        runner.run(run(cfg, started))
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    """``understudy gateway``: parse, one frozen config, run."""
    _prepare_if_spare(_GATEWAY_MODULES)
    import asyncio
    import importlib.util

    import uvloop

    from understudy.front import gateway, pods, slicewatch
    from understudy.front.apikeys import ApiKeyError, ApiKeys
    from understudy.wire.obs import setup_logging

    try:
        listed = tuple(pods.parse_pod(p) for p in args.pod or ())
        slices = slicewatch.parse_target(args.endpointslices) if args.endpointslices else None
    except (pods.PodListError, ValueError) as exc:
        print(f"understudy gateway: {exc}", file=sys.stderr)
        return 2
    if sum(map(bool, (listed, args.pods_file, slices))) != 1:
        print(
            "understudy gateway: give --pod (repeatable), --pods-file or --endpointslices",
            file=sys.stderr,
        )
        return 2
    if slices is not None and importlib.util.find_spec("kubernetes") is None:
        print(
            "understudy gateway: --endpointslices needs the kubernetes client "
            "(pip install 'understudy-front[kube]')",
            file=sys.stderr,
        )
        return 2
    try:
        keys = (
            ApiKeys(Path(args.api_key_file) if args.api_key_file else None, args.api_key or ())
            if args.api_key_file or args.api_key
            else None
        )
    except ApiKeyError as exc:
        print(f"understudy gateway: {exc}", file=sys.stderr)
        return 2
    setup_logging()
    cfg = gateway.GatewayConfig(
        api_keys=keys,
        pods=listed,
        pods_file=Path(args.pods_file) if args.pods_file else None,
        endpointslices=slices,
        port=args.port,
        host=args.host,
        metrics_port=args.metrics_port,
        hold_s=args.hold,
        migration_limit=args.migration_limit,
        silence_s=args.silence,
        grace_s=args.grace,
        drain_s=args.drain,
        idle_s=args.idle_timeout,
    )
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(gateway.run(cfg))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m understudy.front``: the front's commands without the dispatcher."""
    parser = argparse.ArgumentParser(prog="understudy")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["front", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive (every wait is bounded)")
    return value


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    front = sub.add_parser("front", help="the pod's front door: owns the serving port")
    front_sub = front.add_subparsers(dest="front_command", required=True, metavar="COMMAND")
    serve = front_sub.add_parser(
        "serve", help="route to the Active engine; hold and migrate across failovers"
    )
    serve.add_argument("--run-dir", default="/run/understudy", help="the pod's emptyDir")
    serve.add_argument("--lock-socket", help="default: RUN_DIR/lock.sock")
    serve.add_argument("--port", type=int, default=8000, help="the pod's serving port")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--status-port", type=int, default=8090)
    serve.add_argument(
        "--hold", type=_positive, default=30.0, help="seconds a request waits for an Active engine"
    )
    serve.add_argument(
        "--migration-limit",
        type=int,
        default=8,
        help="times a request may move to another engine (the last guard: docs/poison.md)",
    )
    serve.add_argument(
        "--hang-after",
        type=_positive,
        default=1.0,
        help="seconds without a heartbeat that make the Active engine hung (it is killed)",
    )
    serve.add_argument(
        "--working-hang-after",
        type=_positive,
        default=5.0,
        help="the same for an engine whose process still uses CPU (starved, not stopped)",
    )
    _add_client_side(serve)
    serve.set_defaults(func=cmd_serve)
    _add_gateway(sub)


def _add_gateway(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gw = sub.add_parser(
        "gateway",
        help="the fleet's front door: routes to pods, moves their streams when a pod dies",
    )
    gw.add_argument(
        "--pod",
        action="append",
        help="a pod front's address, http://HOST:PORT[?status=PORT][&name=NAME] (repeatable)",
    )
    gw.add_argument(
        "--pods-file",
        help="a JSON list of pod addresses, re-read when it changes (instead of --pod)",
    )
    gw.add_argument(
        "--endpointslices",
        metavar="NAMESPACE/SERVICE",
        help="list and watch the pods in this Service's EndpointSlices (on Kubernetes; "
        "instead of --pod)",
    )
    gw.add_argument("--port", type=int, default=8000, help="the port clients use")
    gw.add_argument("--host", default="0.0.0.0")
    gw.add_argument(
        "--metrics-port", type=int, default=8091, help="/live, /ready, /metrics, /state"
    )
    gw.add_argument(
        "--hold", type=_positive, default=30.0, help="seconds a request waits for a ready pod"
    )
    gw.add_argument(
        "--migration-limit",
        type=int,
        default=8,
        help="times a request may move to another pod (the last guard: docs/poison.md)",
    )
    gw.add_argument(
        "--silence",
        type=_positive,
        default=1.0,
        help="seconds without a probe's answer or a stream's heartbeat that make a pod dead",
    )
    gw.add_argument(
        "--grace",
        type=_positive,
        default=20.0,
        help="seconds a terminating pod's requests may finish there before they move",
    )
    gw.add_argument(
        "--api-key-file",
        help="Bearer keys, one per line (a mounted Secret; re-read when it changes): "
        "a request without one of them gets 401",
    )
    gw.add_argument(
        "--api-key",
        action="append",
        help="a Bearer key (repeatable; as vLLM's --api-key, but visible in /proc: "
        "prefer --api-key-file)",
    )
    _add_client_side(gw)
    gw.set_defaults(func=cmd_gateway)


def _add_client_side(parser: argparse.ArgumentParser) -> None:
    """The options of the side that faces clients, the same for a pod's front and a gateway."""
    parser.add_argument(
        "--drain", type=_positive, default=25.0, help="on SIGTERM, seconds to finish in-flight"
    )
    parser.add_argument(
        "--idle-timeout",
        type=_positive,
        default=75.0,
        help="seconds a client connection may stay idle, or take to send a request",
    )
