"""``understudy lockserver serve`` and ``understudy lock acquire|status``.

Exit codes (also in README.md):
  0  done (``status`` answered; ``serve``/``acquire`` stopped by SIGTERM/SIGINT)
  1  the lock server is unreachable or refused the request
  2  bad command line
  3  ``acquire``: the lock was granted, then lost (its grant could not be resumed)
  4  ``acquire``: not granted within ``--timeout``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from understudy.lockserver import client
from understudy.lockserver.config import (
    DEFAULT_CLIENT_RECONNECT_S,
    DEFAULT_RECONNECT_WINDOW_S,
    ServerConfig,
)
from understudy.wire import respawn
from understudy.wire.obs import setup_logging
from understudy.wire.uds import parse_tcp_address

EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, EXIT_LOST, EXIT_TIMEOUT = 0, 1, 2, 3, 4


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise SystemExit(f"token file {path} is empty")
    return token


def _print(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    setup_logging()
    try:
        config = ServerConfig(
            socket_path=Path(args.socket),
            state_file=Path(args.state_file),
            reconnect_window_s=args.reconnect_window,
            tcp=parse_tcp_address(args.tcp) if args.tcp else None,
            token=_read_token(args.token_file),
            metrics_port=args.metrics_port,
            serving=(args.serving_host, args.serving_port) if args.serving_port else None,
            grant_at_death=args.grant_at_death,
        )
    except ValueError as exc:
        print(f"understudy lockserver: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from understudy.lockserver.server import LockServer

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with LockServer(config) as server:
            # Listening, with its state restored: its respawner (the pod runs
            # it under one) restarts it at once from now on.
            respawn.notify_ready()
            serving = asyncio.ensure_future(server.serve_forever())
            await stop.wait()
            serving.cancel()

    asyncio.run(main())
    return EXIT_OK


def cmd_acquire(args: argparse.Namespace) -> int:
    setup_logging()
    lost = threading.Event()
    reason: list[str] = []

    def on_lost(why: str) -> None:
        reason.append(why)
        lost.set()

    try:
        held = client.acquire(
            args.socket,
            args.id,
            args.timeout,
            token=_read_token(args.token_file),
            on_lost=on_lost,
            reconnect_timeout=args.reconnect_timeout,
            connect_timeout=args.connect_timeout,
        )
    except client.LockTimeout as exc:
        _print({"event": "timeout", "engine_id": args.id, "error": str(exc)})
        return EXIT_TIMEOUT
    except client.LockError as exc:
        _print({"event": "error", "engine_id": args.id, "error": str(exc)})
        return EXIT_UNAVAILABLE
    _print({"event": "granted", "engine_id": held.engine_id, "epoch": held.epoch})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and not lost.is_set():
        stop.wait(0.05)  # signal handlers run between these short waits
    if lost.is_set():
        _print(
            {
                "event": "lost",
                "engine_id": held.engine_id,
                "epoch": held.epoch,
                "reason": reason[0] if reason else "",
            }
        )
        return EXIT_LOST
    held.close()
    _print({"event": "released", "engine_id": held.engine_id, "epoch": held.epoch})
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    try:
        reply = client.status(args.socket, timeout=args.timeout, token=_read_token(args.token_file))
    except client.LockError as exc:
        _print({"error": str(exc)})
        return EXIT_UNAVAILABLE
    _print(reply.model_dump(exclude={"type"}))
    return EXIT_OK


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    server = sub.add_parser("lockserver", help="the pod's lock server")
    server_sub = server.add_subparsers(dest="lockserver_command", required=True, metavar="COMMAND")
    serve = server_sub.add_parser("serve", help="serve the lock on a Unix socket (and TCP)")
    serve.add_argument("--socket", required=True, help="Unix socket path")
    serve.add_argument(
        "--state-file",
        required=True,
        help="persisted lock state, kept in two checksummed copies, PATH.a and PATH.b "
        "(read back on restart)",
    )
    serve.add_argument(
        "--reconnect-window",
        type=float,
        default=DEFAULT_RECONNECT_WINDOW_S,
        metavar="S",
        help="seconds a restarted server waits for its holder",
    )
    serve.add_argument("--tcp", metavar="HOST:PORT", help="also serve TCP (needs --token-file)")
    serve.add_argument("--token-file", help="shared token required from TCP clients")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    serve.add_argument(
        "--serving-port",
        type=int,
        metavar="PORT",
        help="keep the pod's serving port open for the front, and hand it to each front "
        "that starts (SOCKET's directory/keeper.sock), so connections wait while the "
        "front restarts instead of being refused",
    )
    serve.add_argument("--serving-host", default="0.0.0.0", help="address of --serving-port")
    serve.add_argument(
        "--grant-at-death",
        action="store_true",
        help="hand the lock on the moment the holder's process dies (the death word its "
        "engine arms beside its heartbeat), not when its connection closes after Linux "
        "has torn its memory down; only for engines on host memory: a GPU's memory is "
        "free only once the process is gone",
    )
    serve.set_defaults(func=cmd_serve)

    lock = sub.add_parser("lock", help="talk to a lock server")
    lock_sub = lock.add_subparsers(dest="lock_command", required=True, metavar="COMMAND")
    acq = lock_sub.add_parser(
        "acquire", help="block until granted, print the epoch, hold until killed"
    )
    acq.add_argument("--socket", required=True, help="Unix socket path or tcp:HOST:PORT")
    acq.add_argument("--id", required=True, help="engine id to acquire as")
    acq.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="give up (exit 4) if not granted in S seconds; default: wait",
    )
    acq.add_argument(
        "--reconnect-timeout",
        type=float,
        default=DEFAULT_CLIENT_RECONNECT_S,
        metavar="S",
        help="how long to try to resume after the server vanished",
    )
    acq.add_argument("--connect-timeout", type=float, default=10.0, metavar="S")
    acq.add_argument("--token-file")
    acq.set_defaults(func=cmd_acquire)
    st = lock_sub.add_parser("status", help="print holder, epoch, waiters, window as JSON")
    st.add_argument("--socket", required=True, help="Unix socket path or tcp:HOST:PORT")
    st.add_argument("--timeout", type=float, default=2.0, metavar="S")
    st.add_argument("--token-file")
    st.set_defaults(func=cmd_status)
