"""``understudy operator run|crd`` and ``understudy render -f gpuinstance.yaml``.

Thin: parse arguments, build one frozen config, call one function; the
decisions live in the modules it calls. kopf is imported only by
``operator run``; ``render`` and ``crd`` are pure and fast. Also runnable as
``python -m understudy.operator.cli``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import yaml

DEFAULT_IMAGE = os.environ.get("UNDERSTUDY_IMAGE", "localhost/understudy:dev")


def add_commands(subparsers: Any) -> None:
    op = subparsers.add_parser("operator", help="the GpuInstance operator")
    opsub = op.add_subparsers(dest="operator_command", metavar="COMMAND", required=True)

    run = opsub.add_parser("run", help="run the operator (kopf) against the current cluster")
    run.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable); default: all",
    )
    run.add_argument(
        "--image", default=DEFAULT_IMAGE, help="component image for sidecars and default engines"
    )
    run.add_argument(
        "--image-pull-policy",
        default=os.environ.get("UNDERSTUDY_IMAGE_PULL_POLICY", "IfNotPresent"),
    )
    run.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics (0: off)")
    run.add_argument(
        "--health-port", type=int, default=8081, help="kopf liveness /healthz (0: off)"
    )
    run.add_argument(
        "--state-timeout", type=float, default=0.5, help="seconds to wait for an engine's /state"
    )
    run.add_argument("--log-level", default=os.environ.get("UNDERSTUDY_LOG_LEVEL", "INFO"))
    run.set_defaults(func=_run)

    crd = opsub.add_parser("crd", help="print the GpuInstance CRD generated from the API models")
    crd.set_defaults(func=_crd)

    render = subparsers.add_parser("render", help="print the objects the operator would create")
    render.add_argument(
        "-f", "--filename", required=True, help="a GpuInstance YAML file ('-': stdin)"
    )
    render.add_argument("--image", default=DEFAULT_IMAGE)
    render.set_defaults(func=_render)


def _run(args: argparse.Namespace) -> int:
    import asyncio

    import kopf

    from understudy.operator import handlers  # noqa: F401  (registers the handlers)
    from understudy.operator.render import RenderConfig
    from understudy.operator.settings import OperatorConfig
    from understudy.wire.obs import setup_logging, start_metrics_server

    setup_logging(args.log_level)
    cfg = OperatorConfig(
        namespaces=tuple(args.namespace),
        clusterwide=not args.namespace,
        render=RenderConfig(image=args.image, image_pull_policy=args.image_pull_policy),
        state_timeout_s=args.state_timeout,
        metrics_port=args.metrics_port or None,
        health_port=args.health_port or None,
    )
    start_metrics_server(cfg.metrics_port)
    liveness = f"http://0.0.0.0:{cfg.health_port}/healthz" if cfg.health_port else None
    asyncio.run(
        kopf.operator(
            clusterwide=cfg.clusterwide,
            namespaces=list(cfg.namespaces),
            standalone=cfg.standalone,
            liveness_endpoint=liveness,
            memo=kopf.Memo(config=cfg),
        )
    )
    return 0


def _crd(args: argparse.Namespace) -> int:
    from understudy.operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _render(args: argparse.Namespace) -> int:
    from understudy.operator.api import GpuInstance
    from understudy.operator.render import RenderConfig, render_all

    if args.filename == "-":
        docs = list(yaml.safe_load_all(sys.stdin))
    else:
        with open(args.filename, encoding="utf-8") as fh:
            docs = list(yaml.safe_load_all(fh))
    out: list[dict[str, Any]] = []
    for doc in docs:
        if not doc or doc.get("kind") != "GpuInstance":
            continue
        meta = dict(doc.get("metadata") or {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", "00000000-0000-0000-0000-000000000000")
        inst = GpuInstance.from_body({**doc, "metadata": meta})
        out.extend(render_all(inst, RenderConfig(image=args.image)))
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="understudy")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_commands(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
