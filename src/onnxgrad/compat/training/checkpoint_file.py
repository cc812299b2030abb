"""The ``checkpoint`` file of onnxruntime-training's on-device API, read and written by hand.

The file is a FlatBuffer with file identifier ``ODTC`` whose schema is onnxruntime's
``ort_training_checkpoint.fbs`` (tensors as in ``ort.fbs``). Only the fields onnxruntime-training
1.19.2 writes are handled; each table's fields by slot (the order of the schema)::

    Checkpoint       0 version:int32  1 module_state  2 optimizer_groups:[OptimizerGroup]  3 property_bag
    ModuleState      0 requires_grad_params:[Tensor]  1 frozen_params:[Tensor]  2 is_nominal_state:bool
                     3 has_external_data:bool
    OptimizerGroup   0 group_name  1 step:int64  2 initial_learning_rate:float
                     3 optimizer_states:[ParameterOptimizerState]
    ParameterOptimizerState  0 param_name  1 momentums:[Tensor] (named momentum0, momentum1)
    PropertyBag      0 ints:[IntProperty]  1 floats:[FloatProperty]  2 strings:[StringProperty]
    *Property        0 name  1 value (int64, float32, string)
    Tensor           0 name  1 doc_string  2 dims:[int64]  3 data_type:int32 (ONNX's codes)
                     4 raw_data:[ubyte]  5 string_data:[string]  6 external_data_offset:int64 = -1

A file written here loads in onnxruntime-training 1.19.2 and the other way round (the fixtures of
``tests/compat_training`` were recorded with it). The pure-Python ``flatbuffers`` package (which
onnxruntime itself depends on) does the low-level work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import flatbuffers
import numpy as np
from flatbuffers import number_types as nt
from flatbuffers.table import Table
from onnx import helper

from ...errors import InputError

__all__ = ["VERSION", "CheckpointData", "OptimizerGroup", "dumps", "load", "loads", "save"]

IDENTIFIER = b"ODTC"
VERSION = 2  # what 1.19.2 writes and reads
_MAX_DTYPE = 23


@dataclass
class OptimizerGroup:
    """One optimizer group: the update count, the initial learning rate and the moments of each
    parameter (``momentum0``, ``momentum1`` for AdamW; none for SGD)."""

    name: str = "group0"
    step: int = 0
    initial_lr: float = 1e-3
    states: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


@dataclass
class CheckpointData:
    """Everything a checkpoint file holds, in the file's order."""

    trainable: dict[str, np.ndarray] = field(default_factory=dict)
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    nominal: bool = False
    groups: list[OptimizerGroup] = field(default_factory=list)
    properties: dict[str, int | float | str] = field(default_factory=dict)


# ---- reading -------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf

    def table(self, pos: int) -> Table:
        return Table(self.buf, pos)

    @staticmethod
    def scalar(t: Table, slot: int, flags, default):
        o = t.Offset(4 + 2 * slot)
        return t.Get(flags, o + t.Pos) if o else default

    @staticmethod
    def string(t: Table, slot: int) -> str | None:
        o = t.Offset(4 + 2 * slot)
        return t.String(o + t.Pos).decode() if o else None

    def sub(self, t: Table, slot: int) -> Table | None:
        o = t.Offset(4 + 2 * slot)
        return self.table(t.Indirect(o + t.Pos)) if o else None

    def tables(self, t: Table, slot: int) -> list[Table]:
        o = t.Offset(4 + 2 * slot)
        if not o:
            return []
        start = t.Vector(o)
        return [self.table(t.Indirect(start + 4 * j)) for j in range(t.VectorLen(o))]

    @staticmethod
    def array(t: Table, slot: int, flags) -> np.ndarray | None:
        o = t.Offset(4 + 2 * slot)
        return t.GetVectorAsNumpy(flags, o) if o else None

    def tensor(self, t: Table, nominal: bool) -> tuple[str, np.ndarray]:
        name = self.string(t, 0) or ""
        dims = self.array(t, 2, nt.Int64Flags)
        dims = [] if dims is None else [int(d) for d in dims]
        code = self.scalar(t, 3, nt.Int32Flags, 0)
        if not 0 < code <= _MAX_DTYPE:
            raise InputError(f"checkpoint tensor {name!r}: unknown data type {code}")
        dtype = helper.tensor_dtype_to_np_dtype(code)
        if self.scalar(t, 6, nt.Int64Flags, -1) != -1:
            raise InputError(
                f"checkpoint tensor {name!r} keeps its data in an external file, which is not supported"
            )
        raw = self.array(t, 4, nt.Uint8Flags)
        if raw is None or len(raw) == 0:
            if not nominal and int(np.prod(dims)) != 0:
                raise InputError(f"checkpoint tensor {name!r} has no data")
            return name, np.zeros(dims, dtype)
        expected = int(np.prod(dims)) * np.dtype(dtype).itemsize
        if len(raw) != expected:
            raise InputError(f"checkpoint tensor {name!r}: {len(raw)} bytes for shape {dims} of {dtype}")
        return name, np.frombuffer(raw.tobytes(), dtype=np.dtype(dtype).newbyteorder("<")).reshape(
            dims
        ).copy()


