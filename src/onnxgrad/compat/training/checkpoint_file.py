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

**Big checkpoints.** One FlatBuffer cannot exceed 2 GB. As in 1.19.2, a checkpoint whose tensors
reach :data:`EXTERNAL_DATA_THRESHOLD` keeps their bytes in ``<checkpoint>.data`` beside it
(``has_external_data`` set in ``ModuleState``, each tensor of more than 64 bytes pointing into
that file by ``external_data_offset``, aligned to its element size); the FlatBuffer holds the
rest. The same threshold decides when :func:`save_onnx` writes a model's weights as external data
(:func:`onnxgrad.save_model`), so a model over 2 GB goes through ``generate_artifacts``,
``Module``, ``save_checkpoint`` and ``export_model_for_inferencing`` without one protobuf or one
FlatBuffer over 2 GB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import flatbuffers
import numpy as np
import onnx
from flatbuffers import number_types as nt
from flatbuffers.table import Table
from onnx import helper

from ...errors import InputError
from ...storage import save_model, tensor_bytes

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "INITIAL_LR",
    "VERSION",
    "CheckpointData",
    "OptimizerGroup",
    "data_path",
    "dumps",
    "load",
    "loads",
    "save",
    "save_onnx",
]

IDENTIFIER = b"ODTC"
VERSION = 2  # what 1.19.2 writes and reads
_MAX_DTYPE = 23
# bytes of tensors from which checkpoints and models keep them in an external file (1.19.2's
# default for checkpoints, 1800 MB: under the 2 GB a FlatBuffer or a protobuf can hold)
EXTERNAL_DATA_THRESHOLD = 1800 * 2**20
_MIN_EXTERNAL = 64  # smaller tensors stay in the FlatBuffer, as in 1.19.2
# the initial learning rate of a new optimizer group: onnxruntime-training 1.19.2's own
# (GroupOptimizerState::initial_lr = 0.001f), part of its checkpoint contract and kept even if
# onnxgrad's DEFAULT_LR (onnxgrad.train.optimizers) changes
INITIAL_LR = 1e-3


def data_path(path: str | os.PathLike) -> str:
    """The external data file of the checkpoint at ``path``: ``<path>.data``."""
    return os.fspath(path) + ".data"


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike) -> str:
    """Write ``model``, its weights as external data beside it (``<file>.data``) when they reach
    :data:`EXTERNAL_DATA_THRESHOLD`; returns the path."""
    big = tensor_bytes(model) >= EXTERNAL_DATA_THRESHOLD
    return save_model(model, path, external_data=big, size_threshold=_MIN_EXTERNAL)


@dataclass
class OptimizerGroup:
    """One optimizer group: the update count, the initial learning rate and the moments of each
    parameter (``momentum0``, ``momentum1`` for AdamW; none for SGD)."""

    name: str = "group0"
    step: int = 0
    initial_lr: float = INITIAL_LR
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
    def __init__(self, buf: bytes, external: str | None) -> None:
        self.buf = buf
        self.external = external  # the external data file, when the checkpoint has one

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
        offset = self.scalar(t, 6, nt.Int64Flags, -1)
        if offset != -1:
            return name, self._external(name, offset, dims, np.dtype(dtype))
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

    def _external(self, name: str, offset: int, dims: list[int], dtype: np.dtype) -> np.ndarray:
        """A tensor whose bytes are in the external data file, at ``offset``."""
        if self.external is None:
            raise InputError(
                f"checkpoint tensor {name!r} keeps its data in the checkpoint's external file "
                "(<checkpoint>.data): load the checkpoint from its path, with that file beside it"
            )
        if not os.path.isfile(self.external):
            raise InputError(
                f"checkpoint tensor {name!r} keeps its data in {self.external!r}, which is missing: "
                "copy it beside the checkpoint"
            )
        count = int(np.prod(dims))
        size = os.path.getsize(self.external)
        if offset < 0 or offset + count * dtype.itemsize > size:
            raise InputError(
                f"checkpoint tensor {name!r}: bytes {offset}..{offset + count * dtype.itemsize} are past "
                f"the end of {self.external!r} ({size} bytes): the file is truncated or not this checkpoint's"
            )
        value = np.fromfile(self.external, dtype=dtype.newbyteorder("<"), count=count, offset=offset)
        return value.astype(dtype, copy=False).reshape(dims)


