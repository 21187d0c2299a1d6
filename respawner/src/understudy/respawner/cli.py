"""``understudy respawn``: its options, and the one call that runs the
respawner (``understudy.respawner.shell``) with them. The command line is
what rendered pods and the local runner write, so it does not change."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from understudy.respawner import restart
from understudy.respawner.shell import Respawner, listen
from understudy.wire.obs import setup_logging


def _policy(args: argparse.Namespace) -> restart.Policy:
    return restart.Policy(
        args.backoff_initial, args.backoff_max, args.give_up_after, args.spare, args.spare_after
    )


def cmd_respawn(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("understudy respawn: no command (respawn [OPTIONS] -- CMD ...)", file=sys.stderr)
        return 2
    setup_logging()
    try:
        listeners = [listen(spec) for spec in args.listen]
    except (OSError, ValueError) as exc:
        print(f"understudy respawn: --listen: {exc}", file=sys.stderr)
        return 2
    return Respawner(argv, _policy(args), listeners).run()


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = restart.Policy()
    p = sub.add_parser(
        "respawn",
        help="run a command and start it again in place when it dies (a container's "
        "init; docs/pod.md)",
    )
    p.add_argument(
        "--backoff-initial",
        type=float,
        default=d.initial_s,
        help="seconds before the first restart of a command that failed to start",
    )
    p.add_argument("--backoff-max", type=float, default=d.max_s, help="cap of that back-off")
    p.add_argument(
        "--give-up-after",
        type=int,
        default=d.give_up_after,
        help="start failures in a row after which respawn exits with the command's code",
    )
    p.add_argument(
        "--spare",
        action="store_true",
        help="keep the next process started ahead of time, waiting for its turn "
        "(wait_turn()), so a restart skips the command's slow preparation",
    )
    p.add_argument(
        "--spare-after",
        type=float,
        default=d.spare_after_s,
        metavar="S",
        help="start the spare this long after the child said it started, so its "
        "preparation does not compete with the failover that the last death began",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="bind this TCP port once and pass the listening socket to every child "
        "(UNDERSTUDY_LISTEN_FDS): it stays open while the command restarts",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG ...]")
    p.set_defaults(func=cmd_respawn)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="understudy")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["respawn", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
