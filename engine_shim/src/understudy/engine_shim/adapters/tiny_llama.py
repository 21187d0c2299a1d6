"""``builtin:tiny-llama``: a small Llama checkpoint made offline, from a seed.

`build` writes a Hugging Face model directory that transformers and vLLM load
as they load any Llama: ``config.json`` (``LlamaForCausalLM``),
``model.safetensors`` (float32), ``generation_config.json``, and a byte-level
BPE tokenizer trained here with ``tokenizers`` (``tokenizer.json``,
``tokenizer_config.json`` with BOS, EOS and a Llama-3-style chat template).
Nothing is downloaded; the same seed gives the same bytes on every run.

The tokenizer is trained on `corpus`: a few sentences of our own plus text
drawn from a fixed grammar by a fixed seed, so it does not change with the
model seed. The weights are uniform noise from numpy's Philox bit generator,
keyed by (seed, a hash of the tensor's name): numpy keeps bit generators
stable across releases, and floats are made here from the raw bits.

Random weights say nothing, but they must say it robustly: the engine is
compared token for token with vLLM and transformers, whose float32 kernels
sum in other orders (logits differ by ~1e-6 of their scale; 2e-5 to 4e-5
absolute here). A greedy step flips when its two best logits are closer than
that. The scales below keep such near-ties rare: attention scores near unit
scale (softmax does not amplify rounding), and output rows with heavy-tailed
norms (log-normal), which spread the top of the logits apart. With seed 0
the closest call in 4 x 128 greedy tokens is a gap of ~1e-4 of the largest
logit, a hundred times the noise (the tests/vllm output prints it). The
head's overall scale sets the entropy at temperature 1 (from ~0 to ~7 nats
by position), so seeded sampling has something to choose from. The special
tokens' output rows are zero, so a generation runs to ``max_tokens`` (or to
a stop id the request names) instead of ending at a random EOS.

`cached` keeps builds under ``$UNDERSTUDY_MODEL_CACHE`` (`model_cache`),
building on first use, once.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from understudy.engine_shim.adapters.llama_model import LlamaConfig
from understudy.engine_shim.adapters.model_cache import built_once

__all__ = [
    "BUILTIN",
    "CONFIG",
    "DEFAULT_SEED",
    "SPECIAL_TOKENS",
    "build",
    "cached",
    "corpus",
    "resolve",
]

BUILTIN: Final = "builtin:tiny-llama"
DEFAULT_SEED: Final = 0
# Part of the cache key: bump it whenever build() would write other bytes.
FORMAT: Final = 1

BOS, EOS, HEADER_START, HEADER_END, EOT = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
SPECIAL_TOKENS: Final = (BOS, EOS, HEADER_START, HEADER_END, EOT)  # ids 0..4
VOCAB_SIZE: Final = 2048

# Llama 3's chat format, short: BOS, then each message as a header and a body
# ended by <|eot_id|>, then an open assistant header to generate into.
CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

CONFIG: Final[Mapping[str, Any]] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": [1, 4],
    "pad_token_id": None,
    "torch_dtype": "float32",
    "use_cache": True,
}

# Standard deviation of each kind of weight (uniform noise). The residual
# stream is RMS-normalised before every use (RMS 1 over 256 components), so
# 1/16 keeps projections at unit scale; attention scores stay near unit scale
# too, so softmax does not amplify rounding. The head's rows are scaled on
# top, per row, by exp(HEAD_LOG_SPREAD * N(0, 1)) (module docstring).
INIT_STD: Final[Mapping[str, float]] = {
    "embed_tokens": 1.0,
    "q_proj": 1.5 / 16,
    "k_proj": 1.5 / 16,
    "v_proj": 1.0 / 16,
    "o_proj": 1.0 / 16,
    "gate_proj": 1.0 / 16,
    "up_proj": 1.0 / 16,
    "down_proj": 1.0 / math.sqrt(704),
    "lm_head": 0.25 / 16,
}
HEAD_LOG_SPREAD: Final = 1.0
NORM_JITTER: Final = 0.2  # norm weights in 1 ± 0.2, so a test notices one left out


# --- the tokenizer --------------------------------------------------------------

_OWN_TEXT: Final = (
    "An understudy learns the part so that the show goes on when the lead cannot.",
    "The primary engine serves; the shadow sleeps beside it and shares its weights.",
    "When the lock is granted, the shadow wakes, maps the memory and answers.",
    "Hello! How are you today? I am fine, thank you, and you?",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Numbers: 1, 2, 3, 10, 42, 100, 2048, 3.14159, -7, 1e-5, 50%.",
    "Tokens are ids; text is what a person reads. Greedy decoding takes the argmax.",
    "A café in Zürich serves crème brûlée; naïve résumé; Grüße aus Köln.",
    "東京と大阪。你好，世界。안녕하세요. Привет, мир! Γειά σου. مرحبا",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    '{"role": "user", "content": "Say hello."}',
    "user: what is the capital of France?\nassistant: Paris.",
)

_WORD_TEXT: Final = (
    "the of and to in is it you that he was for on are with as his they be at one "
    "have this from or had by word but what some we can out other were all there "
    "when up use your how said an each she which do their time if will way about "
    "many then them write would like so these her long make thing see him two has "
    "look more day could go come did number sound no most people my over know water "
    "than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say "
    "help low line differ turn cause much mean before move right boy old too same "
    "tell does set three want air well also play small end put home read hand port "
    "large spell add even land here must big high such follow act why ask men change "
    "went light kind off need house picture try us again animal point mother world "
    "near build self earth father head stand own page should country found answer "
    "school grow study still learn plant cover food sun four between state keep eye "
    "never last let thought city tree cross farm hard start might story saw far sea "
    "draw left late run while press close night real life few north open seem "
    "together next white children begin got walk example ease paper group always "
    "music those both mark often letter until mile river car feet care second book "
    "carry took science eat room friend began idea fish mountain stop once base hear "
    "horse cut sure watch color face wood main enough plain girl usual young ready "
    "above ever red list though feel talk bird soon body dog family direct pose leave "
    "song measure door product black short numeral class wind question happen "
    "complete ship area half rock order fire south problem piece told knew pass since "
    "top whole king space heard best hour better true during hundred five remember "
    "step early hold west ground interest reach fast verb sing listen six table "
    "travel less morning ten simple several vowel toward war lay against pattern slow "
    "center love person money serve appear road map rain rule govern pull cold notice "
    "voice unit power town fine certain fly fall lead cry dark machine note wait plan "
    "figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green oh quick develop ocean warm free "
    "minute strong special mind behind clear tail produce fact street inch multiply "
    "nothing course stay wheel full force blue object decide surface deep moon island "
    "foot system busy test record boat common gold possible plane stead dry wonder "
    "laugh thousand ago ran check game shape equate hot miss brought heat snow tire "
    "bring yes distant fill east paint language among engine shadow memory lock "
    "weights token model server primary kernel socket process failover"
)

_ONSETS: Final = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t")
_ONSETS_2: Final = ("v", "w", "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "sh", "st", "th")
_VOWELS: Final = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "oo")
_CODAS: Final = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x")


def corpus() -> list[str]:
    """The tokenizer's training text: ours, then ~5000 lines from a fixed grammar."""
    rnd = random.Random(20240611)  # fixed: the tokenizer does not follow the model seed
    syllable_sets = (_ONSETS + _ONSETS_2, _VOWELS, _CODAS)
    invented = sorted(
        {
            "".join(rnd.choice(part) for _ in range(rnd.randint(1, 3)) for part in syllable_sets)
            for _ in range(3000)
        }
    )
    common = _WORD_TEXT.split()
    lines = list(_OWN_TEXT)
    for n in range(5000):
        words = [
            rnd.choice(common) if rnd.random() < 0.6 else rnd.choice(invented)
            for _ in range(rnd.randint(4, 16))
        ]
        if n % 7 == 0:
            words.insert(rnd.randrange(len(words)), str(rnd.randint(0, 10 ** rnd.randint(1, 6))))
        text = " ".join(words)
        text = text[0].upper() + text[1:] + rnd.choice(".....!?;:")
        if n % 11 == 0:
            text = f"{rnd.choice(('user', 'assistant', 'system'))}: {text}"
        lines.append(text)
    return lines


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE (GPT-2/Llama 3 style) with the special tokens at ids 0..4 and
    BOS added in front of every encoded text, as Llama 3's tokenizer does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the corpus gave {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
    )
    return tok


