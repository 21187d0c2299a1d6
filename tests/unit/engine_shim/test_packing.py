"""packing.weights_manifest on malformed safetensors files: one clear
WeightsError each, naming what is wrong, never another exception."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from understudy.engine_shim.adapters.packing import WeightsError, weights_manifest


def _file(tmp_path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    n = len(header) if length is None else length
    (tmp_path / "model.safetensors").write_bytes(n.to_bytes(8, "little") + header + data)
    return tmp_path


def _header(entries: object) -> bytes:
    return json.dumps(entries).encode()


GOOD = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def test_a_good_file(tmp_path: Path) -> None:
    (spec,) = weights_manifest(_file(tmp_path, _header(GOOD), bytes(8)))
    assert (spec.name, spec.dtype, spec.shape, spec.nbytes) == ("w", "float32", (2,), 8)


@pytest.mark.parametrize(
    ("header", "data", "length", "message"),
    [
        (b"", b"", None, "not JSON"),
        (b"{", b"", None, "not JSON"),
        (b"[1]", b"", None, "not a JSON object"),
        (b"{}", b"", 1 << 40, "exceeds the cap"),
        (b"{}", b"", 100, "truncated header"),
        (_header({"w": 3}), b"", None, "bad or unsupported entry"),
        (_header({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}), b"", None,
         "bad or unsupported"),
        (_header({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), bytes(8), None,
         "do not match"),
        (_header(GOOD), bytes(4), None, "outside the file"),
    ],
)  # fmt: skip
def test_malformed_files_get_a_weights_error(
    tmp_path: Path, header: bytes, data: bytes, length: int | None, message: str
) -> None:
    with pytest.raises(WeightsError, match=message):
        weights_manifest(_file(tmp_path, header, data, length))


def test_a_file_shorter_than_its_length_prefix(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(WeightsError, match="shorter than a safetensors header"):
        weights_manifest(tmp_path)
