"""The front door's settings: one frozen record, built by the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class FrontConfig:
    run_dir: Path  # the pod's emptyDir: engines' serving sockets and heartbeats
    lock_socket: str  # the lock server (a path, or tcp:HOST:PORT)
    port: int = 8000  # the pod's serving port (spec.servingPort)
    host: str = "0.0.0.0"
    status_port: int = 8090  # /live, /ready, /metrics, /pressure, /state
    # A request that finds no Active engine waits this long for one.
    hold_s: float = 30.0
    # A request may move to another engine this many times: the last guard,
    # above what poison isolation lets a request reach (docs/poison.md).
    migration_limit: int = 8
    # An Active engine whose heartbeat is older than this is hung.
    hang_after_s: float = 1.0
    # ... unless its process still uses CPU: then it is starved, not hung,
    # and is given this long (fsm.Watchdog.working_hang_after_s).
    working_hang_after_s: float = 5.0
    beat_check_s: float = 0.1
    # Request bodies larger than this get 413 (a generous bound on prompts).
    max_body: int = 16 * 1024 * 1024
    # A client connection with no request for this long is closed, and a
    # request must arrive whole within it (408 otherwise). nginx and aiohttp
    # keep idle connections 75 s.
    idle_s: float = 75.0
    # On SIGTERM, finish in-flight requests for at most this long.
    drain_s: float = 25.0
