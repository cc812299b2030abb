"""The one safetensors reader and writer (onnxgrad.model.safetensors), used by the training
folder's state file (onnxgrad.artifacts.tensors) and by LoRA adapter files: every dtype it names
round-trips, bfloat16 included (which the training folder's copy lacked), and a malformed file is
an InputError that says what is wrong."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from onnxgrad.artifacts import tensors
from onnxgrad.errors import InputError
from onnxgrad.model import safetensors

BF16 = np.dtype(ml_dtypes.bfloat16)


def _arrays() -> dict[str, np.ndarray]:
    r = np.random.default_rng(0)
    out = {code: (r.standard_normal((2, 3)) * 10).astype(dt) for code, dt in safetensors.DTYPES.items()}
    out["scalar"] = np.array(1.5, np.float32)
    out["big_endian"] = np.arange(4, dtype=">f4")
    return out


def test_every_dtype_round_trips_in_both_users(tmp_path: Path) -> None:
    assert tensors.save is safetensors.save and tensors.load is safetensors.load  # one implementation
    arrays = _arrays()
    path = tensors.save(tmp_path / "state.safetensors", arrays, {"step": "3"})
    back, meta = safetensors.load(path)
    assert meta == {"step": "3"} and list(back) == list(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype.newbyteorder("="), name
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    assert back["BF16"].dtype == BF16


def test_bfloat16_bytes_are_the_format_s(tmp_path: Path) -> None:
    """BF16 is the high half of the float32 bits, little-endian, as the safetensors package writes."""
    value = np.array([1.0, -2.5, 3.140625], BF16)
    data = safetensors.saves({"w": value})
    (n,) = struct.unpack("<Q", data[:8])
    assert json.loads(data[8 : 8 + n])["w"]["dtype"] == "BF16"
    want = (np.array([1.0, -2.5, 3.140625], "<f4").view("<u4") >> 16).astype("<u2").tobytes()
    assert data[8 + n :] == want


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (
            lambda h, body: (h | {"w": {**h["w"], "shape": [100]}}, body),
            r"tensor 'w' has 6 bytes for shape \[100\]",
        ),
        (
            lambda h, body: (h | {"w": {**h["w"], "dtype": "F8_E4M3"}}, body),
            "tensor 'w' has an unsupported safetensors dtype 'F8_E4M3'",
        ),
        (
            lambda h, body: (h | {"w": {**h["w"], "data_offsets": [0, 60]}}, body),
            "tensor 'w' lies outside the file",
        ),
        (lambda h, body: (h | {"w": {"shape": [3]}}, body), "tensor 'w' has a corrupt header entry"),
    ],
)
def test_malformed_files_are_refused(tmp_path: Path, corrupt: object, message: str) -> None:
    data = safetensors.saves({"w": np.ones(3, BF16)})
    (n,) = struct.unpack("<Q", data[:8])
    header, body = corrupt(json.loads(data[8 : 8 + n]), data[8 + n :])  # type: ignore[operator]
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    with pytest.raises(InputError, match=rf"^'.*bad\.safetensors': {message}"):
        safetensors.load(path)


def test_short_and_unknown_inputs() -> None:
    with pytest.raises(InputError, match=r"^the data is not a safetensors file: shorter than"):
        safetensors.loads(b"\x01")
    with pytest.raises(InputError, match="the header runs past the end"):
        safetensors.loads(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(InputError, match=r"tensor 'c': dtype complex64 has no safetensors code here"):
        safetensors.saves({"c": np.zeros(2, np.complex64)})
