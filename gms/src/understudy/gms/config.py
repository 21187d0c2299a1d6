"""Frozen settings for the GMS server, the supervisor and the CLI commands."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from understudy.gms.messages import socket_name

DEFAULT_SOCKET_DIR = Path("/run/understudy/gms")
DEFAULT_TAG = "weights"


def socket_path(socket_dir: Path, device: int, tag: str = DEFAULT_TAG) -> Path:
    return socket_dir / socket_name(device, tag)


def parse_devices(text: str) -> tuple[int, ...]:
    """``"0,1"`` → ``(0, 1)``; no duplicates, no negatives, at least one."""
    try:
        devices = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"devices must be comma-separated integers, got {text!r}") from exc
    if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise ValueError(f"devices must be distinct non-negative integers, got {text!r}")
    return devices


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket: Path
    device: int
    tag: str = DEFAULT_TAG
    backend: str = "host"
    granularity: int | None = None  # host backend only; None = 2 MiB
    metrics_port: int | None = None  # None: no own /metrics (supervised children)
    health_interval_s: float = 5.0  # NVML poll for metrics and log (health.py)
    # After a restart over a committed layout: how long every hello waits for
    # the engine that still maps it to give it back (fsm, re-adoption).
    adopt_window_s: float = 5.0
    # The lock server's record, asked who holds the lock before the KV pool is
    # granted (lockword.py); None: the epoch alone fences.
    lock_state: Path | None = None


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    socket_dir: Path
    devices: tuple[int, ...]
    tag: str = DEFAULT_TAG
    backend: str = "host"
    granularity: int | None = None
    metrics_port: int | None = None
    grace_s: float = 5.0  # after a child dies or SIGTERM: SIGTERM, then SIGKILL
    adopt_window_s: float = 5.0
    lock_state: Path | None = None  # passed to every server (ServerConfig.lock_state)


@dataclass(frozen=True, slots=True)
class StatusConfig:
    socket: Path
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class WaitReadyConfig:
    socket_dir: Path
    devices: tuple[int, ...]
    tag: str = DEFAULT_TAG
    timeout_s: float = 1.0
