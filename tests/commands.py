"""Command lines read back with the components' own argument parsers.

A rendered container's command (``understudy respawn … -- understudy gms
serve …``) or a local process's (``python -m understudy.cli …``) becomes the
parsed arguments of each program in it: the wrapper's, then its child's. A
test then asserts on values, as the component will see them, not on how the
command line happens to spell them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from understudy.cli import build_parser


def parse(argv: Sequence[str]) -> list[dict[str, Any]]:
    """One dict of parsed arguments per program: ``[respawn's, child's]`` or ``[the command's]``."""
    words = _after_program(argv)
    args = vars(build_parser(words[0]).parse_args(words))
    args.pop("func", None)
    if words[0] != "respawn":
        return [args]
    child = list(args.pop("cmd"))
    return [args, *parse(child[1:] if child[:1] == ["--"] else child)]


def _after_program(argv: Sequence[str]) -> list[str]:
    """The dispatcher's words: after ``understudy`` or ``python -m understudy.cli``;
    ``python -m understudy.X`` is component X's commands without the dispatcher."""
    if Path(argv[0]).name == "understudy":
        return list(argv[1:])
    if list(argv[1:2]) == ["-m"] and argv[2].startswith("understudy."):
        if argv[2] == "understudy.cli":
            return list(argv[3:])
        return [argv[2].removeprefix("understudy."), *argv[3:]]
    raise ValueError(f"not an understudy command: {argv}")
