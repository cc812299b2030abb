"""Saving models whose weights may not fit in one protobuf (2 GB): external data beside the file.

:func:`save_model` writes a model as ``onnx.save`` does, switching to external data (every tensor
above ``size_threshold`` bytes in one file next to the model, ``<name>.onnx.data``) when asked or,
by default, when the tensors exceed what one protobuf can hold. Loading such a model back needs
nothing special: ``ForwardBackward(path)``, ``OnnxModule(path)``, ``build_gradient(path)`` read the
external data from the model's folder (and only from there, see :mod:`onnxgrad.model.validate`).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import InputError

PROTOBUF_LIMIT = 2**31 - 1  # bytes: the most one serialized protobuf may hold
_MARGIN = 64 * 2**20  # room for the graph itself beside the tensors


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the tensors ``model`` holds in itself (initializers of every graph, Constant
    values), not counting those already stored as external data."""
    total = 0
    for t in _tensors(model):
        if t.data_location != TensorProto.EXTERNAL:
            total += _nbytes(t)
    return total


def _nbytes(t: TensorProto) -> int:
    if t.raw_data:
        return len(t.raw_data)
    try:
        return (
            int(np.prod(t.dims, dtype=np.int64))
            * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        )
    except Exception:
        return t.ByteSize()


def _tensors(model: onnx.ModelProto):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    location: str | None = None,
    size_threshold: int = 1024,
) -> str:
    """Write ``model`` to ``path``; returns the path.

    ``external_data``: ``True`` stores every tensor of at least ``size_threshold`` bytes in one file
    beside the model (``location``: its file name, default ``<model file name>.data``, in the same
    folder); ``False`` never does; ``None`` (default) does when the tensors would not fit in one
    protobuf (2 GB). ``model`` itself is left as it was; the folder is made if missing.
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if external_data is None:
        external_data = tensor_bytes(model) > PROTOBUF_LIMIT - _MARGIN
    if not external_data:
        onnx.save(model, path)
        return path
    folder = os.path.dirname(os.path.abspath(path))
    location = location or os.path.basename(path) + ".data"
    if os.path.basename(location) != location or location in ("", ".", ".."):
        raise InputError(f"external data location {location!r} must be a file name in the model's folder")
    data_path = os.path.join(folder, location)
    # each moved tensor: (tensor, its original content when not raw bytes, the bytes written)
    moved: list[tuple[TensorProto, TensorProto | None, bytes]] = []
    try:
        with open(data_path, "wb") as f:
            for t in _tensors(model):
                if t.data_location == TensorProto.EXTERNAL or _nbytes(t) < size_threshold:
                    continue
                original = None
                if not t.raw_data:
                    original = TensorProto()
                    original.CopyFrom(t)
                raw = t.raw_data if t.raw_data else _raw(t)
                f.write(b"\0" * (-f.tell() % 4096))  # aligned, as onnx writes them
                offset = f.tell()
                f.write(raw)
                moved.append((t, original, raw))
                _point(t, location, offset, len(raw))
        onnx.save(model, path)
    finally:
        for t, original, raw in moved:  # the caller's model as it was
            if original is not None:
                t.CopyFrom(original)
            else:
                t.ClearField("external_data")
                t.ClearField("data_location")
                t.raw_data = raw
    return path


def _raw(t: TensorProto) -> bytes:
    arr = numpy_helper.to_array(t)
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def _point(t: TensorProto, location: str, offset: int, length: int) -> None:
    for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(field)
    t.ClearField("raw_data")
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v
