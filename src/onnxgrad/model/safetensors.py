"""The safetensors format, read and written without the safetensors package: the one reader and
writer of onnxgrad (the parameter file of a training folder, ``state.safetensors``, and the LoRA
adapter files of :func:`onnxgrad.lora.save_adapters`). The format is small enough to write by
hand, and JavaScript reads it the same way.

Layout: an 8-byte little-endian unsigned length ``N``, then ``N`` bytes of UTF-8 JSON (padded with
spaces to a multiple of 8), then the raw little-endian buffers. The JSON maps each tensor name to
``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}`` (offsets into the buffer part)
and may hold ``"__metadata__"``, a string -> string mapping. bfloat16 is ``"BF16"`` (numpy's
``ml_dtypes.bfloat16``, the type onnx itself gives bfloat16 tensors).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from ..errors import InputError, PathNotFoundError

__all__ = ["DTYPES", "load", "loads", "save", "saves"]

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODES = {v: k for k, v in DTYPES.items()}


def saves(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``tensors`` (name -> array), in the mapping's order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks, offset = [], 0
    for name, value in tensors.items():
        arr = np.asarray(value)
        code = _CODES.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if code is None:
            raise InputError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors code here")
        data = np.ascontiguousarray(arr, dtype=DTYPES[code]).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def loads(data: bytes, *, source: str = "the data") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array, metadata) from safetensors bytes; the arrays are copies. ``source`` names
    the data in the :class:`InputError` a malformed file gets (a file name)."""
    if len(data) < 8:
        raise InputError(f"{source} is not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise InputError(f"{source} is not a safetensors file: the header runs past the end")
    try:
        header = json.loads(data[8 : 8 + n].decode())
    except (ValueError, RecursionError) as exc:  # not UTF-8 or not JSON; JSON nested too deep
        raise InputError(f"{source} is not a safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise InputError(f"{source} is not a safetensors file: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{source} is not a safetensors file: __metadata__ is not a string mapping")
    body = data[8 + n :]
    tensors = {}
    spans = []  # (begin, end, name): they must tile the data part, as safetensors writes it
    for name, spec in header.items():
        try:
            dtype = DTYPES.get(spec["dtype"])
            begin, end = (int(v) for v in spec["data_offsets"])
            shape = [int(d) for d in spec["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{source}: tensor {name!r} has a corrupt header entry") from exc
        if dtype is None:
            raise InputError(
                f"{source}: tensor {name!r} has an unsupported safetensors dtype {spec['dtype']!r}"
            )
        if not 0 <= begin <= end <= len(body) or any(d < 0 for d in shape):
            raise InputError(f"{source}: tensor {name!r} lies outside the file")
        if math.prod(shape) * dtype.itemsize != end - begin:
            raise InputError(f"{source}: tensor {name!r} has {end - begin} bytes for shape {shape}")
        arr = np.frombuffer(body[begin:end], dtype=dtype)
        tensors[name] = arr.reshape(shape).astype(dtype.newbyteorder("="), copy=True)
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            what = (
                "overlaps the tensor before it"
                if begin < at
                else f"leaves bytes {at} to {begin} to no tensor"
            )
            raise InputError(
                f"{source}: tensor {name!r} (bytes {begin} to {end}) {what}: the tensors of a safetensors "
                "file fill its data end to end"
            )
        at = end
    if at != len(body):
        raise InputError(f"{source} has {len(body) - at} bytes after its last tensor: not a safetensors file")
    return tensors, metadata


def save(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> str:
    """Write ``tensors`` to ``path`` (safetensors); returns the path."""
    path = os.fspath(path)
    with open(path, "wb") as f:
        f.write(saves(tensors, metadata))
    return path


def load(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array, metadata) read from a safetensors file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise PathNotFoundError(f"the safetensors file {path!r} does not exist")
    if not os.path.isfile(path):  # a device or a pipe would be read without end
        raise InputError(f"{path!r} is not a regular file, so not a safetensors file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise InputError(f"cannot read the safetensors file {path!r}: {exc}") from exc
    return loads(data, source=repr(path))
