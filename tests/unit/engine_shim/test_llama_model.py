"""The numpy Llama: its pieces against their definitions, the whole forward pass
against an independent float64 implementation written the way Hugging Face's
modeling_llama is (repeat_kv, rotate_half on concatenated cos/sin), and the
properties the engine's determinism rests on. Agreement with transformers and
vLLM themselves is in tests/vllm/ (they need torch)."""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from understudy.engine_shim.adapters import llama_model
from understudy.engine_shim.adapters.llama_model import (
    LONG_SCORES,
    KVCache,
    LlamaConfig,
    LlamaModel,
    Prompt,
    Row,
    _by_weight_rows,
    _in_parts,
    apply_rope,
    parts_keep_bits,
    products_keep_rows,
    rms_norm,
    rope_tables,
    sample,
    silu,
    uniform,
)
from understudy.engine_shim.adapters.llama_text import ChatTokenizer
from understudy.engine_shim.adapters.packing import (
    WeightsError,
    pack_into,
    packed_size,
    views_from,
)

rng = np.random.default_rng(1234)


@pytest.fixture(scope="module")
def packed(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[mmap.mmap, list[Any]]:
    """The weights packed, then mapped read-only (PROT_READ), as a GMS reader sees them."""
    buf = bytearray(packed_size(tiny_llama_dir))
    records = pack_into(buf, tiny_llama_dir)
    path = tmp_path_factory.mktemp("packed") / "weights.bin"
    path.write_bytes(buf)
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), records


@pytest.fixture(scope="module")
def model(packed: tuple[mmap.mmap, list[Any]], tiny_llama_dir: Path) -> LlamaModel:
    buf, records = packed
    return LlamaModel(views_from(buf, records), LlamaConfig.from_dir(tiny_llama_dir))


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(tiny_llama_dir)


# --- pieces ------------------------------------------------------------------------


def test_rms_norm_is_the_definition() -> None:
    x = rng.standard_normal((3, 256)).astype(np.float32) * 3
    w = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * w
    assert np.abs(rms_norm(x, w, np.float32(1e-5)) - want).max() < 1e-5


def test_silu_is_x_sigmoid_x() -> None:
    x = np.linspace(-30, 30, 601, dtype=np.float32)
    want = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
    assert np.abs(silu(x) - want).max() < 1e-5


