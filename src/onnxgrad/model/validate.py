"""Validation of untrusted models: sizes, external data and PythonOp constants, before anything runs.

An ONNX file is data, but a few of its fields make the libraries under onnxgrad allocate memory or
read files: a declared dimension of 2**40, an initializer whose declared shape does not match its
bytes, a ``ConstantOfShape`` fed a huge constant, an external-data location such as
``../../home/user/.ssh/id_rsa``, a PythonOp constant that was a raw memory address in the process that
exported the model. :func:`check_model_safety` refuses all of these with a
:class:`~onnxgrad.errors.ModelError` (:class:`~onnxgrad.errors.PythonOpError` for a Function that is
not allowed) saying what is wrong and what to do. It never allocates what the model declares: its
cost is proportional to the size of the file. :func:`load_untrusted` reads a file that way, checking
before it reads any external data.

The size limits are :class:`~.limits.Limits` (see :mod:`.limits` and ``SECURITY.md``); the sizes that
constants fix are followed with :mod:`.fold`; what a PythonOp node is, is :mod:`.pythonop_spec`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from onnx import AttributeProto, TensorProto, helper

from ..errors import ModelError, PythonOpError
from .fold import combinations, possible_values
from .graph import ValueInfo, dtype_name, np_dtype, opset_of, topological_order, without_weights
from .limits import Limits, default_limits
from .pythonop_spec import class_name, is_python_node, warn_rounded_floats

__all__ = [
    "Limits",
    "check_model_safety",
    "check_python_ops",
    "check_structure",
    "default_limits",
    "file_inside",
    "load_untrusted",
    "python_op_classes",
    "safe_to_propagate_data",
    "validate_model",
]

# Element sizes in bits of the sub-byte types, which files may store packed or one per byte.
_SUB_BYTE_BITS = {
    TensorProto.UINT4: 4,
    TensorProto.INT4: 4,
    TensorProto.FLOAT4E2M1: 4,
    getattr(TensorProto, "UINT2", -1): 2,
    getattr(TensorProto, "INT2", -1): 2,
    getattr(TensorProto, "FLOAT6E2M3", -1): 6,
    getattr(TensorProto, "FLOAT6E3M2", -1): 6,
}
_INT_TYPES = frozenset(
    {
        TensorProto.INT64,
        TensorProto.INT32,
        TensorProto.INT16,
        TensorProto.INT8,
        TensorProto.UINT64,
        TensorProto.UINT32,
        TensorProto.UINT16,
        TensorProto.UINT8,
    }
)


# ---- entry points ------------------------------------------------------------------------------
def load_untrusted(
    source: onnx.ModelProto | str | os.PathLike | bytes,
    *,
    limits: Limits | None = None,
    allowed_functions: Container[str] | Callable[[str], bool] | None = None,
) -> onnx.ModelProto:
    """Read a model that may come from anyone: checked (:func:`validate_model`) before its
    external data is read, which then comes only from files inside the model's folder.

    ``source``: a path, the bytes of a file, or a ``ModelProto`` (which then may not reference
    external data: nothing says where its folder is).
    """
    base_dir = None
    if isinstance(source, onnx.ModelProto):
        proto = source
    elif isinstance(source, bytes | bytearray):
        proto = _parse(lambda: onnx.load_from_string(bytes(source)))
    elif isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if not os.path.isfile(path):
            what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
            raise ModelError(f"model file {path!r} {what}")
        base_dir = os.path.dirname(os.path.abspath(path))
        proto = _parse(lambda: onnx.load(path, load_external_data=False))  # any format onnx reads
    else:
        raise ModelError(f"expected an onnx.ModelProto, a path or bytes, got {type(source).__name__}")
    validate_model(proto, base_dir=base_dir, limits=limits, allowed_functions=allowed_functions)
    if base_dir is not None and _uses_external_data(proto):
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(proto, base_dir)
        except Exception as exc:  # checked above; a file changed meanwhile, or unreadable
            raise ModelError(f"cannot read the model's external data: {exc}") from exc
    return proto


def validate_model(
    model: onnx.ModelProto,
    *,
    base_dir: str | os.PathLike | None = None,
    limits: Limits | None = None,
    allowed_functions: Container[str] | Callable[[str], bool] | None = None,
) -> None:
    """Everything a model must pass before onnxgrad builds or runs anything from it:
    :func:`check_model_safety`, then :func:`check_structure`."""
    check_model_safety(model, base_dir=base_dir, limits=limits, allowed_functions=allowed_functions)
    check_structure(model)


def check_structure(model: onnx.ModelProto) -> None:
    """A graph that can run: not empty, no cycle, every value read is defined, every If, Loop and
    Scan with the subgraphs its inputs and outputs need (:class:`ModelError`)."""
    if not model.graph.node and not model.graph.output:
        raise ModelError("the model has an empty graph: it is not a valid ONNX file")
    opset = opset_of(model)
    for where, node in _nodes(model):
        if node.domain in ("", "ai.onnx") and node.op_type in ("If", "Loop", "Scan"):
            _check_control_flow(node, where, opset)
    topological_order(model.graph)


def _check_control_flow(node: onnx.NodeProto, where: str, opset: int) -> None:
    """The subgraphs of an If, Loop or Scan node take and give as many values as the node says."""
    label = f"{_node_label(node)}{where}"
    graphs = {a.name: a.g for a in node.attribute if a.HasField("g")}
    names = ["then_branch", "else_branch"] if node.op_type == "If" else ["body"]
    missing = [n for n in names if n not in graphs]
    if missing:
        raise ModelError(f"{label} has no {missing[0]!r} graph: the file is corrupt")
    n_in, n_out = len(node.input), len(node.output)
    if node.op_type == "If":
        for name in names:
            _arity(label, name, "outputs", len(graphs[name].output), n_out)
        return
    body = graphs["body"]
    if node.op_type == "Loop":
        carried = n_in - 2  # inputs: trip count, condition, the carried values
        if carried < 0 or n_out < carried:
            raise ModelError(
                f"{label} has {n_in} inputs and {n_out} outputs: a Loop takes a trip count, a condition "
                "and its N carried values, and gives back at least those N: the file is corrupt"
            )
        _arity(label, "body", "inputs", len(body.input), 2 + carried)  # iteration, condition, carried
        _arity(label, "body", "outputs", len(body.output), 1 + n_out)  # condition, carried, scanned
        return
    first = 1 if opset < 9 else 0  # Scan 8 takes the sequence lengths first
    scanned = int(_attr(node, "num_scan_inputs", 0))  # type: ignore[call-overload]
    state = n_in - first - scanned
    if scanned < 1 or state < 0 or n_out < state:
        raise ModelError(
            f"{label} has num_scan_inputs={scanned} with {n_in - first} inputs and {n_out} outputs: a "
            "Scan scans between 1 and all of its inputs, and gives back at least its state values: "
            "the file is corrupt"
        )
    _arity(label, "body", "inputs", len(body.input), state + scanned)
    _arity(label, "body", "outputs", len(body.output), n_out)
    for attr, count in [
        ("scan_input_axes", scanned),
        ("scan_input_directions", scanned),
        ("scan_output_axes", n_out - state),
        ("scan_output_directions", n_out - state),
    ]:
        given = _attr(node, attr, None)
        if given is not None and len(given) != count:  # type: ignore[arg-type]
            raise ModelError(
                f"{label} gives {len(given)} {attr} for {count} values: the file is corrupt"  # type: ignore[arg-type]
            )


def _arity(label: str, graph: str, what: str, got: int, need: int) -> None:
    if got != need:
        raise ModelError(
            f"{label}: its {graph!r} graph has {got} {what} where the node needs {need}: the file is corrupt"
        )


def check_model_safety(
    model: onnx.ModelProto,
    *,
    base_dir: str | os.PathLike | None = None,
    limits: Limits | None = None,
    allowed_functions: Container[str] | Callable[[str], bool] | None = None,
    infer: bool = True,
) -> None:
    """Refuse a model whose sizes, external data or PythonOp nodes are unsafe; see the module doc.

    Checks, in every graph, subgraph, function and training-information graph of the model:

    * at most ``limits.max_subgraphs`` subgraphs (If branches, Loop and Scan bodies), counted first;
    * every text field (names, types, domains, documentation) is valid UTF-8;
    * every stored tensor (initializers, sparse initializers, tensor attributes): no negative
      dimension, declared size within ``limits``, data exactly as large as the declared shape,
      external data only in regular files inside ``base_dir`` (``None``: no external data allowed)
      and large enough; all stored tensors together within ``limits.max_total_bytes``;
    * every declared value type (inputs, outputs, value_info) within ``limits.max_tensor_bytes``;
    * outputs whose size comes from constants (``ConstantOfShape``, ``Expand``, ``Reshape``,
      ``Tile``, ``Range``, ``OneHot``, ``Pad``, ``Resize`` / ``Upsample`` sizes and scales,
      ``MaxUnpool``, ``CenterCropPad``, ``Col2Im`` and its gradient's table, ``DFT``, the window
      ops, ``MelWeightMatrix``, ``AffineGrid``, random generators), following small vectors
      through the shape ops (``Shape``, ``Concat``, ``Gather``, ``Slice``, arithmetic) and through
      both branches of an ``If`` (:func:`~.fold.possible_values`);
    * with ``infer``, every value ONNX shape inference (without data propagation, which itself
      costs memory in proportion to declared sizes) gives a static shape;
    * PythonOp / PythonOpGrad nodes: no raw pointer constants (``input_pointer_scalars``), a class
      name, and, when ``allowed_functions`` is given, a class it allows (else :class:`PythonOpError`).
    """
    limits = limits or default_limits()
    base = None if base_dir is None else os.fspath(base_dir)
    _check_subgraph_count(model, limits)
    _check_text(model)
    total = _sparse_dense_bytes(model, limits)
    for what, tensor in _stored_tensors(model):
        total += _check_tensor(tensor, what, base, limits)
    if total > limits.max_total_bytes:
        raise ModelError(
            f"the model stores {_fmt_bytes(total)} of tensors, over the limit of "
            f"{_fmt_bytes(limits.max_total_bytes)} in all; {_RAISE_LIMIT}"
        )
    for where, graph in _graphs(model):
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            _check_type(vi.type, f"value {vi.name!r}{where}", "is declared with", limits)
    python_nodes = []
    for where, node in _nodes(model):
        if is_python_node(node):
            _check_python_op(node, where, allowed_functions)
            python_nodes.append(node)
        elif node.op_type in ("RandomNormal", "RandomUniform") and node.domain in ("", "ai.onnx"):
            shape = list(_attr(node, "shape", []))
            dtype = _attr(node, "dtype", TensorProto.FLOAT)
            _check_size(shape, dtype, f"{_node_label(node)}{where}", "would create a tensor of", limits)
    warn_rounded_floats(python_nodes)  # once per model checked, naming every such node
    shapes = _inferred_shapes(model, limits) if infer else {}
    _check_computed_sizes(model, model.graph, shapes, limits, {}, "")


# ---- subgraphs -----------------------------------------------------------------------------------
_TRAINING_GRAPHS = ("initialization", "algorithm")  # the graphs of a TrainingInfoProto


def _check_subgraph_count(model: onnx.ModelProto, limits: Limits) -> None:
    """At most ``limits.max_subgraphs`` graphs nested in the model, counted without recursion and
    stopping at the first one over (the depth is bounded by protobuf's parser, the count here)."""
    training = [getattr(t, f) for t in model.training_info for f in _TRAINING_GRAPHS if t.HasField(f)]
    count = len(training)  # training-information graphs count as subgraphs
    pending = [node for root in [model.graph, *model.functions, *training] for node in root.node]
    while pending:
        for attr in pending.pop().attribute:
            graphs = _attr_graphs(attr)
            count += len(graphs)
            if count > limits.max_subgraphs:
                raise ModelError(
                    f"the model holds more than {limits.max_subgraphs} subgraphs (If branches, Loop and "
                    "Scan bodies): each costs a copy and a session of its own. The model is corrupt or "
                    "hostile, or, if it is genuine, raise the limit (onnxgrad.model.Limits(max_subgraphs="
                    "...), or the environment variable ONNXGRAD_MAX_SUBGRAPHS)"
                )
            for g in graphs:
                pending.extend(g.node)


# ---- text ----------------------------------------------------------------------------------------
_TEXT_FIELDS: dict[str, tuple[list[str], list[str]]] = {}  # message type -> (string, message fields)


def _check_text(message: Message, path: str = "model") -> None:
    """Every string field of ``message`` and its sub-messages must be valid UTF-8.

    protobuf (upb) parses proto2 strings without checking them and hands back ``bytes`` for an
    invalid one; code that uses it later fails with UnicodeDecodeError (the checker, a graph
    rename). Bytes fields (tensor data) are not read, so no tensor is copied.
    """
    strings, messages = _text_fields(message)
    for name in strings:
        value = getattr(message, name)
        if isinstance(value, bytes) or (
            not isinstance(value, str) and any(isinstance(v, bytes) for v in value)
        ):
            raise ModelError(f"{path}.{name} is not valid UTF-8 text: the file is corrupt")
    for name in messages:
        value = getattr(message, name)
        if isinstance(value, Message):
            if message.HasField(name):
                _check_text(value, f"{path}.{name}")
        else:
            for i, item in enumerate(value):
                _check_text(item, f"{path}.{name}[{i}]")


def _text_fields(message: Message) -> tuple[list[str], list[str]]:
    key = message.DESCRIPTOR.full_name
    if key not in _TEXT_FIELDS:
        fields = message.DESCRIPTOR.fields
        strings = [f.name for f in fields if f.type == FieldDescriptor.TYPE_STRING]
        messages = [f.name for f in fields if f.type == FieldDescriptor.TYPE_MESSAGE]
        _TEXT_FIELDS[key] = (strings, messages)
    return _TEXT_FIELDS[key]


# ---- stored tensors ----------------------------------------------------------------------------
def _stored_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    """(description, tensor) for every tensor the file stores (sparse ones as values and indices)."""
    for where, graph in _graphs(model):
        for t in graph.initializer:
            yield f"initializer {t.name!r}{where}", t
    for where, node in _nodes(model):
        for attr in node.attribute:
            what = f"attribute {attr.name!r} of {_node_label(node)}{where}"
            if attr.HasField("t"):
                yield what, attr.t
            for i, t in enumerate(attr.tensors):
                yield f"{what}[{i}]", t
    for what, sparse in _sparse_tensors(model):
        yield f"{what} (values)", sparse.values
        yield f"{what} (indices)", sparse.indices


def _sparse_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.SparseTensorProto]]:
    for where, graph in _graphs(model):
        for s in graph.sparse_initializer:
            yield f"sparse initializer {s.values.name!r}{where}", s
    for where, node in _nodes(model):
        for attr in node.attribute:
            sparse = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else list(attr.sparse_tensors)
            for s in sparse:
                yield f"attribute {attr.name!r} of {_node_label(node)}{where}", s