# --- the weights ----------------------------------------------------------------


def _uniform(seed: int, name: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """Uniform in [-1, 1), a function of (seed, name, shape) alone."""
    stream = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    gen = np.random.Philox(key=np.array([seed % 2**64, stream], dtype=np.uint64))
    raw = gen.random_raw(math.prod(shape))
    # The top 24 bits are exact in float32: u in [0, 1) on a 2**-24 grid.
    u = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    return (u * np.float32(2.0) - np.float32(1.0)).reshape(shape)


def _normal_ish(seed: int, name: str, n: int) -> npt.NDArray[np.float64]:
    """n standard normal numbers from two uniforms each (Box-Muller), in float64."""
    u = (_uniform(seed, name, (2, n)).astype(np.float64) + 1.0) / 2.0
    out: npt.NDArray[np.float64] = np.sqrt(-2.0 * np.log1p(-u[0])) * np.cos(2.0 * np.pi * u[1])
    return out


def build_weights(seed: int, config: LlamaConfig | None = None) -> dict[str, npt.NDArray[Any]]:
    config = config or LlamaConfig.from_dict(CONFIG)
    out: dict[str, npt.NDArray[Any]] = {}
    sqrt3 = math.sqrt(3.0)  # uniform in [-a, a] has standard deviation a / sqrt(3)
    for name, shape in config.tensor_shapes().items():
        noise = _uniform(seed, name, shape)
        if name.endswith("norm.weight"):
            out[name] = np.float32(1.0) + np.float32(NORM_JITTER) * noise
            continue
        kind = name.split(".")[-2]
        out[name] = noise * np.float32(INIT_STD[kind] * sqrt3)
    head = out["lm_head.weight"]
    rows = np.exp(HEAD_LOG_SPREAD * _normal_ish(seed, "lm_head.row_scale", config.vocab_size))
    head *= rows.astype(np.float32)[:, None]
    head[: len(SPECIAL_TOKENS)] = 0.0
    return out


# --- the files ------------------------------------------------------------------


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def build(out: Path | str, seed: int = DEFAULT_SEED) -> Path:
    """Write the checkpoint into directory ``out`` (created if missing); returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(_json(tokenizer_config))
    (out / "special_tokens_map.json").write_text(_json({"bos_token": BOS, "eos_token": EOT}))
    (out / "config.json").write_text(_json(dict(CONFIG)))
    generation = {"bos_token_id": 0, "eos_token_id": [1, 4], "do_sample": False}
    (out / "generation_config.json").write_text(_json(generation))
    save_file(
        build_weights(seed),
        str(out / "model.safetensors"),
        # One key: safetensors writes the metadata map in hash order.
        metadata={"format": "pt"},
    )
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; a cache is shared
    return out


# --- the cache ------------------------------------------------------------------


def cached(seed: int = DEFAULT_SEED, root: Path | None = None) -> Path:
    """The checkpoint for ``seed`` under the model cache, built on first use
    (once, however many processes ask at once: `model_cache.built_once`)."""
    return built_once(f"tiny-llama-f{FORMAT}-s{seed}", lambda d: build(d, seed), root)


def resolve(model: str) -> Path:
    """``builtin:tiny-llama`` (seed 0) or ``builtin:tiny-llama:SEED``, built on first use."""
    if model == BUILTIN:
        return cached()
    raw = model.removeprefix(BUILTIN + ":")
    if not model.startswith(BUILTIN + ":") or not raw.isdigit():
        raise ValueError(f"model {model!r}: the seed must be a non-negative integer")
    return cached(int(raw))
