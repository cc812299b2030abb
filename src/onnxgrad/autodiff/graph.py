"""Reading models: loading, validation, types and shapes of every value, versions.

Everything the engine needs to know about the *input* model lives here, so the engine and the rules
never touch raw protobuf type fields.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ModelError

FLOAT_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE})

# onnxruntime 1.31 loads IR <= 13 and opset <= 26; onnx 1.23 writes IR 14 unless told otherwise.
MAX_IR_VERSION = 13
MAX_OPSET = 26
# The backward graph is written at this opset or the model's, whichever is higher: from 18 on, every
# reduction takes its axes as an input, which keeps the rules free of version branches.
MIN_BACKWARD_OPSET = 18

Dim = int | str | None  # static size, symbolic name, or unknown


@dataclass(frozen=True)
class ValueInfo:
    """Type of one tensor value: ONNX element type and shape (``None`` when the rank is unknown)."""

    name: str
    dtype: int
    shape: tuple[Dim, ...] | None

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_TYPES

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def static_shape(self) -> tuple[int, ...] | None:
        """The shape as ints when every dimension is known, else ``None``."""
        if self.shape is None or not all(isinstance(d, int) for d in self.shape):
            return None
        return tuple(self.shape)  # type: ignore[arg-type]

    def to_proto(self, name: str | None = None) -> onnx.ValueInfoProto:
        shape = None if self.shape is None else [d if d is not None else "" for d in self.shape]
        if shape is not None:
            shape = [None if d == "" else d for d in shape]
        return helper.make_tensor_value_info(name or self.name, self.dtype, shape)


def np_dtype(onnx_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))


def onnx_dtype(dtype: np.dtype | type) -> int:
    """The ONNX element type of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def load_model(model: onnx.ModelProto | str | os.PathLike | bytes) -> onnx.ModelProto:
    """Load a model from a path, bytes or a ``ModelProto``, raising :class:`ModelError` if it is not ONNX."""
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        if isinstance(model, bytes | bytearray):
            proto = onnx.load_from_string(bytes(model))
        elif isinstance(model, str | os.PathLike):
            if not os.path.exists(model):
                raise ModelError(f"model file {os.fspath(model)!r} does not exist")
            proto = onnx.load(os.fspath(model))
        else:
            raise ModelError(f"expected an onnx.ModelProto, a path or bytes, got {type(model).__name__}")
    except ModelError:
        raise
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise ModelError(f"cannot read the model: it is not a valid ONNX file ({exc})") from exc
    if not proto.graph.node and not proto.graph.output:
        raise ModelError("the model has an empty graph: it is not a valid ONNX file")
    return proto


def check_model(model: onnx.ModelProto) -> None:
    """Run the ONNX checker, turning its failures into :class:`ModelError`."""
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"the model is not valid ONNX: {exc}") from exc


def opset_of(model: onnx.ModelProto, domain: str = "") -> int:
    """The opset version the model imports for ``domain`` (0 when not imported)."""
    for imp in model.opset_import:
        if imp.domain in (domain, "ai.onnx" if domain == "" else domain):
            return imp.version
    return 0


def ir_version_for(opsets: Iterable[onnx.OperatorSetIdProto]) -> int:
    """The IR version to write for these opsets: what they need, at most what onnxruntime loads."""
    pairs = [(o.domain, o.version) for o in opsets if o.domain in ("", "ai.onnx")]
    try:
        needed = helper.find_min_ir_version_for(pairs, ignore_unknown=True)
    except Exception:  # pragma: no cover - very old onnx
        needed = 8
    return min(max(needed, 8), MAX_IR_VERSION)


def _shape_of(type_proto: onnx.TypeProto) -> tuple[Dim, ...] | None:
    tt = type_proto.tensor_type
    if not tt.HasField("shape"):
        return None
    dims: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return tuple(dims)


def value_info_from_proto(vi: onnx.ValueInfoProto) -> ValueInfo | None:
    """The :class:`ValueInfo` of a protobuf value info, ``None`` for non-tensor types."""
    if not vi.type.HasField("tensor_type"):
        return None
    return ValueInfo(vi.name, vi.type.tensor_type.elem_type, _shape_of(vi.type))


# ai.onnx.ml ops that ONNX shape inference leaves untyped: float32 with the shape of input 0.
_ML_ELEMENTWISE = {"Scaler", "Normalizer", "Imputer", "Binarizer"}


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:
        # A graph that shape inference rejects may still run; keep what the file declares.
        return model


