"""Frozen settings of the lock server and its clients."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_RECONNECT_WINDOW_S = 10.0
# The client keeps trying longer than the server's window, so a restarted
# server can still see its holder come back.
DEFAULT_CLIENT_RECONNECT_S = DEFAULT_RECONNECT_WINDOW_S + 5.0


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket_path: Path
    state_file: Path
    reconnect_window_s: float = DEFAULT_RECONNECT_WINDOW_S
    tcp: tuple[str, int] | None = None
    token: str | None = None
    metrics_port: int | None = None
    # The pod's serving port, kept open for the front across its restarts
    # (understudy.wire.handover): (host, port), or None to keep nothing.
    serving: tuple[str, int] | None = None
    # With ``serving``: how long the client connections of a front that died
    # are kept open for the next one (connhold), then closed.
    conns_hold_s: float = 30.0
    # Hand the lock on at the holder's death word (wire.deathword), before
    # Linux has torn the dead process's memory down and closed its
    # connection. Only where the next engine needs none of that memory freed
    # first (host memory); a GPU's memory goes only with the process.
    grant_at_death: bool = False

    def __post_init__(self) -> None:
        if self.reconnect_window_s < 0:
            raise ValueError("reconnect window must be >= 0 seconds")
        if self.tcp is not None and not self.token:
            raise ValueError("TCP needs a shared token (--token-file)")
