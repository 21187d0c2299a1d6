"""The ``understudy`` console script: one subcommand group per installed component.

Every component distribution declares its commands as entry points in the group
``understudy.commands`` (name: the command; value: a function that adds its
subcommands to the parser). A component that is not installed has no
commands, so a sidecar image carrying only the lock server still gets a
working ``understudy lockserver serve``. This module only dispatches; it makes
no decisions, so what a command does lives with the component that owns it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points

GROUP = "understudy.commands"

AddCommands = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

# Which distribution brings each command, for the one-line error when it is missing.
PROVIDERS = {
    "lockserver": "understudy-lockserver",
    "lock": "understudy-lockserver",
    "gms": "understudy-gms",
    "engine": "understudy-engine-shim",
    "model": "understudy-engine-shim",
    "front": "understudy-front",
    "gateway": "understudy-front",
    "operator": "understudy-operator",
    "render": "understudy-operator",
    "local": "understudy-tools",
    "drill": "understudy-tools",
    "respawn": "understudy-respawner",
}


def commands() -> dict[str, EntryPoint]:
    """Installed commands by name."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="understudy",
        description="Understudy: hot-standby LLM engines on Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    found = commands()
    # Import only the component that owns the command when it is known, so
    # that `understudy lock status` does not pay for the Kubernetes client.
    # One function may add several commands: load each function once.
    wanted = [found[selected]] if selected in found else list(found.values())
    loaded: set[str] = set()
    for ep in sorted(wanted, key=lambda e: e.value):
        if ep.value in loaded:
            continue
        loaded.add(ep.value)
        add: AddCommands = ep.load()
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    first = args_list[0] if args_list and not args_list[0].startswith("-") else None
    if first is not None and first not in commands() and first in PROVIDERS:
        print(
            f"understudy: the command {first!r} is not installed here; "
            f"pip install {PROVIDERS[first]}",
            file=sys.stderr,
        )
        return 2
    parser = build_parser(first)
    args = parser.parse_args(args_list)
    code: int = args.func(args)
    return code
