"""The numpy all-MiniLM-L6-v2: weight packing, zero-copy views, and agreement
with the model's reference implementation (tests/data/minilm_reference.json,
made by hack/gen_minilm_reference.py with torch + sentence-transformers)."""

from __future__ import annotations

import json
import math
import mmap
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from understudy.engine_shim.adapters.minilm import (
    ALIGNMENT,
    MiniLM,
    MiniLMConfig,
    TensorRecord,
    WeightsError,
    default_model_dir,
    erf,
    pack_into,
    packed_size,
    views_from,
    weights_manifest,
)

REPO = Path(__file__).resolve().parents[3]
REFERENCE = REPO / "tests/data/minilm_reference.json"
TOLERANCE = 1e-4  # max abs difference per component, as agreed for the engine
# What this implementation actually achieves is ~2e-7 (float32 rounding). A
# real mistake (tanh GELU, a wrong eps, a masking slip) costs more than 1e-5,
# so hold the line there too; BLAS differences across CPUs are ~1e-7.
ACHIEVED = 1e-5


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def packed(model_dir: Path) -> Iterator[tuple[mmap.mmap, list[TensorRecord]]]:
    """An anonymous shared mapping, as a GMS export would be, with the weights packed in."""
    buf = mmap.mmap(-1, packed_size(model_dir))
    records = pack_into(buf, model_dir)
    yield buf, records
    # Views into it may outlive the module (pytest keeps tracebacks); don't force close.


@pytest.fixture(scope="module")
def model(packed: tuple[mmap.mmap, list[TensorRecord]], model_dir: Path) -> MiniLM:
    buf, records = packed
    return MiniLM.from_buffer(buf, records, model_dir)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(REFERENCE.read_text())
    return doc


# --- layout ---------------------------------------------------------------------


def test_manifest_matches_safetensors(model_dir: Path) -> None:
    specs = weights_manifest(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        keys = sorted(f.keys())
        assert [s.name for s in specs] == keys
        for s in specs:
            t = f.get_tensor(s.name)
            assert (s.dtype, s.shape, s.nbytes) == (t.dtype.name, t.shape, t.nbytes)


def test_layout_is_aligned_disjoint_and_json_ready(
    packed: tuple[mmap.mmap, list[TensorRecord]], model_dir: Path
) -> None:
    buf, records = packed
    assert json.loads(json.dumps(records)) == records
    assert [r["name"] for r in records] == sorted(r["name"] for r in records)
    end = 0
    for r in records:
        assert r["offset"] % ALIGNMENT == 0
        assert r["offset"] >= end
        end = r["offset"] + r["nbytes"]
    assert end == packed_size(model_dir) == len(buf)
    assert end - sum(r["nbytes"] for r in records) < ALIGNMENT * len(records)


def test_pack_unpack_round_trip_is_exact(
    packed: tuple[mmap.mmap, list[TensorRecord]], model_dir: Path
) -> None:
    buf, records = packed
    views = views_from(buf, records)
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        assert views.keys() == set(f.keys())
        for name, view in views.items():
            original = f.get_tensor(name)
            assert view.dtype == original.dtype and view.shape == original.shape
            assert view.tobytes() == original.tobytes(), name
    # The gaps between tensors are zeroed: the buffer's bytes depend only on the file.
    raw = np.frombuffer(buf, dtype=np.uint8)
    covered = np.zeros(len(raw), dtype=bool)
    for r in records:
        covered[r["offset"] : r["offset"] + r["nbytes"]] = True
    assert not raw[~covered].any()


def test_pack_into_refuses_a_small_or_read_only_buffer(model_dir: Path) -> None:
    size = packed_size(model_dir)
    with pytest.raises(WeightsError, match="need"):
        pack_into(bytearray(size - 1), model_dir)
    with pytest.raises(WeightsError, match="read-only"):
        pack_into(bytes(size), model_dir)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("offset", 4, "unaligned"),
        ("offset", 1 << 40, "out of the buffer"),
        ("nbytes", 8, "do not match"),
        ("dtype", "complex64", "unsupported"),
    ],
)
def test_views_from_rejects_bad_records(
    packed: tuple[mmap.mmap, list[TensorRecord]], field: str, value: object, message: str
) -> None:
    buf, records = packed
    bad: Any = dict(records[0])
    bad[field] = value
    with pytest.raises(WeightsError, match=message):
        views_from(buf, [bad])


# --- zero copy ------------------------------------------------------------------


def test_model_arrays_share_the_packed_buffer(
    model: MiniLM, packed: tuple[mmap.mmap, list[TensorRecord]]
) -> None:
    buf, records = packed
    whole = np.frombuffer(buf, dtype=np.uint8)
    by_name = {r["name"]: r for r in records}
    assert len(model.tensors) == 5 + 16 * model.config.num_layers
    for name, array in model.tensors.items():
        assert np.shares_memory(array, whole), name
        assert not array.flags.writeable
        assert not array.flags.owndata
        start = array.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
        assert start == by_name[name]["offset"]


