"""Text to token ids and back for a Hugging Face causal LM directory.

`ChatTokenizer` reads ``tokenizer.json`` (a fast tokenizer: its post-processor
adds BOS), ``tokenizer_config.json`` (BOS/EOS names and the Jinja chat
template) and ``generation_config.json`` (the ids that end a generation), and
gives the ids that transformers' ``AutoTokenizer`` and vLLM give:

* ``encode(text)``: ``tokenizer(text)``, special tokens added;
* ``encode_chat(messages)``: ``apply_chat_template(messages,
  add_generation_prompt=True)``: the template rendered in a sandbox with
  transformers' settings (``trim_blocks``, ``lstrip_blocks``), then encoded
  without adding special tokens (the template writes BOS itself);
* ``decode(ids)``: special tokens skipped, no clean-up of spaces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from understudy.engine_shim.adapters.packing import WeightsError

__all__ = ["ChatTokenizer"]


def _raise(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _token_name(entry: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an
    # AddedToken dict {"content": ...}.
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


class ChatTokenizer:
    def __init__(self, model_dir: Path | str) -> None:
        d = Path(model_dir)
        self.tokenizer: Final = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        self.bos_token: Final = _token_name(cfg.get("bos_token"))
        self.eos_token: Final = _token_name(cfg.get("eos_token"))
        stop: set[int] = set()
        if self.eos_token is not None:
            eos_id = self.tokenizer.token_to_id(self.eos_token)
            if eos_id is None:
                raise WeightsError(f"eos_token {self.eos_token!r} is not in the vocabulary")
            stop.add(eos_id)
        for name in ("generation_config.json", "config.json"):
            if (d / name).is_file():
                stop |= _ids(json.loads((d / name).read_text()).get("eos_token_id"))
        self.eos_ids: Final = frozenset(stop)
        """Ids that end a generation: the tokenizer's EOS and generation_config's."""
        source = cfg.get("chat_template")
        if source is None and (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text()
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source) if isinstance(source, str) else None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        if self._template is None:
            raise WeightsError("this model has no chat template")
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        rendered = self.render_chat(messages)
        return list(self.tokenizer.encode(rendered, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