def loads(buf: bytes) -> CheckpointData:
    """Parse the bytes of a checkpoint file."""
    buf = bytes(buf)
    if len(buf) < 8 or buf[4:8] != IDENTIFIER:
        raise InputError("not an onnxruntime training checkpoint (no 'ODTC' file identifier)")
    r = _Reader(buf)
    try:
        root = r.table(flatbuffers.encode.Get(flatbuffers.packer.uoffset, buf, 0))
        version = r.scalar(root, 0, nt.Int32Flags, 0)
        if version > VERSION:
            raise InputError(f"checkpoint version {version} is newer than the supported {VERSION}")
        data = CheckpointData()
        module = r.sub(root, 1)
        if module is not None:
            data.nominal = bool(r.scalar(module, 2, nt.BoolFlags, False))
            if r.scalar(module, 3, nt.BoolFlags, False):
                raise InputError(
                    "the checkpoint keeps its tensors in an external file, which is not supported"
                )
            data.trainable = dict(r.tensor(t, data.nominal) for t in r.tables(module, 0))
            data.frozen = dict(r.tensor(t, data.nominal) for t in r.tables(module, 1))
        for g in r.tables(root, 2):
            group = OptimizerGroup(
                r.string(g, 0) or "group0",
                int(r.scalar(g, 1, nt.Int64Flags, 0)),
                float(r.scalar(g, 2, nt.Float32Flags, 0.0)),
            )
            for s in r.tables(g, 3):
                group.states[r.string(s, 0) or ""] = dict(r.tensor(m, False) for m in r.tables(s, 1))
            data.groups.append(group)
        bag = r.sub(root, 3)
        if bag is not None:
            for slot, flags in ((0, nt.Int64Flags), (1, nt.Float32Flags)):
                for p in r.tables(bag, slot):
                    value = r.scalar(p, 1, flags, 0)
                    data.properties[r.string(p, 0) or ""] = int(value) if slot == 0 else float(value)
            for p in r.tables(bag, 2):
                data.properties[r.string(p, 0) or ""] = r.string(p, 1) or ""
    except InputError:
        raise
    except Exception as exc:  # a truncated or corrupted buffer
        raise InputError(f"the checkpoint file is damaged: {type(exc).__name__}: {exc}") from exc
    return data