def loads(buf: bytes, external: str | None = None) -> CheckpointData:
    """Parse the bytes of a checkpoint file; ``external``: its external data file (see the
    module docstring), needed when it has one."""
    buf = bytes(buf)
    if len(buf) < 8 or buf[4:8] != IDENTIFIER:
        raise InputError("not an onnxruntime training checkpoint (no 'ODTC' file identifier)")
    r = _Reader(buf, external)
    try:
        root = r.table(flatbuffers.encode.Get(flatbuffers.packer.uoffset, buf, 0))
        version = r.scalar(root, 0, nt.Int32Flags, 0)
        if version > VERSION:
            raise InputError(f"checkpoint version {version} is newer than the supported {VERSION}")
        data = CheckpointData()
        module = r.sub(root, 1)
        if module is not None:
            data.nominal = bool(r.scalar(module, 2, nt.BoolFlags, False))
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
        return loads(f.read(), data_path(path))


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
        elif kind == "external_offset":  # Tensor.external_data_offset, whose default is -1
            b.PrependInt64Slot(slot, value, -1)
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


def _tensor(
    b: flatbuffers.Builder, name: str, value: np.ndarray, nominal: bool = False, external=None
) -> int:
    """A Tensor table; ``external`` (an open file) takes the bytes of tensors over 64 bytes."""
    arr = np.asarray(value)
    code = helper.np_dtype_to_tensor_dtype(arr.dtype)
    name_off = b.CreateString(name)
    dims_off = b.CreateNumpyVector(np.asarray(arr.shape, dtype=np.int64))
    fields = [("offset", 0, name_off), ("offset", 2, dims_off), ("int32", 3, code)]
    if not nominal:
        little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        if external is not None and little.nbytes > _MIN_EXTERNAL:
            external.write(b"\0" * (-external.tell() % max(arr.dtype.itemsize, 4)))  # aligned
            fields.append(("external_offset", 6, external.tell()))
            little.tofile(external)
        else:
            fields.append(("offset", 4, b.CreateByteVector(little.tobytes())))
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


def _nbytes(data: CheckpointData) -> int:
    """Bytes of the tensors a checkpoint holds (parameters, and moments when saved)."""
    values = [*data.trainable.values(), *data.frozen.values()] if not data.nominal else []
    values += [m for g in data.groups for moments in g.states.values() for m in moments.values()]
    return int(sum(np.asarray(v).nbytes for v in values))


def dumps(data: CheckpointData, external=None) -> bytes:
    """The bytes of a checkpoint file holding ``data``; ``external``: an open file taking the
    tensors' bytes (the ``<checkpoint>.data`` of :func:`save`), or ``None`` for one buffer."""
    b = flatbuffers.Builder(1024)
    trainable = [_tensor(b, n, v, data.nominal, external) for n, v in data.trainable.items()]
    frozen = [_tensor(b, n, v, data.nominal, external) for n, v in data.frozen.items()]
    module_fields = [("offset", 0, _vector(b, trainable)), ("offset", 1, _vector(b, frozen))]
    module_fields.append(("bool", 2, bool(data.nominal)))
    if external is not None:
        module_fields.append(("bool", 3, True))
    module = _table(b, module_fields)
    groups = []
    for g in data.groups:
        states = []
        for param, moments in g.states.items():
            tensors = [_tensor(b, n, v, False, external) for n, v in moments.items()]
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
    """Write ``data`` as a checkpoint file at ``path``, its tensors in ``<path>.data`` when they
    reach :data:`EXTERNAL_DATA_THRESHOLD`; returns the path. (A ``<path>.data`` left by an
    earlier save is not removed: the new file does not read it.)"""
    path = os.fspath(path)
    if _nbytes(data) < EXTERNAL_DATA_THRESHOLD:
        buf = dumps(data)
    else:
        with open(data_path(path), "wb") as external:
            buf = dumps(data, external)
    with open(path, "wb") as f:
        f.write(buf)
    return path
