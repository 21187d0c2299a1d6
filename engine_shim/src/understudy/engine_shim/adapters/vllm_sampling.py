"""Position-seeded sampling inside vLLM: a continued seeded stream equals the
unbroken one.

vLLM samples a seeded request from one ``torch.Generator`` per request,
seeded once and advanced by every draw (a draw over the whole vocabulary
per step). An engine that continues a migrated stream would have to replay
exactly the draws the dead engine made, which depend on vLLM's sampler
internals (the top-k/top-p path, its batch shapes). Instead, the adapter
takes the seed away from vLLM and gives it to this logits processor, which
picks the token of position ``p`` (0 = the request's first generated token)
with the ``llama`` engine's own sampler, ``llama_model.sample``: the inverse
CDF of softmax(logits / temperature), cut to the top-p nucleus, at a number
drawn from ``(seed, p)`` alone. It then leaves that token as the only finite
logit, so vLLM's sampler, whatever generator it uses, can only pick it. The
token at position ``p`` therefore depends on the logits there and on
``(seed, p)``, never on how many draws came before or on which engine made
them: the determinism ``generation`` promises, for ``vllm`` as for ``llama``.

The request carries what the processor needs in ``SamplingParams.extra_args``
(`extra_args`): the seed, and the position of the first token this engine
generates (the ids a continuation resumes from were generated elsewhere).

vLLM loads the processor by its name (``CLASS``) in the process that runs
the model, so this module imports vLLM at the top and is imported only by
vLLM; the adapter names it in the engine's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch
from vllm import SamplingParams as VllmParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from understudy.engine_shim.adapters.llama_model import sample

CLASS: Final = "understudy.engine_shim.adapters.vllm_sampling:PositionSeeded"
SEED: Final = "understudy_seed"
FIRST: Final = "understudy_first_position"
GREEDY_BELOW: Final = 1e-5  # vLLM's own threshold: below it, a request is greedy


def extra_args(seed: int | None, temperature: float, first_position: int) -> dict[str, int]:
    """What a request's ``extra_args`` carry for this processor (empty: vLLM samples)."""
    if seed is None or temperature < GREEDY_BELOW:
        return {}
    return {SEED: seed, FIRST: first_position}


@dataclass(frozen=True, slots=True)
class _Seeded:
    seed: int
    first: int
    temperature: float
    top_p: float
    output: list[int]  # vLLM's running list of this request's generated ids (a reference)

    @property
    def position(self) -> int:
        return self.first + len(self.output)


def _seeded(params: VllmParams, _prompt: list[int] | None, output: list[int]) -> _Seeded | None:
    extra = params.extra_args or {}
    if SEED not in extra:
        return None
    return _Seeded(
        int(extra[SEED]), int(extra[FIRST]), float(params.temperature), float(params.top_p), output
    )


class PositionSeeded(LogitsProcessor):  # type: ignore[misc]
    """Samples the requests that carry a seed; leaves the others to vLLM."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Seeded] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _seeded)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, row in self.rows.items():
            values = logits[index].detach().to("cpu", torch.float32).numpy()
            token = sample(values, row.temperature, row.top_p, row.seed, row.position)
            logits[index].fill_(float("-inf"))
            logits[index, token] = 0.0
        return logits
