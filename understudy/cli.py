"""The ``understudy`` console script: one subcommand group per component.

Each component's ``cli`` module exposes ``add_commands(subparsers)``, which adds
its subcommands and sets ``func`` on each to a callable taking the parsed
namespace and returning the exit code. This module only dispatches; it makes
no decisions (STYLE.md b14).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Component CLIs, imported lazily so that `understudy lock status` does not pay
# for importing the operator's Kubernetes client.
COMPONENTS: tuple[tuple[str, str], ...] = (
    # (the commands it adds, the module that adds them)
    ("lockserver, lock", "understudy.lockserver.cli"),
    ("gms", "understudy.gms.cli"),
    ("engine, local, drill", "understudy.engine_shim.cli"),
    ("operator, render", "understudy.operator.cli"),
)


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="understudy",
        description="Understudy: hot-standby LLM engines on Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for names, module_name in COMPONENTS:
        commands = {n.strip() for n in names.split(",")}
        if selected is not None and selected not in commands:
            continue
        module = importlib.import_module(module_name)
        module.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Import only the component that owns the command, when it is known.
    first = args_list[0] if args_list and not args_list[0].startswith("-") else None
    known = {n.strip() for names, _ in COMPONENTS for n in names.split(",")}
    parser = build_parser(first if first in known else None)
    args = parser.parse_args(args_list)
    code: int = args.func(args)
    return code