def test_rope_matches_rotate_half_and_encodes_relative_position() -> None:
    d, theta = 64, 10000.0
    cos, sin = rope_tables(d, theta, 2048)
    # HF: inv_freq = 1 / theta^(2i/d); emb = cat(freqs, freqs); q*cos + rotate_half(q)*sin
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    pos = np.array([0, 1, 7, 300, 2047])
    freqs = pos[:, None] * inv[None, :]
    cos2, sin2 = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs] * 2, -1))
    q = rng.standard_normal((len(pos), d)).astype(np.float32)
    q64 = q.astype(np.float64)
    rotate_half = np.concatenate([-q64[:, d // 2 :], q64[:, : d // 2]], -1)
    want = q64 * cos2 + rotate_half * sin2
    # float32 angles at position 2047 carry ~1e-4 rad of rounding, as HF's and vLLM's do
    assert np.abs(apply_rope(q, cos[pos], sin[pos]) - want).max() < 2e-3
    assert np.abs(apply_rope(q, cos[pos], sin[pos])[:4] - want[:4]).max() < 1e-5
    # a rotation: norms kept; q·k depends on the distance between positions only
    a, b = rng.standard_normal((2, 1, d)).astype(np.float32)

    def score(m: int, n: int) -> float:
        return float((apply_rope(a, cos[[m]], sin[[m]]) * apply_rope(b, cos[[n]], sin[[n]])).sum())

    assert score(5, 2) == pytest.approx(score(105, 102), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)
    assert np.linalg.norm(apply_rope(a, cos[[9]], sin[[9]])) == pytest.approx(np.linalg.norm(a))


# --- the whole model ----------------------------------------------------------------


def naive_forward(weights: dict[str, np.ndarray], c: LlamaConfig, ids: list[int]) -> np.ndarray:
    """modeling_llama, step by step, in float64 (no cache, full causal mask)."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    n, d = len(ids), c.head_dim

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return weight * (x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps))

    inv = 1.0 / c.rope_theta ** (np.arange(0, d, 2) / d)
    freqs = np.arange(n)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([freqs] * 2, -1)), np.sin(np.concatenate([freqs] * 2, -1))

    def rope(x: np.ndarray) -> np.ndarray:  # (heads, n, d)
        rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        h = norm(x, w[p + "input_layernorm.weight"])

        def heads(name: str, h: np.ndarray = h, p: str = p) -> np.ndarray:  # (heads, n, d)
            return (h @ w[p + name].T).reshape(n, -1, d).transpose(1, 0, 2)

        q, k, v = (
            heads("self_attn.q_proj.weight"),
            heads("self_attn.k_proj.weight"),
            heads("self_attn.v_proj.weight"),
        )
        q, k = rope(q), rope(k)
        rep = c.num_heads // c.num_kv_heads
        k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)  # repeat_kv
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        attn = (s @ v).transpose(1, 0, 2).reshape(n, c.num_heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("text", ["Hello, my name is", "東京と大阪 café", "x " * 150])
def test_forward_matches_an_independent_float64_llama(
    model: LlamaModel, tok: ChatTokenizer, text: str
) -> None:
    ids = tok.encode(text)
    want = naive_forward(dict(model.tensors), model.config, ids)
    got = model.forward(ids, KVCache(model.config, 1, 512), 0)
    assert got.dtype == np.float32 and got.shape == (len(ids), model.config.vocab_size)
    assert np.abs(got - want).max() < 1e-4


def test_decode_continues_the_cache_as_a_full_forward_would(
    model: LlamaModel, tok: ChatTokenizer
) -> None:
    ids = tok.encode("The shadow engine wakes when the lock is granted")
    full = model.forward(ids, KVCache(model.config, 1, 64), 0)
    cache = KVCache(model.config, 2, 64)
    model.prefill(ids[:3], cache, 1)
    steps = [model.decode([Row(1, p, ids[p])], cache)[0] for p in range(3, len(ids))]
    assert np.abs(np.stack(steps) - full[3:]).max() < 1e-4
    # several rows of one sequence in one call = one row per call, bit for bit
    cache2 = KVCache(model.config, 2, 64)
    model.prefill(ids[:3], cache2, 0)
    rows = model.decode([Row(0, p, ids[p]) for p in range(3, len(ids))], cache2)
    assert np.array_equal(rows, np.stack(steps))


def test_a_decode_row_does_not_depend_on_the_rows_beside_it(
    model: LlamaModel, tok: ChatTokenizer
) -> None:
    """Up to 11 rows: several products of `DECODE_ROWS` and a padded one."""
    words = ("alpha beta", "one two three four", "x", "café 東京", "la", "mi re do", "q")
    prompts = [tok.encode(t) for t in (*words, "ab cd", "ef", "gh ij kl", "mn")]
    cache = KVCache(model.config, len(prompts), 64)
    for slot, ids in enumerate(prompts):
        model.prefill(ids, cache, slot)
    rows = [Row(slot, len(ids), 7 + slot) for slot, ids in enumerate(prompts)]
    together = model.decode(rows, cache)
    for i, row in enumerate(rows):  # the same rows again, each alone (same cache positions)
        assert np.array_equal(model.decode([row], cache)[0], together[i])
    assert np.array_equal(model.decode(rows[::-1], cache), together[::-1])
    for n in (3, 5, 9):
        assert np.array_equal(model.decode(rows[-n:], cache), together[-n:])


def test_long_rows_score_by_vector_products_as_a_full_forward_would(
    model: LlamaModel,
) -> None:
    """From LONG_SCORES positions a decode row's scores are vector products:
    still the forward's numbers, and still a function of the row's own
    sequence, beside a short row or alone."""
    n = LONG_SCORES + 3
    ids = [int(i) for i in np.random.default_rng(3).integers(3, model.config.vocab_size, n)]
    full = model.forward(ids, KVCache(model.config, 1, n), 0)
    cache = KVCache(model.config, 2, n)
    start = LONG_SCORES - 3
    model.prefill(ids[:start], cache, 0)
    model.prefill(ids[:5], cache, 1)
    steps = []
    for p in range(start, n):  # across the switch: matrix products, then vector ones
        together = model.decode([Row(0, p, ids[p]), Row(1, 5, 9)], cache)
        alone = model.decode([Row(0, p, ids[p])], cache)[0]
        assert np.array_equal(alone, together[0])
        steps.append(alone)
    assert np.abs(np.stack(steps) - full[start:]).max() < 1e-4


def test_a_decode_computes_alike_through_the_kernels_and_numpy(
    model: LlamaModel, packed: tuple[mmap.mmap, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C kernels (where built) and numpy's forms give the same logits, up
    to float32's rounding, short rows and long ones (the tiny model's heads
    are 64 wide, one of the attention kernel's shapes)."""
    if model.decode_attention is None:
        pytest.skip("the package was installed without its C kernels (no compiler)")
    monkeypatch.setattr(llama_model.decode_kernels, "kernels", None)
    buf, records = packed
    numpy_form = LlamaModel(views_from(buf, records), model.config)
    assert numpy_form.decode_attention is None and not numpy_form.native_products
    n = LONG_SCORES + 40
    ids = [int(i) for i in np.random.default_rng(5).integers(3, model.config.vocab_size, n)]
    caches = [KVCache(model.config, 1, n) for _ in range(2)]
    for m, cache in zip((model, numpy_form), caches, strict=True):
        m.prefill(ids[:8], cache, 0)
    for p in (*range(8, 64), *range(LONG_SCORES - 2, n)):
        if p == LONG_SCORES - 2:  # the positions between, by prefill
            for m, cache in zip((model, numpy_form), caches, strict=True):
                m.prefill_chunks(ids[:p], cache, 0, 64, 64)
        got, want = (
            m.decode([Row(0, p, ids[p])], c)
            for m, c in zip((model, numpy_form), caches, strict=True)
        )
        assert np.abs(got - want).max() < 1e-4, p


@pytest.mark.parametrize(
    "shape",
    [
        *[(256, 256), (704, 256), (256, 704), (576, 576), (1536, 576), (576, 1536), (5000, 576)],
        *[(1001, 576), (5, 256)],  # rows left over after the whole groups; no whole group
    ],
)
def test_decode_products_keep_a_rows_bits_in_any_step(shape: tuple[int, int]) -> None:
    """What `products_keep_rows` promises, on other numbers: in `_by_weight_rows`,
    a row is the same bits alone and at any place of a step of up to 19
    rows (three groups). SmolLM2's shapes, widths of other models, and
    weights whose rows make no whole number of `WEIGHT_ROWS` groups."""
    w = rng.standard_normal(shape, dtype=np.float32)
    if not products_keep_rows([w]):
        pytest.skip(f"this BLAS's products of {shape} give a row other bits by its place")
    x = rng.standard_normal(shape[1], dtype=np.float32)
    alone = _by_weight_rows(x[None], w)[0]
    assert np.abs(alone - w @ x).max() < 1e-3  # the product itself
    for m in range(2, 20):
        rows = rng.standard_normal((m, shape[1]), dtype=np.float32)
        place = int(rng.integers(m))
        rows[place] = x
        assert np.array_equal(_by_weight_rows(rows, w)[place], alone), (m, place)


def test_a_batched_prefill_is_each_prompt_run_alone_bit_for_bit(
    model: LlamaModel, tok: ChatTokenizer
) -> None:
    """Prompts of 1 to 3 chunks, of 1 to 16 rows each, three of
    them continued from a chunk boundary of a cache filled before: every
    logit and every key and value written is what `prefill_chunks` gives each
    prompt alone."""
    chunk = 16
    text = " ".join(f"word{i}" for i in range(60))
    ids = tok.encode(text)
    lengths, starts = [1, 3, 7, 15, 16, 20, 40, 41], [0, 0, 0, 0, 0, 16, 16, 32]
    assert model.batch_parts(chunk)  # else this is prompts one after another
    prompts = [Prompt(ids[i : i + n], slot, s) for slot, (i, n, s) in enumerate(
        zip(range(0, 80, 10), lengths, starts, strict=True))]  # fmt: skip
    alone, batched = (KVCache(model.config, len(prompts), 64) for _ in range(2))
    for cache in (alone, batched):  # the continued prompts' earlier chunks
        for p in prompts:
            if p.start:
                model.prefill_chunks(p.tokens[: p.start], cache, p.slot, 0, chunk)
    want = [model.prefill_chunks(p.tokens, alone, p.slot, p.start, chunk) for p in prompts]
    calls: list[None] = []
    got = model.prefill_batch(prompts, batched, chunk, lambda: calls.append(None))
    assert len(calls) == 2  # a round per chunk of the most computed (40 from 16)
    for w, g in zip(want, got, strict=True):
        assert np.array_equal(w, g)
    assert np.array_equal(alone.k, batched.k) and np.array_equal(alone.v, batched.v)
    # the same prompts in another order: the same bits again
    again = KVCache(model.config, len(prompts), 64)
    for p in prompts:
        if p.start:
            model.prefill_chunks(p.tokens[: p.start], again, p.slot, 0, chunk)
    for w, g in zip(want[::-1], model.prefill_batch(prompts[::-1], again, chunk), strict=True):
        assert np.array_equal(w, g)
    with pytest.raises(ValueError, match="chunk boundary"):
        model.prefill_batch([Prompt(ids[:20], 0, 5)], batched, chunk)


@pytest.mark.parametrize("shape", [(256, 256), (64, 256), (1536, 576), (576, 1536)])
def test_where_parts_keep_their_bits_a_chunk_is_the_same_bits_at_any_place(
    shape: tuple[int, int],
) -> None:
    """What the probe promises, checked on other numbers and places: a part of
    any size up to the chunk, anywhere among others, is the same bits as
    alone. (Stacked into one product, rows here differ from their bits alone:
    the module docstring.)"""
    w = rng.standard_normal(shape, dtype=np.float32)
    chunk = 24
    assert parts_keep_bits([w], chunk)
    for m in range(1, chunk + 1):
        x = rng.standard_normal((m, shape[1]), dtype=np.float32)
        before, after = (rng.standard_normal((n, shape[1]), dtype=np.float32) for n in (m, 3))
        rows = np.concatenate([before, x, after])
        parts = [(0, m), (m, 2 * m), (2 * m, 2 * m + 3)]
        alone = x @ w.T
        assert np.array_equal(_in_parts(rows, w, parts)[m : 2 * m], alone), m


def test_the_model_reads_the_callers_memory_and_never_copies(
    model: LlamaModel, packed: tuple[mmap.mmap, list[Any]]
) -> None:
    buf, _ = packed
    base = np.frombuffer(buf, dtype=np.uint8)
    for name, array in model.tensors.items():
        assert np.shares_memory(array, base), name
        assert not array.flags.writeable, name


def _resident(array: np.ndarray) -> int:
    """Bytes resident in the mappings that hold ``array``'s data (/proc/self/smaps).

    Every mapping the data overlaps: the allocator's header page and the
    memory advised for huge pages can be separate mappings of one array."""
    first = array.__array_interface__["data"][0]
    last = first + array.nbytes
    inside, total, found = False, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < last and first < end
            found = found or inside
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    assert found, "no mapping holds the array"
    return total


def test_an_engines_own_cache_backs_only_the_pages_it_writes(tiny_llama_dir: Path) -> None:
    """One position of each layer's head, in a cache whose heads are 2 MiB
    each (8,192 positions of 64 floats): a page each, not a huge page each
    (numpy's np.zeros asks for those; llama_model.lazy_zeros)."""
    c = LlamaConfig.from_dir(tiny_llama_dir)
    cache = KVCache(c, 2, 8192)
    assert not cache.k.any()
    cache.k[:, :, :, 0] = 1.0
    heads = c.num_layers * 2 * c.num_kv_heads
    assert _resident(cache.k) <= heads * 2 * 4096, (_resident(cache.k), heads)
    assert cache.k[:, :, :, 0].all() and not cache.k[:, :, :, 1].any()


def test_refuses_what_it_does_not_compute(tiny_llama_dir: Path) -> None:
    import json

    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert LlamaConfig.from_dict(cfg).head_dim == 64
    assert LlamaConfig.from_dict(
        {**cfg, "rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    ).rope_theta == pytest.approx(5e5)
    for change, message in [
        ({"hidden_act": "gelu"}, "activation"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE"),
        ({"attention_bias": True}, "biases"),
        ({"model_type": "mistral"}, "Llama"),
        ({"num_key_value_heads": 3}, "KV groups"),
    ]:
        with pytest.raises(WeightsError, match=message):
            LlamaConfig.from_dict({**cfg, **change})


def test_missing_or_misshapen_tensors_are_named(model: LlamaModel) -> None:
    weights = dict(model.tensors)
    del weights["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(WeightsError, match=r"layers\.2\.mlp\.up_proj"):
        LlamaModel(weights, model.config)
    weights = dict(model.tensors)
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.float64)
    with pytest.raises(WeightsError, match=r"model\.norm\.weight"):
        LlamaModel(weights, model.config)


def test_bad_ids_and_positions_are_refused(model: LlamaModel) -> None:
    cache = KVCache(model.config, 1, 16)
    with pytest.raises(ValueError, match="out of range"):
        model.prefill([0, model.config.vocab_size], cache, 0)
    with pytest.raises(ValueError, match="non-empty"):
        model.prefill([], cache, 0)
    with pytest.raises(ValueError, match="exceed"):
        model.prefill([5] * 17, cache, 0)
    with pytest.raises(ValueError, match="position"):
        model.decode([Row(0, 16, 5)], cache)


# --- sampling ----------------------------------------------------------------------


def test_uniform_depends_on_seed_and_position_only() -> None:
    values = [uniform(s, p) for s in (0, 1, 2**63 + 5) for p in range(50)]
    assert all(0.0 <= u < 1.0 for u in values)
    assert len(set(values)) == len(values)
    assert uniform(42, 17) == uniform(42, 17)
    assert uniform(-1, 3) == uniform(2**64 - 1, 3)  # seeds are taken mod 2**64


def test_greedy_is_the_argmax_and_ties_go_to_the_lowest_id() -> None:
    logits = np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)
    assert sample(logits, 0.0) == 1


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    draws = [sample(logits, 1.0, 1.0, seed=9, position=p) for p in range(4000)]
    assert draws == [sample(logits, 1.0, 1.0, seed=9, position=p) for p in range(4000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.abs(freq - [0.5, 0.3, 0.15, 0.05]).max() < 0.03
    assert draws != [sample(logits, 1.0, 1.0, seed=10, position=p) for p in range(4000)]


def test_top_p_keeps_the_smallest_nucleus_and_temperature_sharpens() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    kept = {sample(logits, 1.0, 0.7, seed=1, position=p) for p in range(2000)}
    assert kept == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert {sample(logits, 1.0, 0.01, seed=1, position=p) for p in range(200)} == {0}
    cold = [sample(logits, 0.05, 1.0, seed=3, position=p) for p in range(500)]
    assert cold.count(0) > 495


@pytest.mark.parametrize("kernel", ["native", "products", "rows"])
def test_decode_in_weight_blocks_keeps_rows_independent_and_exact(
    model: LlamaModel, tok: ChatTokenizer, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """Every way a decode multiplies (in C, in products per group of weight
    rows, or row by row over blocks of a weight's rows where a BLAS gives no
    products that keep a row's bits; the output head of a real model is many
    blocks): a row still does not depend on the rows beside it, and the
    logits are the full forward's."""
    monkeypatch.setattr(llama_model, "ROWWISE_BLOCK_BYTES", 100 * 256 * 4)  # 100 rows a block
    if kernel == "native":
        if not model.native_products:
            pytest.skip("no C kernels here, or a CPU without AVX2 and FMA")
    else:
        monkeypatch.setattr(llama_model.decode_kernels, "kernels", None)
    if kernel == "rows":
        monkeypatch.setattr(llama_model, "products_keep_rows", lambda weights: False)
    model = LlamaModel(model.tensors, model.config)
    assert model.native_products == (kernel == "native")
    assert model.decode_products == (kernel != "rows")
    prompts = [tok.encode(t) for t in ("alpha beta", "one two three four", "x")]
    cache = KVCache(model.config, len(prompts), 64)
    for slot, ids in enumerate(prompts):
        model.prefill(ids, cache, slot)
    rows = [Row(slot, len(ids), 7 + slot) for slot, ids in enumerate(prompts)]
    together = model.decode(rows, cache)
    for i, row in enumerate(rows):
        assert np.array_equal(model.decode([row], cache)[0], together[i])
    full = model.forward([*prompts[1], 8], KVCache(model.config, 1, 64), 0)
    assert np.abs(together[1] - full[-1]).max() < 1e-4


def test_a_prompt_continued_from_any_chunk_start_is_the_same_bits(
    model: LlamaModel, tok: ChatTokenizer
) -> None:
    """On the grid from 4 (`chunks`: 0, 4, 8, 16, 32, 48): a prompt computed
    from 0, and the same prompt continued from each later chunk start of a
    cache that holds the positions before it, give the same logits and write
    the same keys and values; a multiple of 4 that is no chunk start is
    refused."""
    ids = tok.encode(" ".join(f"word{i}" for i in range(40)))[:60]
    whole = KVCache(model.config, 1, 64)
    want = model.prefill_chunks(ids, whole, 0, 0, 4)
    for start in (4, 8, 16, 32, 48):
        cache = KVCache(model.config, 1, 64)
        model.prefill_chunks(ids[:start], cache, 0, 0, 4)
        assert np.array_equal(model.prefill_chunks(ids, cache, 0, start, 4), want), start
        assert np.array_equal(cache.k, whole.k) and np.array_equal(cache.v, whole.v), start
    with pytest.raises(ValueError, match="chunk boundary"):
        model.prefill_chunks(ids, KVCache(model.config, 1, 64), 0, 24, 4)
