"""``understudy engine run``: what an engine container runs; ``understudy model``:
the engines' built-in models.

``engine run`` exit codes: 1 fatal (init error, failed remap, bind failure),
2 bad configuration, 3 lock lost, 4 GMS connection lost, 5 wake timeout,
6 startup budget exceeded.

``model build-llama --out DIR [--seed N]`` writes the tiny Llama checkpoint
(``builtin:tiny-llama``; see ``adapters.tiny_llama``) into DIR.
"""

from __future__ import annotations

import argparse
import os
import sys


def cmd_engine_run(args: argparse.Namespace) -> int:
    # Fix BLAS threading before numpy loads: one thread keeps the summation
    # order (and so every answer) identical across processes and nodes.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from understudy.engine_shim.config import ConfigError, from_env
    from understudy.wire.obs import setup_logging

    setup_logging()
    try:
        cfg = from_env()
    except ConfigError as exc:
        print(f"understudy engine: bad configuration: {exc}", file=sys.stderr)
        return 2
    from understudy.engine_shim.adapters.base import AdapterError, Engine
    from understudy.engine_shim.mainloop import Shim

    engine: Engine
    try:
        if cfg.adapter == "reference":
            from understudy.engine_shim.adapters.reference import ReferenceEngine

            engine = ReferenceEngine(cfg.model)
        elif cfg.adapter == "llama":
            from understudy.engine_shim.adapters.llama import LlamaEngine

            engine = LlamaEngine(cfg.model, cfg.engine_args)
        else:
            from understudy.engine_shim.adapters.synthetic import SyntheticEngine

            engine = SyntheticEngine(cfg.model, cfg.engine_args, cfg.devices)
    except (AdapterError, RuntimeError) as exc:
        # One line, not a traceback: it is what `local up` and
        # `kubectl logs --previous` show a user.
        print(f"understudy engine: {cfg.adapter}: {exc}", file=sys.stderr)
        return 1
    Shim(cfg, engine).run()
    return 0


def cmd_model_build_llama(args: argparse.Namespace) -> int:
    from understudy.engine_shim.adapters.tiny_llama import build

    print(build(args.out, args.seed))
    return 0


def _seed(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise argparse.ArgumentTypeError("the seed must be a non-negative integer")
    return value


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    engine = sub.add_parser("engine", help="an engine under the shim (configured by environment)")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="COMMAND")
    run = engine_sub.add_parser("run", help="run the engine: init, sleep, acquire, wake, serve")
    run.set_defaults(func=cmd_engine_run)
    model = sub.add_parser("model", help="the engines' built-in models")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    build = model_sub.add_parser(
        "build-llama",
        help="write the tiny Llama test checkpoint (builtin:tiny-llama), offline, from a seed",
    )
    build.add_argument("--out", required=True, help="directory to write (created if missing)")
    build.add_argument("--seed", type=_seed, default=0, help="weights seed (default 0)")
    build.set_defaults(func=cmd_model_build_llama)