def _sparse_dense_bytes(model: onnx.ModelProto, limits: Limits) -> int:
    """Size of every sparse tensor once densified (onnxruntime densifies sparse initializers)."""
    return sum(
        _check_size(list(s.dims), s.values.data_type, what, "declares", limits)
        for what, s in _sparse_tensors(model)
    )


def _check_tensor(t: TensorProto, what: str, base_dir: str | None, limits: Limits) -> int:
    """Raise on a bad tensor; return its declared size in bytes."""
    if t.data_type not in TensorProto.DataType.values() or t.data_type == TensorProto.UNDEFINED:
        raise ModelError(f"{what} has an unknown element type ({t.data_type}): the file is corrupt")
    dims = list(t.dims)
    nbytes = _check_size(dims, t.data_type, what, "declares", limits)
    if t.data_location == TensorProto.EXTERNAL:
        _check_external(t, what, nbytes, base_dir)
    elif not t.HasField("segment"):  # a tensor split across messages: its parts are not sized here
        _check_data_size(t, what, dims)
    return nbytes


def _check_size(dims: Sequence[int], dtype: int, what: str, verb: str, limits: Limits) -> int:
    """Bytes of a tensor of shape ``dims``; :class:`ModelError` when negative or over the limit."""
    if any(d < 0 for d in dims):
        raise ModelError(f"{what} {verb} a negative dimension in shape {list(dims)}: the file is corrupt")
    nbytes = _nbytes(dtype, math.prod(dims))
    if nbytes > limits.max_tensor_bytes:
        raise ModelError(
            f"{what} {verb} shape {list(dims)} of {dtype_name(dtype)}: {_fmt_bytes(nbytes)}, over "
            f"the limit of {_fmt_bytes(limits.max_tensor_bytes)} per tensor. The model is corrupt "
            f"or hostile, or {_RAISE_LIMIT}"
        )
    return nbytes


