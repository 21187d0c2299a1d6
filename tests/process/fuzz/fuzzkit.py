"""What the live-server fuzzers share: their budget, hypothesis settings, and
the byte-level pieces every hostile client is made of.

Budget: ``UNDERSTUDY_FUZZ_EXAMPLES`` (default ``DEFAULT_EXAMPLES``) examples
per fuzzer. Each example is one random program of clients against a server
that keeps running across examples, so a larger number is a longer run, not a
different test: ``UNDERSTUDY_FUZZ_EXAMPLES=500 python -m pytest
tests/process/fuzz``. Shrinking a failure replays programs against the same
live server; it is off by default (the failing program is printed whole, at
once, which is what a CI log needs) and on with ``UNDERSTUDY_FUZZ_SHRINK=1``.
"""

from __future__ import annotations

import os
import re
import select
import socket
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

DEFAULT_EXAMPLES = 40
EXAMPLES = int(os.environ.get("UNDERSTUDY_FUZZ_EXAMPLES", str(DEFAULT_EXAMPLES)))
SHRINK = os.environ.get("UNDERSTUDY_FUZZ_SHRINK", "") not in ("", "0")


def fuzz_settings() -> settings:
    """Hypothesis settings for one fuzzer's run against its live server."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if SHRINK:
        phases.append(Phase.shrink)
    return settings(
        max_examples=max(1, EXAMPLES),
        deadline=None,
        phases=phases,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
        print_blob=True,
    )


def timeout_for(setup_s: float, per_example_s: float) -> pytest.MarkDecorator:
    """A pytest timeout that grows with the budget (never below the suite's 120 s)."""
    return pytest.mark.timeout(max(120.0, setup_s + per_example_s * EXAMPLES))


# --------------------------------------------------------------- bytes ----


def frame(body: bytes) -> bytes:
    """Our length prefix (understudy.wire.framing), with any body at all."""
    return struct.pack(">I", len(body)) + body


def readable(socks: Iterable[socket.socket], timeout: float) -> list[socket.socket]:
    socks = [s for s in socks if s.fileno() >= 0]
    if not socks:
        return []
    ready, _, _ = select.select(socks, [], [], timeout)
    return ready


def linger_reset(sock: socket.socket) -> None:
    """Make ``close`` send a TCP RST instead of a FIN (no-op on Unix sockets)."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def log_tail(log: Path, lines: int = 80) -> str:
    """The end of a server's log, for a failure's report (pytest prints stdout)."""
    if not log.exists():
        return f"(no log at {log})"
    return f"--- last {lines} lines of {log}\n" + "\n".join(
        log.read_text(errors="replace").splitlines()[-lines:]
    )


# aiohttp logs every request it cannot parse at ERROR, with a traceback, and
# answers it 400: the answer is right, and the traceback is aiohttp's.
_BAD_REQUEST = "aiohttp.http_exceptions."


def tracebacks(log: Path) -> list[str]:
    """Python tracebacks a server wrote to its log: each one is a bug here, but
    aiohttp's for the requests it answered 400 as unparsable."""
    if not log.exists():
        return []
    text = log.read_text(errors="replace")
    found = re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*.*", text)
    return [tb[-2000:] for tb in found if not tb.splitlines()[-1].startswith(_BAD_REQUEST)]


# -------------------------------------------------------------- values ----

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def weighted(*choices: tuple[st.SearchStrategy[Any], int]) -> st.SearchStrategy[Any]:
    """One of the strategies, each as often as its weight says (``one_of`` would
    treat a strategy listed twice as one branch)."""
    table = [strategy for strategy, weight in choices for _ in range(weight)]
    return st.sampled_from(table).flatmap(lambda strategy: strategy)


def deep_json(max_depth: int) -> st.SearchStrategy[bytes]:
    """``[[[…]]]``, nested up to ``max_depth`` deep: parsers that recurse
    overflow past about a thousand (Python's json does), so most go past it."""
    depths = weighted((st.integers(2, 500), 1), (st.integers(900, max_depth), 3))
    return depths.map(nested)  # a named function: a failure prints nested(5000)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def mutations(valid: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid document changed in one way: a field dropped, retyped or added."""

    def mutate(
        doc: dict[str, Any], how: int, key_pick: int, value: Any, extra: str
    ) -> dict[str, Any]:
        doc = dict(doc)
        keys = sorted(doc)
        key = keys[key_pick % len(keys)]
        if how == 0:
            doc.pop(key)
        elif how == 1:
            doc[key] = value
        else:
            doc[extra or "x"] = value
        return doc

    return st.builds(
        mutate,
        valid,
        st.integers(0, 2),
        st.integers(0, 16),
        json_values,
        st.text(max_size=6),
    )


def ensure(cond: object, what: str | Callable[[], str]) -> None:
    """An invariant: a plain assert whose message is built only on failure."""
    if not cond:
        raise AssertionError(what() if callable(what) else what)