def _type_ml_outputs(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``model`` declaring the outputs of untyped ai.onnx.ml ops, or None if none."""
    typed = {vi.name for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    typed |= {i.name for i in model.graph.initializer}
    shapes = {vi.name: vi for vi in [*model.graph.value_info, *model.graph.input]}
    added = []
    for node in model.graph.node:
        if node.domain != "ai.onnx.ml" or not node.output or node.output[0] in typed:
            continue
        src = shapes.get(node.input[0]) if node.input else None
        if node.op_type in _ML_ELEMENTWISE and src is not None:
            dims = [d.dim_value or d.dim_param or None for d in src.type.tensor_type.shape.dim]
            added.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, dims))
        elif node.op_type == "LinearRegressor":
            targets = next((a.i for a in node.attribute if a.name == "targets"), 1)
            added.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, [None, targets]))
    if not added:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.value_info.extend(added)
    return copy


def infer_value_infos(model: onnx.ModelProto) -> dict[str, ValueInfo]:
    """Types and shapes of every value of the main graph, after ONNX shape inference.

    ONNX infers nothing for most ai.onnx.ml ops; their outputs are typed from a small table and
    inference is run again, so the values after them keep known ranks.
    """
    inferred = _infer(model)
    for _ in range(len(model.graph.node)):
        retyped = _type_ml_outputs(inferred)
        if retyped is None:
            break
        inferred = _infer(retyped)
    infos: dict[str, ValueInfo] = {}
    g = inferred.graph
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        info = value_info_from_proto(vi)
        if info is not None and info.dtype != TensorProto.UNDEFINED:
            old = infos.get(vi.name)
            # Prefer the more specific of two declarations (a shape beats no shape).
            if old is None or (old.shape is None and info.shape is not None):
                infos[vi.name] = info
    for init in g.initializer:
        infos[init.name] = ValueInfo(init.name, init.data_type, tuple(init.dims))
    for node in g.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value":
                    infos[node.output[0]] = ValueInfo(node.output[0], attr.t.data_type, tuple(attr.t.dims))
    return infos


def constant_values(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Tensors known before running: initializers and outputs of ``Constant`` nodes with a tensor value."""
    consts: dict[str, onnx.TensorProto] = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        attr = node.attribute[0] if node.attribute else None
        if attr is None:
            continue
        if attr.name == "value":
            t = attr.t
        elif attr.name == "value_float":
            t = helper.make_tensor("", TensorProto.FLOAT, [], [attr.f])
        elif attr.name == "value_floats":
            t = helper.make_tensor("", TensorProto.FLOAT, [len(attr.floats)], list(attr.floats))
        elif attr.name == "value_int":
            t = helper.make_tensor("", TensorProto.INT64, [], [attr.i])
        elif attr.name == "value_ints":
            t = helper.make_tensor("", TensorProto.INT64, [len(attr.ints)], list(attr.ints))
        else:
            continue
        t = onnx.TensorProto.FromString(t.SerializeToString())
        t.name = node.output[0]
        consts[node.output[0]] = t
    return consts


def to_array(tensor: onnx.TensorProto) -> np.ndarray:
    """A numpy copy of a tensor proto (external data must already be loaded)."""
    return numpy_helper.to_array(tensor)


def topological_order(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` in an order where each value is defined before it is read.

    ONNX requires files to be sorted already; this also accepts unsorted graphs and reports cycles
    and values that nothing defines as :class:`ModelError`.
    """
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    producers: dict[str, int] = {}
    for idx, node in enumerate(graph.node):
        for out in node.output:
            if out:
                if out in producers or out in defined:
                    raise ModelError(
                        f"value {out!r} is defined twice (node {node.name or idx!r}, op {node.op_type})"
                    )
                producers[out] = idx
    order: list[onnx.NodeProto] = []
    state = [0] * len(graph.node)  # 0 new, 1 on stack, 2 done
    for start in range(len(graph.node)):
        if state[start]:
            continue
        stack = [(start, iter(_node_reads(graph.node[start])))]
        state[start] = 1
        while stack:
            idx, it = stack[-1]
            for name in it:
                if name in defined:
                    continue
                p = producers.get(name)
                if p is None:
                    node = graph.node[idx]
                    raise ModelError(
                        f"node {node.name or idx!r} ({node.op_type}) reads {name!r}, which no node, "
                        "input or initializer defines"
                    )
                if state[p] == 1:
                    raise ModelError(
                        f"the graph has a cycle through value {name!r} (node {graph.node[p].name!r})"
                    )
                if state[p] == 0:
                    state[p] = 1
                    stack.append((p, iter(_node_reads(graph.node[p]))))
                    break
            else:
                state[idx] = 2
                order.append(graph.node[idx])
                stack.pop()
    return order


def _node_reads(node: onnx.NodeProto) -> list[str]:
    """Names a node reads: its inputs and the outer-scope names its subgraphs use."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            names.extend(_free_names(sub))
    return names


def _free_names(graph: onnx.GraphProto) -> list[str]:
    local = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in graph.node:
        local.update(node.output)
    free = []
    for node in graph.node:
        free.extend(n for n in _node_reads(node) if n not in local)
    return free