def load(path: str | os.PathLike) -> CheckpointData:
    """Read a checkpoint file (see the module docstring)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InputError(f"{path!r} is a folder; pass the checkpoint file inside it")
    if not os.path.isfile(path):
        raise InputError(f"no checkpoint file at {path!r}")
    with open(path, "rb") as f:
        return loads(f.read())


# ---- writing -------------------------------------------------------------------------------------
def _table(b: flatbuffers.Builder, fields: list[tuple[str, int, object]]) -> int:
    """A table from (kind, slot, value) fields; offsets are made before StartObject."""
    b.StartObject(max((slot for _, slot, _ in fields), default=-1) + 1)
    for kind, slot, value in fields:
        if kind == "offset":
            b.PrependUOffsetTRelativeSlot(slot, value, 0)
        elif kind == "int32":
            b.PrependInt32Slot(slot, value, 0)
        elif kind == "int64":
            b.PrependInt64Slot(slot, value, 0)
        elif kind == "float32":
            b.PrependFloat32Slot(slot, value, 0.0)
        elif kind == "bool":
            b.PrependBoolSlot(slot, value, False)
    return b.EndObject()


def _vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def _tensor(b: flatbuffers.Builder, name: str, value: np.ndarray, nominal: bool = False) -> int:
    arr = np.asarray(value)
    code = helper.np_dtype_to_tensor_dtype(arr.dtype)
    name_off = b.CreateString(name)
    dims_off = b.CreateNumpyVector(np.asarray(arr.shape, dtype=np.int64))
    fields = [("offset", 0, name_off), ("offset", 2, dims_off), ("int32", 3, code)]
    if not nominal:
        raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
        fields.append(("offset", 4, b.CreateByteVector(raw)))
    return _table(b, fields)


def _property(b: flatbuffers.Builder, name: str, value: int | float | str) -> tuple[int, int]:
    """(kind 0/1/2, offset) of one property."""
    name_off = b.CreateString(name)
    if isinstance(value, str):
        value_off = b.CreateString(value)
        return 2, _table(b, [("offset", 0, name_off), ("offset", 1, value_off)])
    if isinstance(value, (bool, int, np.integer)):
        return 0, _table(b, [("offset", 0, name_off), ("int64", 1, int(value))])
    return 1, _table(b, [("offset", 0, name_off), ("float32", 1, float(value))])


def dumps(data: CheckpointData) -> bytes:
    """The bytes of a checkpoint file holding ``data``."""
    b = flatbuffers.Builder(1024)
    trainable = [_tensor(b, n, v, data.nominal) for n, v in data.trainable.items()]
    frozen = [_tensor(b, n, v, data.nominal) for n, v in data.frozen.items()]
    module_fields = [("offset", 0, _vector(b, trainable)), ("offset", 1, _vector(b, frozen))]
    module_fields.append(("bool", 2, bool(data.nominal)))
    module = _table(b, module_fields)
    groups = []
    for g in data.groups:
        states = []
        for param, moments in g.states.items():
            tensors = [_tensor(b, n, v) for n, v in moments.items()]
            param_off = b.CreateString(param)
            states.append(_table(b, [("offset", 0, param_off), ("offset", 1, _vector(b, tensors))]))
        states_off = _vector(b, states)
        name_off = b.CreateString(g.name)
        groups.append(
            _table(
                b,
                [
                    ("offset", 0, name_off),
                    ("int64", 1, int(g.step)),
                    ("float32", 2, float(g.initial_lr)),
                    ("offset", 3, states_off),
                ],
            )
        )
    fields = [("int32", 0, VERSION), ("offset", 1, module)]
    if groups:
        fields.append(("offset", 2, _vector(b, groups)))
    if data.properties:
        kinds: list[list[int]] = [[], [], []]
        for name, value in data.properties.items():
            kind, off = _property(b, name, value)
            kinds[kind].append(off)
        bag_fields = [("offset", slot, _vector(b, offs)) for slot, offs in enumerate(kinds) if offs]
        fields.append(("offset", 3, _table(b, bag_fields)))
    b.Finish(_table(b, fields), file_identifier=IDENTIFIER)
    return bytes(b.Output())


def save(path: str | os.PathLike, data: CheckpointData) -> str:
    """Write ``data`` as a checkpoint file at ``path``; returns the path."""
    path = os.fspath(path)
    with open(path, "wb") as f:
        f.write(dumps(data))
    return path
