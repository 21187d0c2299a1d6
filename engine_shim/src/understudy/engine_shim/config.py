"""The engine's settings, read from the environment the pod (or the local
runner) sets — docs/pod.md lists every variable."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from understudy.wire.engines import DEFAULT_MODELS, NAMES, EngineAdapter
from understudy.wire.serving import heartbeat_path, serving_socket

ROLES = ("primary", "shadow")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    role: str
    name: str
    engine_id: str  # name + a per-process suffix: a restarted engine is a new holder
    run_dir: Path
    lock_socket: Path
    gms_socket_dir: Path
    gms_backend: str
    devices: tuple[int, ...]
    adapter: str
    model: str
    engine_args: tuple[str, ...]
    status_port: int
    startup_budget_s: float = 600.0
    wake_timeout_s: float = 30.0
    remap_timeout_s: float = 30.0
    lock_reconnect_s: float = 15.0
    drain_s: float = 25.0

    def gms_socket(self, device: int, tag: str = "weights") -> Path:
        return self.gms_socket_dir / f"gms_{device}_{tag}.sock"

    @property
    def serve_socket(self) -> Path:
        """Where this engine listens once Active (only the front connects)."""
        return serving_socket(self.run_dir, self.engine_id)

    @property
    def heartbeat(self) -> Path:
        return heartbeat_path(self.run_dir, self.engine_id)


def _get(env: Mapping[str, str], key: str, default: str | None = None) -> str:
    value = env.get(key, default)
    if value is None or value == "":
        raise ConfigError(f"{key} is not set")
    return value


def _float(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a number") from None
    if value <= 0:
        raise ConfigError(f"{key} must be positive (every wait is bounded), got {value}")
    return value


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw in (None, ""):
        if default is None:
            raise ConfigError(f"{key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer") from None


def from_env(env: Mapping[str, str] | None = None) -> EngineConfig:
    env = os.environ if env is None else env
    role = _get(env, "ENGINE_ROLE")
    if role not in ROLES:
        raise ConfigError(f"ENGINE_ROLE must be one of {ROLES}, got {role!r}")
    name = env.get("UNDERSTUDY_ENGINE_NAME") or f"engine-{role}"
    run_dir = Path(env.get("UNDERSTUDY_RUN_DIR", "/run/understudy"))
    adapter = env.get("UNDERSTUDY_ENGINE_ADAPTER", "reference")
    if adapter not in NAMES:
        raise ConfigError(f"UNDERSTUDY_ENGINE_ADAPTER must be one of {NAMES}, got {adapter!r}")
    devices_raw = env.get("UNDERSTUDY_DEVICES", "0")
    try:
        devices = tuple(int(d) for d in devices_raw.split(",") if d.strip())
    except ValueError:
        raise ConfigError(f"UNDERSTUDY_DEVICES={devices_raw!r}: expected 0,1,...") from None
    if not devices or len(set(devices)) != len(devices):
        raise ConfigError(f"UNDERSTUDY_DEVICES={devices_raw!r}: expected distinct indices")
    args_raw = env.get("UNDERSTUDY_ENGINE_ARGS", "[]")
    try:
        args = json.loads(args_raw)
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError
    except ValueError:
        raise ConfigError("UNDERSTUDY_ENGINE_ARGS must be a JSON list of strings") from None
    backend = env.get("UNDERSTUDY_GMS_BACKEND", "host")
    if backend not in ("host", "cuda"):
        raise ConfigError(f"UNDERSTUDY_GMS_BACKEND must be host or cuda, got {backend!r}")
    return EngineConfig(
        role=role,
        name=name,
        engine_id=f"{name}/{secrets.token_hex(4)}",
        run_dir=run_dir,
        lock_socket=Path(env.get("UNDERSTUDY_LOCK_SOCKET", str(run_dir / "lock.sock"))),
        gms_socket_dir=Path(env.get("UNDERSTUDY_GMS_SOCKET_DIR", str(run_dir / "gms"))),
        gms_backend=backend,
        devices=devices,
        adapter=adapter,
        model=env.get("UNDERSTUDY_MODEL") or DEFAULT_MODELS[EngineAdapter(adapter)],
        engine_args=tuple(args),
        status_port=_int(env, "UNDERSTUDY_STATUS_PORT", 8100),
        startup_budget_s=_float(env, "UNDERSTUDY_STARTUP_BUDGET_S", 600.0),
        wake_timeout_s=_float(env, "UNDERSTUDY_WAKE_TIMEOUT_S", 30.0),
        remap_timeout_s=_float(env, "UNDERSTUDY_REMAP_TIMEOUT_S", 30.0),
        lock_reconnect_s=_float(env, "UNDERSTUDY_LOCK_RECONNECT_S", 15.0),
        drain_s=_float(env, "UNDERSTUDY_DRAIN_S", 25.0),
    )