_RAISE_LIMIT = (
    "if it is genuine, raise the limit (onnxgrad.model.Limits, or the environment variables "
    "ONNXGRAD_MAX_TENSOR_BYTES / ONNXGRAD_MAX_TOTAL_BYTES)"
)


def _check_data_size(t: TensorProto, what: str, dims: list[int]) -> None:
    """The data stored in the file must be exactly what the declared shape needs."""
    n = math.prod(dims)
    bits = _SUB_BYTE_BITS.get(t.data_type)
    if t.HasField("raw_data"):
        got, unit = len(t.raw_data), "bytes"
        if t.data_type == TensorProto.STRING:
            raise ModelError(f"{what} stores strings as raw bytes, which ONNX forbids: the file is corrupt")
        need = _nbytes(t.data_type, n)
        ok = need <= got <= n if bits else got == need  # sub-byte types: packed or one per byte
    else:
        field = helper.tensor_dtype_to_field(t.data_type)
        got, unit = len(getattr(t, field)), f"{field} values"
        per = 2 if t.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128) else 1
        need = n * per
        ok = -(-n * bits // 32) <= got <= n if bits else got == need
    if not ok:
        raise ModelError(
            f"{what} declares shape {dims} of {dtype_name(t.data_type)} ({need} {unit}) but the "
            f"file holds {got} {unit}: the file is truncated or corrupt"
        )


def file_inside(base_dir: str | os.PathLike, location: Any, what: str) -> str:
    """The path of the file ``location`` inside the folder ``base_dir``, held to the rules of a
    model's external data: a relative path (a string), inside the folder once resolved, not a
    symbolic link, a regular file. ``what`` begins each :class:`ModelError` message ("initializer
    'w' is stored in", "the manifest's files.state is"). Every file of a folder onnxgrad reads
    from outside (external data, an artifacts folder's files) goes through here."""
    base_dir = os.fspath(base_dir)
    if not isinstance(location, str) or not location or "\x00" in location:
        raise ModelError(f"{what} {location!r}, which is not a valid file name")
    if os.path.isabs(location) or os.path.splitdrive(location)[0]:
        raise ModelError(
            f"{what} {location!r}, an absolute path: the file must be a relative path inside the "
            f"folder {base_dir!r}"
        )
    path = os.path.join(base_dir, location)
    if os.path.islink(path):  # even to a file inside the folder: it could be changed to point out
        raise ModelError(f"{what} {location!r}, a symbolic link: refused, copy the file instead")
    real, folder = os.path.realpath(path), os.path.realpath(base_dir)
    if os.path.commonpath([real, folder]) != folder:
        raise ModelError(
            f"{what} {location!r}, which points outside the folder {base_dir!r}: refused (the file "
            "must live in the folder)"
        )
    if not os.path.isfile(path):
        raise ModelError(f"{what} {location!r}, which does not exist in {base_dir!r} as a file")
    return path


def _check_external(t: TensorProto, what: str, nbytes: int, base_dir: str | None) -> None:
    """External data must be a regular file inside ``base_dir``, holding the whole tensor."""
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location", "")
    if not location or "\x00" in location:
        raise ModelError(f"{what} is stored as external data without a valid location: the file is corrupt")
    if base_dir is None:
        raise ModelError(
            f"{what} is stored in the external file {location!r}, but the model was not given as a "
            "path: external data is only read from the model's folder, so load the model from its file"
        )
    path = file_inside(base_dir, location, f"{what} is stored in")
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise ModelError(
            f"{what} has a non-numeric external data offset or length: the file is corrupt"
        ) from None
    if offset < 0 or (length is not None and length != nbytes):
        raise ModelError(
            f"{what} declares {nbytes} bytes but its external data says offset {offset}, length "
            f"{length}: the file is corrupt"
        )
    size = os.path.getsize(path)
    if offset + nbytes > size:
        raise ModelError(
            f"{what} needs {nbytes} bytes at offset {offset} of {location!r}, which has {size} bytes: "
            "the external data file is truncated or does not belong to this model"
        )
    if length is None and offset + nbytes != size:  # onnx then reads the file to its end
        raise ModelError(
            f"{what} gives no length for its external data, and {location!r} holds {size - offset} "
            f"bytes from offset {offset} where the tensor needs {nbytes}: without a length the whole "
            "rest of the file is read. The file does not belong to this model, or add the length "
            "(onnx.external_data_helper writes one)"
        )


def _uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == TensorProto.EXTERNAL for _, t in _stored_tensors(model))