def test_model_sees_writes_to_the_shared_buffer(model_dir: Path) -> None:
    buf = mmap.mmap(-1, packed_size(model_dir))
    records = pack_into(buf, model_dir)
    m = MiniLM.from_buffer(buf, records, model_dir)
    before = m.embed(["shared memory"])
    r = next(r for r in records if r["name"] == "encoder.layer.5.output.dense.bias")
    buf[r["offset"] : r["offset"] + r["nbytes"]] = bytes(r["nbytes"])
    assert not np.array_equal(m.embed(["shared memory"]), before)


def test_read_only_mapping_works(
    tmp_path: Path, model_dir: Path, packed: tuple[mmap.mmap, list[TensorRecord]], model: MiniLM
) -> None:
    buf, records = packed
    path = tmp_path / "weights.bin"
    path.write_bytes(buf[:])
    with open(path, "rb") as f:
        ro = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    m = MiniLM.from_buffer(ro, records, model_dir)
    for array in m.tensors.values():
        assert np.shares_memory(array, np.frombuffer(ro, dtype=np.uint8))
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 0
    texts = ["read-only weights", "Hello world."]
    assert m.embed(texts).tobytes() == model.embed(texts).tobytes()


# --- numerics -------------------------------------------------------------------


def test_config_follows_the_model_files(model: MiniLM) -> None:
    c = model.config
    assert c == MiniLMConfig.from_dir(default_model_dir())
    assert (c.hidden_size, c.num_layers, c.num_heads) == (384, 6, 12)
    assert c.max_seq_length == 256  # sentence_bert_config, not tokenizer.json's 128
    assert c.layer_norm_eps == 1e-12
    assert c.normalize  # modules.json ends in Normalize


def test_erf_is_float32_accurate() -> None:
    xs = np.linspace(-8, 8, 160_001, dtype=np.float32)
    exact = np.array([math.erf(float(v)) for v in xs])
    got = erf(xs)
    assert got.dtype == np.float32
    assert np.abs(got - exact).max() < 2e-7
    assert np.array_equal(erf(-xs), -got)
    ends = erf(np.array([0.0, np.inf, -np.inf], dtype=np.float32))
    assert abs(ends[0]) < 2e-7 and ends[1:].tolist() == [1.0, -1.0]


def test_tokenization_matches_reference(model: MiniLM, reference: dict[str, Any]) -> None:
    for case in reference["cases"]:
        assert model.tokenize(case["text"]).tolist() == case["input_ids"], case["text"][:40]


def _max_diffs(vectors: np.ndarray, reference: dict[str, Any]) -> list[float]:
    golden = np.array([c["embedding"] for c in reference["cases"]], dtype=np.float32)
    assert vectors.shape == golden.shape == (len(reference["cases"]), 384)
    return [float(d) for d in np.abs(vectors - golden).max(axis=1)]


def test_embed_matches_reference(model: MiniLM, reference: dict[str, Any]) -> None:
    vectors = model.embed([c["text"] for c in reference["cases"]])
    assert vectors.dtype == np.float32
    diffs = _max_diffs(vectors, reference)
    print(f"max abs diff vs {reference['versions']}: {max(diffs):.3g} (per case {diffs})")
    assert max(diffs) < TOLERANCE
    assert max(diffs) < ACHIEVED
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def test_embed_padded_matches_reference(model: MiniLM, reference: dict[str, Any]) -> None:
    texts = [c["text"] for c in reference["cases"]]
    padded = model.embed_padded(texts)
    assert max(_max_diffs(padded, reference)) < TOLERANCE
    assert np.abs(padded - model.embed(texts)).max() < 1e-6


def test_a_text_does_not_depend_on_its_batch(model: MiniLM) -> None:
    alone = model.embed(["the same sentence"])
    batched = model.embed(
        ["a much longer companion sentence, with more tokens", "the same sentence", ""]
    )
    assert batched[1].tobytes() == alone[0].tobytes()
    assert model.embed([]).shape == (0, 384)
    assert model.embed_padded([]).shape == (0, 384)


_CHILD = """
import json, sys
from understudy.engine_shim.adapters.minilm import MiniLM
texts = json.loads(sys.stdin.read())
sys.stdout.write(MiniLM.load().embed(texts).tobytes().hex())
"""


@pytest.mark.process
def test_bit_identical_across_processes(model: MiniLM, reference: dict[str, Any]) -> None:
    texts = [c["text"] for c in reference["cases"]]
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=60,
    )
    assert bytes.fromhex(child.stdout) == model.embed(texts).tobytes()
