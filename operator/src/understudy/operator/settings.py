"""Operator settings: the frozen config of one run and kopf's settings for it.

Everything kopf persists on our objects carries the ``understudy.dev`` prefix:
the finalizer, the handler-progress annotations and the last-handled
configuration (kopf's diff base).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import kopf

from understudy.operator.render import PREFIX, RenderConfig

FINALIZER = f"{PREFIX}/finalizer"
# The timer interval is fixed when the handlers module is imported (kopf reads
# it at decoration time), hence the environment variable.
RESYNC_S = float(os.environ.get("UNDERSTUDY_OPERATOR_RESYNC_S", "10"))


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()
    clusterwide: bool = True
    render: RenderConfig = field(default_factory=RenderConfig)
    state_timeout_s: float = 0.5
    metrics_port: int | None = 8080
    health_port: int | None = 8081
    standalone: bool = True  # one replica; no kopf peering objects needed


def configure(settings: kopf.OperatorSettings, cfg: OperatorConfig) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.peering.standalone = cfg.standalone
    # We post our own Events for every transition; kopf's per-log-line Events
    # only for warnings and worse.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.batching.error_delays = (1, 2, 5, 10, 30, 60)
    # kopf keeps the finalizer until the resync timer's pass in flight exits.
    # By default it gives the pass ten loop cycles, then re-checks every 60 s:
    # an instance deleted during a pass stayed a minute (CI saw `kubectl delete
    # --timeout=60s` time out). A pass ends within a second or two; wait for it
    # in place, and re-check each second after a longer one.
    settings.background.instant_exit_timeout = 2.0
    settings.background.cancellation_polling = 1.0
