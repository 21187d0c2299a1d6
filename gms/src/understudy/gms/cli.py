"""``understudy gms …``: thin subcommands (parse, build a config, call one function).

    understudy gms serve --socket-dir D --devices 0,1 --backend host|cuda [--metrics-port P]
    understudy gms server --socket PATH --device N [--backend host|cuda]   (what serve runs)
    understudy gms status --socket PATH [--timeout S]                      (one JSON line)
    understudy gms wait-ready --socket-dir D --devices 0,1 [--timeout S]   (startup probe)

Before the top-level dispatcher lists this module, run it as
``python -m understudy.gms.cli <command> …``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from understudy.gms.config import (
    DEFAULT_SOCKET_DIR,
    DEFAULT_TAG,
    ServerConfig,
    StatusConfig,
    SupervisorConfig,
    WaitReadyConfig,
    parse_devices,
    socket_path,
)
from understudy.gms.messages import GmsError

_PR_SET_PDEATHSIG = 1
_LOCK_STATE_HELP = (
    "the lock server's record, read to check who may map the KV pool "
    "(default: lock.state beside the socket directory; 'none': the epoch alone fences)"
)


def _devices(text: str) -> tuple[int, ...]:
    try:
        return parse_devices(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fail(command: str, message: object) -> int:
    print(f"understudy gms {command}: {message}", file=sys.stderr)
    return 2


def cmd_server(args: argparse.Namespace) -> int:
    from understudy.gms import server
    from understudy.wire.obs import setup_logging

    if args.parent_pid is not None:
        # Die with the supervisor, and not start at all if it is already gone.
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != args.parent_pid:
            return _fail("server", "supervisor is gone")
    setup_logging()
    config = ServerConfig(
        socket=Path(args.socket),
        device=args.device,
        tag=args.tag,
        backend=args.backend,
        granularity=args.granularity,
        metrics_port=args.metrics_port,
        adopt_window_s=args.adopt_window,
        lock_state=_lock_state(args.lock_state, Path(args.socket).parent),
    )
    try:
        return asyncio.run(server.run(config))
    except GmsError as exc:  # BackendUnavailable: one clear line, no traceback
        return _fail("server", exc)
    except OSError as exc:  # the socket is taken, the directory unusable
        return _fail("server", exc)


def cmd_serve(args: argparse.Namespace) -> int:
    from understudy.gms import supervisor
    from understudy.wire.obs import setup_logging

    setup_logging()
    config = SupervisorConfig(
        socket_dir=Path(args.socket_dir),
        devices=args.devices,
        tag=args.tag,
        backend=args.backend,
        granularity=args.granularity,
        metrics_port=args.metrics_port,
        grace_s=args.grace,
        adopt_window_s=args.adopt_window,
        lock_state=_lock_state(args.lock_state, Path(args.socket_dir)),
    )
    return supervisor.run(config)


def _lock_state(given: str | None, socket_dir: Path) -> Path | None:
    """The lock server's record: as given ("none": do not read one), else beside
    the GMS socket directory, where the pod keeps it (/run/understudy/lock.state)."""
    if given is None:
        return socket_dir.parent / "lock.state"
    return None if given == "none" else Path(given)


def cmd_status(args: argparse.Namespace) -> int:
    from understudy.gms.client import query_state

    config = StatusConfig(socket=Path(args.socket), timeout_s=args.timeout)
    try:
        report = query_state(config.socket, config.timeout_s)
    except (GmsError, OSError) as exc:
        print(json.dumps({"socket": str(config.socket), "error": str(exc)}))
        return 1
    doc = report.model_dump(mode="json", exclude={"type"})
    print(json.dumps({"socket": str(config.socket), **doc}, sort_keys=True))
    return 0


def cmd_wait_ready(args: argparse.Namespace) -> int:
    from understudy.gms.client import query_state

    config = WaitReadyConfig(
        socket_dir=Path(args.socket_dir), devices=args.devices, tag=args.tag, timeout_s=args.timeout
    )
    deadline = time.monotonic() + config.timeout_s
    pending = {d: socket_path(config.socket_dir, d, config.tag) for d in config.devices}
    errors: dict[int, str] = {}
    while pending:
        for device, path in list(pending.items()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                query_state(path, min(remaining, 1.0))
                del pending[device]
            except (GmsError, OSError) as exc:
                errors[device] = str(exc)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if pending:
        missing = ", ".join(f"{pending[d]} ({errors.get(d, 'timed out')})" for d in pending)
        return _fail("wait-ready", f"not ready: {missing}")
    return 0


_ADOPT_HELP = (
    "after a restart over a committed layout, seconds to wait for the engine that "
    "still maps it to give it back before anyone may load anew"
)


def _add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    backend_help = "host (memfd, any Linux) or cuda (CUDA VMM)"

    p = sub.add_parser("serve", help="one GMS server process per device; exits when any dies")
    p.add_argument("--socket-dir", default=str(DEFAULT_SOCKET_DIR))
    p.add_argument("--devices", type=_devices, required=True, help="e.g. 0,1")
    p.add_argument("--backend", choices=("host", "cuda"), default="host", help=backend_help)
    p.add_argument("--tag", default=DEFAULT_TAG)
    p.add_argument("--granularity", type=int, default=None, help="host backend alignment")
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--grace", type=float, default=5.0, help="seconds before SIGKILL")
    p.add_argument("--adopt-window", type=float, default=5.0, help=_ADOPT_HELP)
    p.add_argument("--lock-state", default=None, help=_LOCK_STATE_HELP)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("server", help="one GMS server (one device, one tag)")
    p.add_argument("--socket", required=True)
    p.add_argument("--device", type=int, required=True)
    p.add_argument("--backend", choices=("host", "cuda"), default="host", help=backend_help)
    p.add_argument("--tag", default=DEFAULT_TAG)
    p.add_argument("--granularity", type=int, default=None)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--adopt-window", type=float, default=5.0, help=_ADOPT_HELP)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lock-state", default=None, help=_LOCK_STATE_HELP)
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("status", help="print the server's state as one JSON line")
    p.add_argument("--socket", required=True)
    p.add_argument("--timeout", type=float, default=2.0)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("wait-ready", help="exit 0 once every device's socket answers")
    p.add_argument("--socket-dir", default=str(DEFAULT_SOCKET_DIR))
    p.add_argument("--devices", type=_devices, required=True)
    p.add_argument("--tag", default=DEFAULT_TAG)
    p.add_argument("--timeout", type=float, default=1.0)
    p.set_defaults(func=cmd_wait_ready)


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``gms`` command group to the top-level ``understudy`` parser."""
    gms = subparsers.add_parser("gms", help="GPU Memory Service")
    _add(gms.add_subparsers(dest="gms_command", metavar="COMMAND", required=True))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="understudy gms", description="GPU Memory Service")
    _add(parser.add_subparsers(dest="gms_command", metavar="COMMAND", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