# ---- declared and inferred shapes ---------------------------------------------------------------
def _check_type(tp: onnx.TypeProto, what: str, verb: str, limits: Limits) -> None:
    """Check the tensor shapes inside a type (tensor, sparse tensor, sequence, optional, map)."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        tt = getattr(tp, kind)
        if tt.HasField("shape"):
            # Some exporters write -1 for an unknown dimension: only static sizes count.
            dims = [d.dim_value for d in tt.shape.dim if d.HasField("dim_value") and d.dim_value >= 0]
            _check_size(dims, tt.elem_type, what, verb, limits)
    elif kind in ("sequence_type", "optional_type"):
        _check_type(getattr(tp, kind).elem_type, what, verb, limits)
    elif kind == "map_type":
        _check_type(tp.map_type.value_type, what, verb, limits)


def _inferred_shapes(model: onnx.ModelProto, limits: Limits) -> dict[str, ValueInfo]:
    """Static types ONNX shape inference gives (without data propagation), each size-checked."""
    try:
        inferred = onnx.shape_inference.infer_shapes(without_weights(model), strict_mode=False)
    except Exception:  # a graph inference rejects may still be refused by the checks that follow
        return {}
    shapes: dict[str, ValueInfo] = {}
    for where, graph in _graphs(inferred):
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            _check_type(vi.type, f"value {vi.name!r}{where}", "would have", limits)
            if vi.type.HasField("tensor_type"):
                tt = vi.type.tensor_type
                dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
                shapes[vi.name] = ValueInfo(vi.name, tt.elem_type, dims if tt.HasField("shape") else None)
        for t in graph.initializer:
            shapes[t.name] = ValueInfo(t.name, t.data_type, tuple(t.dims))
    return shapes


def safe_to_propagate_data(model: onnx.ModelProto, max_elements: int = 1 << 20) -> bool:
    """Whether ONNX shape inference with ``data_prop=True`` stays cheap on ``model``.

    onnx (1.23) represents the value of every 1-D value of static length n that reaches an op with a
    data propagator (Add, Sub, Mul, Concat, Gather, Slice, Squeeze...) as n placeholder dimensions:
    about 80-230 bytes per element, whatever the dtype. A float input declared ``[2**30]`` feeding an
    ``Add`` needs hundreds of GB. Float initializers are exempt (onnx reads values only from integer
    ones). This is False when the static lengths of the 1-D values the model declares (pass a
    shape-inferred model to count intermediate values too) and of its 1-D integer initializers add
    up to more than ``max_elements`` (default: at most ~230 MB of placeholders).
    """
    total = 0
    for _, graph in _graphs(model):
        floats = {t.name for t in graph.initializer if t.data_type not in _INT_TYPES}
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
            if vi.name in floats or tt is None or len(tt.shape.dim) != 1:
                continue
            if tt.shape.dim[0].HasField("dim_value"):
                total += max(tt.shape.dim[0].dim_value, 0)
        total += sum(t.dims[0] for t in graph.initializer if t.data_type in _INT_TYPES and len(t.dims) == 1)
        if total > max_elements:
            return False
    return True


# ---- sizes computed from constants --------------------------------------------------------------
def _check_computed_sizes(
    model: onnx.ModelProto,
    graph: onnx.GraphProto,
    shapes: Mapping[str, ValueInfo],
    limits: Limits,
    outer: Mapping[str, list[np.ndarray]],
    where: str,
) -> None:
    """Size of every output whose shape known values give, in ``graph`` and its subgraphs.

    The small values known before running (shapes, repeats, ranges, pads, scales) are those
    :mod:`.fold` follows, initializers that an input may override included (unless fed, they are
    what runs), and each value either branch of an If gives (:func:`~.fold.possible_values`): a node
    is checked with every combination of the values its inputs may take.
    """
    opset = opset_of(model)
    values = possible_values(graph, shapes, opset, outer, overridable=True)
    for node in graph.node:
        if node.domain in ("", "ai.onnx"):
            for chosen in combinations(node.input, values):
                _check_node_size(node, chosen, shapes, limits, where, opset)
        for attr in node.attribute:
            for sub in _attr_graphs(attr):
                inner = f"{where} in the {attr.name!r} graph of node {node.name!r}"
                _check_computed_sizes(model, sub, shapes, limits, values, inner)


def _check_node_size(
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    shapes: Mapping[str, ValueInfo],
    limits: Limits,
    where: str,
    opset: int,
) -> None:
    """Size of the output of a node whose output shape known input values give (a dimension that
    is not static counts as 1: the least a non-empty input gives)."""
    op, ins = node.op_type, node.input

    def known(i: int, kinds: str) -> list | None:
        v = values.get(ins[i]) if len(ins) > i and ins[i] else None
        if v is None or v.ndim > 1 or v.dtype.kind not in kinds:
            return None
        return [e.item() for e in v.reshape(-1)]

    def val(i: int) -> list[int] | None:
        return known(i, "iu")

    def dims_of(i: int, rank: int) -> list[int]:
        """The dims of input ``i`` (unknown ones 1), or ``rank`` ones when its rank is unknown."""
        info = shapes.get(ins[i]) if len(ins) > i and ins[i] else None
        if info is None or info.shape is None:
            return [1] * rank
        return [d if isinstance(d, int) and d >= 0 else 1 for d in info.shape]

    def numel(i: int) -> int:
        return math.prod(dims_of(i, 0))

    def dtype_of(name: str, default: int = TensorProto.UINT8) -> int:
        info = shapes.get(name)
        return info.dtype if info is not None and info.dtype else default

    def on_axes(base: list[int], axes: Sequence[int] | None, new: list[int]) -> list[int] | None:
        """``base`` with ``new[k]`` on axis ``axes[k]`` (all axes when None), or None if they do not fit."""
        axes = list(range(len(new))) if axes is None else [int(a) for a in axes]
        if len(axes) != len(new):
            return None
        if len(base) < len(new):
            base = [1] * len(new)
        out = list(base)
        for a, d in zip(axes, new):
            if not -len(out) <= a < len(out):
                return None
            out[a] = d
        return out

    dims: list[int] | None = None
    extra: list[tuple[str, list[int], int]] = []  # (what, shape, dtype): what building it allocates
    dtype = dtype_of(node.output[0]) if node.output else TensorProto.UINT8
    if op == "ConstantOfShape" and val(0) is not None:
        dims = val(0)
        value = _attr(node, "value", None)
        dtype = value.data_type if value is not None else TensorProto.FLOAT
    elif op in ("Expand", "Reshape") and val(1) is not None:
        dims = [d for d in val(1) if d > 0]  # type: ignore[union-attr]  # 0 and -1 copy or infer
        dtype = dtype_of(ins[0])
    elif op == "Tile" and val(1) is not None:
        dims = [numel(0), *val(1)]  # type: ignore[misc]
        dtype = dtype_of(ins[0])
    elif op == "Range" and all(val(i) is not None and len(val(i)) == 1 for i in range(3)):
        start, limit, delta = (val(i)[0] for i in range(3))  # type: ignore[index]
        dims = [max(-(-(limit - start) // delta), 0)] if delta else None
    elif op == "OneHot" and val(1) is not None and len(val(1)) == 1:  # type: ignore[arg-type]
        dims = [numel(0), val(1)[0]]  # type: ignore[index]
    elif op in ("Resize", "Upsample"):
        dtype = dtype_of(ins[0])
        sizes = val(3) if op == "Resize" and opset >= 11 else None
        scales = known(1 if op == "Upsample" or opset < 11 else 2, "f")
        axes = _attr(node, "axes", None)
        if sizes is not None:
            dims = on_axes(dims_of(0, len(sizes)), axes, sizes)  # type: ignore[arg-type]
        elif scales is not None and all(math.isfinite(f) for f in scales):
            base = dims_of(0, len(scales))
            picked = list(range(len(scales))) if axes is None else list(axes)  # type: ignore[call-overload]
            if len(picked) == len(scales) and all(-len(base) <= a < len(base) for a in picked):
                dims = on_axes(base, picked, [math.floor(base[a] * f) for a, f in zip(picked, scales)])
    elif op == "Pad" and val(1) is not None and len(val(1)) % 2 == 0:  # type: ignore[arg-type]
        pads = val(1)
        half = len(pads) // 2  # type: ignore[arg-type]
        axes = val(3) if len(ins) > 3 and ins[3] else None
        base = dims_of(0, half)
        picked = list(range(half)) if axes is None else axes
        if len(picked) == half and all(-len(base) <= a < len(base) for a in picked):
            grown = [base[a] + pads[k] + pads[half + k] for k, a in enumerate(picked)]  # type: ignore[index]
            dims = on_axes(base, picked, grown)
        dtype = dtype_of(ins[0])
    elif op == "MaxUnpool" and val(2) is not None:
        dims, dtype = val(2), dtype_of(ins[0])
    elif op == "CenterCropPad" and val(1) is not None:
        target = val(1)
        dims = on_axes(dims_of(0, len(target)), _attr(node, "axes", None), target)  # type: ignore[arg-type]
        dtype = dtype_of(ins[0])
    elif op == "Col2Im" and val(1) is not None and val(2) is not None:
        image, block = val(1), val(2)
        x = dims_of(0, 3)
        channels = x[1] // math.prod(block) if len(x) == 3 and all(b > 0 for b in block) else 1  # type: ignore[arg-type]
        dims, dtype = [x[0], max(channels, 1), *image], dtype_of(ins[0])  # type: ignore[misc]
        extra = _col2im_tables(node, image, block)  # type: ignore[arg-type]
    elif op == "DFT" and len(ins) > 1 and val(1) is not None and len(val(1)) == 1:  # type: ignore[arg-type]
        dims, dtype = [val(1)[0], 2], dtype_of(ins[0])  # type: ignore[index]
    elif op in ("HannWindow", "HammingWindow", "BlackmanWindow") and val(0) is not None:
        dims = val(0)
        dtype = int(_attr(node, "output_datatype", TensorProto.FLOAT))  # type: ignore[call-overload]
    elif op == "MelWeightMatrix" and val(0) is not None and val(1) is not None:
        dims = [val(1)[0] // 2 + 1, val(0)[0]] if len(val(0)) == len(val(1)) == 1 else None  # type: ignore[arg-type,index]
        dtype = int(_attr(node, "output_datatype", TensorProto.FLOAT))  # type: ignore[call-overload]
    elif op == "AffineGrid" and val(1) is not None and len(val(1)) >= 3:  # type: ignore[arg-type]
        size = val(1)
        dims, dtype = [size[0], *size[2:], len(size) - 2], dtype_of(ins[0])  # type: ignore[index]
    label = f"{_node_label(node)}{where}"
    if dims is not None and all(d >= 0 for d in dims):
        _check_size(dims, dtype, label, "would create a tensor of", limits)
    for what, shape, kind in extra:
        _check_size(shape, kind, f"{label}{what}", "would create a tensor of", limits)


def _col2im_tables(
    node: onnx.NodeProto, image: list[int], block: list[int]
) -> list[tuple[str, list[int], int]]:
    """The tables of patch positions Col2Im's gradient builds (int64, one per block offset and one
    per offset and sliding position), and a ModelError when the block does not fit the image."""
    k = len(image)
    if len(block) != k or any(b <= 0 for b in block) or any(d < 0 for d in image):
        raise ModelError(
            f"{_node_label(node)} has image_shape {image} and block_shape {block}: they must have the "
            "same length, the block positive sizes: the file is corrupt"
        )
    dil = list(_attr(node, "dilations", None) or [1] * k)  # type: ignore[call-overload]
    pads = list(_attr(node, "pads", None) or [0] * (2 * k))  # type: ignore[call-overload]
    strides = list(_attr(node, "strides", None) or [1] * k)  # type: ignore[call-overload]
    if len(dil) != k or len(pads) != 2 * k or len(strides) != k or min(*dil, *strides) <= 0:
        return []  # onnxruntime refuses the node; its gradient rule is never reached
    padded = [image[i] + pads[i] + pads[k + i] for i in range(k)]
    reach = [dil[i] * (block[i] - 1) + 1 for i in range(k)]
    if any(r > p for r, p in zip(reach, padded)):
        raise ModelError(
            f"{_node_label(node)} has a block_shape {block} that does not fit its padded image "
            f"{padded}: the node cannot run, the file is corrupt"
        )
    slides = math.prod((padded[i] - reach[i]) // strides[i] + 1 for i in range(k))
    return [("'s gradient (its table of patch positions)", [k, math.prod(block), slides], TensorProto.INT64)]


# ---- PythonOp -----------------------------------------------------------------------------------
def python_op_classes(model: onnx.ModelProto) -> list[str]:
    """The Function classes the PythonOp / PythonOpGrad nodes of ``model`` name, each once."""
    names = []
    for _, node in _nodes(model):
        if is_python_node(node):
            name = class_name(node)
            if name:
                names.append(name)
    return list(dict.fromkeys(names))


def check_python_ops(model: onnx.ModelProto, allowed: Container[str] | Callable[[str], bool]) -> None:
    """Raise :class:`PythonOpError` naming the first class of a PythonOp node that ``allowed``
    (a set of names, or a predicate) does not allow, and :class:`ModelError` for pointer constants."""
    for where, node in _nodes(model):
        if is_python_node(node):
            _check_python_op(node, where, allowed)


def _check_python_op(
    node: onnx.NodeProto, where: str, allowed: Container[str] | Callable[[str], bool] | None
) -> None:
    cls = class_name(node)
    label = f"{node.op_type} node {node.name!r}{where}"
    if not cls:
        raise ModelError(f"{label} names no Function class (attribute 'func_name' or 'name')")
    pointers = list(_attr(node, "input_pointer_scalars", []))
    if pointers:
        raise ModelError(
            f"{label} (class {cls!r}) has input_pointer_scalars: they were memory addresses of "
            "Python objects in the process that exported the model, and onnxgrad never turns an "
            "address read from a file into an object. Re-export the model with onnxgrad.export, "
            "which stores None and strings by value and refuses other objects."
        )
    if allowed is None:
        return
    ok = allowed(cls) if callable(allowed) else cls in allowed
    if not ok:
        raise PythonOpError(
            f"{label} names the Function class {cls!r}, which is not registered: onnxgrad runs only "
            "Functions registered with onnxgrad.register_function(cls) and imports nothing because "
            "a model names it. Import the module that defines it yourself and register the class."
        )


# ---- walking the model ---------------------------------------------------------------------------
def _parse(read: Callable[[], onnx.ModelProto]) -> onnx.ModelProto:
    try:
        proto = read()
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ModelError(f"cannot read the model: it is not a valid ONNX file ({exc})") from exc
    if not proto.graph.node and not proto.graph.output:
        raise ModelError("the model has an empty graph: it is not a valid ONNX file")
    return proto


def _attr_graphs(attr: AttributeProto) -> list[onnx.GraphProto]:
    return [attr.g] if attr.HasField("g") else list(attr.graphs)


def _graphs(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """(where, graph) for the main graph and every graph nested in it or in a function."""

    yield "", model.graph
    for node in model.graph.node:
        yield from _node_graphs(node, "")
    for f in model.functions:
        for node in f.node:
            yield from _node_graphs(node, f" in function {f.name!r}")
    for i, info in enumerate(model.training_info):  # not run by onnxgrad, but read by onnx
        for field in _TRAINING_GRAPHS:
            if info.HasField(field):
                where, graph = f" in the {field} graph of training_info[{i}]", getattr(info, field)
                yield where, graph
                for node in graph.node:
                    yield from _node_graphs(node, where)


def _node_graphs(node: onnx.NodeProto, where: str) -> Iterator[tuple[str, onnx.GraphProto]]:
    for attr in node.attribute:
        for sub in _attr_graphs(attr):
            inner = f"{where} in the {attr.name!r} graph of node {node.name!r} ({node.op_type})"
            yield inner, sub
            for n in sub.node:
                yield from _node_graphs(n, inner)


def _nodes(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.NodeProto]]:
    """(where, node) for every node of every graph and function."""
    for where, graph in _graphs(model):
        for node in graph.node:
            yield where, node
    for f in model.functions:
        for node in f.node:
            yield f" in function {f.name!r}", node


def _node_label(node: onnx.NodeProto) -> str:
    if node.name:
        return f"node {node.name!r} ({node.op_type})"
    return f"{'an' if node.op_type[:1] in 'AEIOU' else 'a'} {node.op_type} node"


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _nbytes(dtype: int, n: int) -> int:
    bits = _SUB_BYTE_BITS.get(dtype)
    if bits:
        return -(-n * bits // 8)
    try:
        return n * np_dtype(dtype).itemsize  # strings count as one pointer each
    except Exception:
        return n


def _fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
