"""Observability plumbing shared by the daemons: log lines and metrics.

Every state transition becomes one log line (``event=... key=value``) and a
metric, so every change can be seen from outside the process. Metric objects
live with each component; this module only configures logging and serves
``/metrics``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def setup_logging(level: str | None = None) -> None:
    """Line-oriented logs on stderr, level from ``UNDERSTUDY_LOG_LEVEL``."""
    chosen = level or os.environ.get("UNDERSTUDY_LOG_LEVEL", "INFO")
    logging.basicConfig(level=chosen.upper(), format=_FORMAT, stream=sys.stderr, force=True)


def _quote(value: object) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "='):
        return '"' + text.replace('"', '\\"') + '"'
    return text


def fmt(event: str, fields: Mapping[str, object]) -> str:
    """``event=grant engine_id=a epoch=3``: greppable and machine-parsable."""
    parts = [f"event={event}"]
    parts.extend(f"{k}={_quote(v)}" for k, v in fields.items() if v is not None)
    return " ".join(parts)


def log_event(
    logger: logging.Logger, event: str, level: int = logging.INFO, **fields: object
) -> None:
    logger.log(level, fmt(event, fields))


def start_metrics_server(port: int | None, addr: str = "0.0.0.0") -> None:
    """Serve the default registry on ``port`` (no-op when None)."""
    if port is not None:
        # Imported here: a process that only logs (the respawner, a
        # container's init) does not pay for the client.
        import prometheus_client

        prometheus_client.start_http_server(port, addr=addr)
