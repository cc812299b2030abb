"""Values known before running: what Constant nodes, small initializers and static shapes fix.

Exporters compute axes, shapes and sizes with small graphs of their own (torch's TorchScript
exporter writes ``Constant -> Add -> Mod -> Reshape -> Slice`` for a ``dim=-1`` of
``MultiheadAttention``). ONNX data propagation follows only some ops (not ``Mod``, ``Range``,
``Where``...), so the rank of a ``Reshape`` fed by such a chain stays unknown, and the gradient rules
that need it refuse the graph. :func:`known_values` evaluates those chains with numpy, on tensors of
at most :data:`MAX_ELEMENTS` elements: :func:`fold_for_inference` hands the results to ONNX shape
inference as ``Constant`` nodes (in a copy of the graph used only for inference), and the gradient
builder reads them like initializers (:func:`known_tensors`).

Only the standard domain is evaluated, every op with the meaning ONNX gives it; anything this module
does not handle, or that fails (an index out of range, a division by zero), is simply not known.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph import ValueInfo, np_dtype, subgraphs

# The largest tensor followed (shapes, axes, scalars, small index vectors).
MAX_ELEMENTS = 64
# The most values one value may take that :func:`possible_values` follows (after If branches).
MAX_OPTIONS = 16

_Values = dict[str, np.ndarray]
_Options = dict[str, list[np.ndarray]]

_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Max": np.maximum,
    "Min": np.minimum,
    "Equal": np.equal,
    "Less": np.less,
    "Greater": np.greater,
    "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
}
_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Identity": lambda x: x,
    "Neg": np.negative,
    "Abs": np.abs,
    "Sign": np.sign,
    "Not": np.logical_not,
    "Floor": np.floor,
    "Ceil": np.ceil,
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
}
_COMPARISONS = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Not"}
_REDUCTIONS: dict[str, Callable[..., np.ndarray]] = {
    "ReduceSum": np.sum,
    "ReduceProd": np.prod,
    "ReduceMax": np.max,
    "ReduceMin": np.min,
}
# Ops whose output may be known without known inputs.
_SOURCES = {"Constant", "Shape", "Size"}
# Before these opsets a reduction took its axes as an attribute.
_AXES_INPUT_SINCE = {"ReduceSum": 13, "ReduceProd": 18, "ReduceMax": 18, "ReduceMin": 18}


def constant_of(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a ``Constant`` node (dense tensor, float(s), int(s)), else None."""
    for attr in node.attribute:
        if attr.name == "value" and attr.HasField("t"):
            t = attr.t
            if math.prod(t.dims) > MAX_ELEMENTS:  # a weight held by a Constant: not followed, not copied
                return None
            if t.data_location == TensorProto.EXTERNAL or t.data_type == TensorProto.STRING:
                return None
            try:
                return numpy_helper.to_array(t)
            except Exception:
                return None
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints" and len(attr.ints) <= MAX_ELEMENTS:
            return np.array(list(attr.ints), dtype=np.int64)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats" and len(attr.floats) <= MAX_ELEMENTS:
            return np.array(list(attr.floats), dtype=np.float32)
    return None


def known_values(
    graph: onnx.GraphProto,
    shapes: Mapping[str, ValueInfo],
    opset: int,
    outer: Mapping[str, np.ndarray] | None = None,
    *,
    overridable: bool = False,
) -> _Values:
    """Values of ``graph`` known before running, by name: small ``Constant`` outputs and
    initializers (those also declared as inputs excepted, unless ``overridable``: the caller may
    feed them), and what the nodes compute from them and from the static shapes in ``shapes`` (for
    ``Shape``, ``Size``).

    ``outer``: the known values of the enclosing scopes (for a subgraph).
    """
    found = _follow(graph, shapes, opset, {k: [v] for k, v in (outer or {}).items()}, overridable, None)
    return {name: options[0] for name, options in found.items()}


def possible_values(
    graph: onnx.GraphProto,
    shapes: Mapping[str, ValueInfo],
    opset: int,
    outer: Mapping[str, list[np.ndarray]] | None = None,
    *,
    overridable: bool = False,
    max_options: int = MAX_OPTIONS,
) -> _Options:
    """The values each value of ``graph`` may take that are known before running: what
    :func:`known_values` knows, and, past an ``If`` whose condition is not known, the values either
    branch computes (a branch that computes none adds none). A node reading values with several
    possibilities is evaluated for each combination (:func:`combinations`, at most ``max_options``).

    For bounding what a model may allocate (:mod:`.validate`): a value read from an ``If``'s
    branches is checked for every branch, not ignored. ``outer``: the possibilities of the
    enclosing scopes (for a subgraph).
    """
    return _follow(graph, shapes, opset, dict(outer or {}), overridable, max_options)


def combinations(
    names: Sequence[str], options: Mapping[str, list[np.ndarray]], limit: int = MAX_OPTIONS
) -> Iterator[dict[str, np.ndarray]]:
    """One value for each of ``names`` that ``options`` knows, in every combination, at most
    ``limit`` of them (the first in order): always at least one, empty when none is known."""
    known = [n for n in dict.fromkeys(names) if n in options]
    choices = itertools.product(*(options[n] for n in known))
    for _, chosen in zip(range(max(limit, 1)), choices):
        yield dict(zip(known, chosen))


def _follow(
    graph: onnx.GraphProto,
    shapes: Mapping[str, ValueInfo],
    opset: int,
    outer: _Options,
    overridable: bool,
    max_options: int | None,
) -> _Options:
    """Values of ``graph`` known before running, each with its possibilities: one, unless
    ``max_options`` is given, which follows If branches (:func:`possible_values`)."""
    values: _Options = dict(outer)
    declared = {i.name for i in graph.input}
    for name in declared:
        values.pop(name, None)  # a subgraph input shadows nothing (names are unique), but be safe
    for t in graph.initializer:
        if (t.name in declared and not overridable) or math.prod(t.dims) > MAX_ELEMENTS:
            continue
        if t.data_location == TensorProto.EXTERNAL or t.data_type == TensorProto.STRING:
            continue
        try:
            values[t.name] = [numpy_helper.to_array(t)]
        except Exception:
            continue
    with np.errstate(all="ignore"):
        for node in graph.node:
            if node.domain not in ("", "ai.onnx") or not node.output:
                continue
            if node.op_type == "If" and max_options is not None:
                _follow_branches(node, values, shapes, opset, overridable, max_options)
                continue
            if len(node.output) != 1 or not node.output[0]:
                continue
            if node.op_type not in _SOURCES and not all(i in values for i in node.input if i):
                continue
            found: list[np.ndarray] = []
            for chosen in combinations(node.input, values, max_options or 1):
                try:
                    value = _evaluate(node, chosen, shapes, opset)
                except Exception:  # anything numpy or the op's attributes refuse: not known
                    value = None
                if value is not None and value.size <= MAX_ELEMENTS and value.dtype.kind in "biuf":
                    _add_option(found, np.asarray(value))
            if found:
                values[node.output[0]] = found
    return values


def _follow_branches(
    node: onnx.NodeProto,
    values: _Options,
    shapes: Mapping[str, ValueInfo],
    opset: int,
    overridable: bool,
    max_options: int,
) -> None:
    """Record in ``values`` what each output of the If ``node`` may be: the value its branch
    computes, for the branch the condition picks, or for both when the condition is not known."""
    conditions = values.get(node.input[0], []) if node.input else []
    names = ["then_branch", "else_branch"]
    if len(conditions) == 1 and conditions[0].size == 1:
        names = names[:1] if bool(conditions[0].reshape(-1)[0]) else names[1:]
    for attr in node.attribute:
        if attr.name not in names or not attr.HasField("g"):
            continue
        inner = _follow(attr.g, shapes, opset, values, overridable, max_options)
        for out, branch_out in zip(node.output, attr.g.output):
            for value in inner.get(branch_out.name, []) if out else []:
                options = values.setdefault(out, [])
                if len(options) < max_options:
                    _add_option(options, value)


def _add_option(options: list[np.ndarray], value: np.ndarray) -> None:
    """Append ``value`` to ``options`` unless an equal value (dtype and shape included) is there."""
    if not any(
        o.dtype == value.dtype and o.shape == value.shape and np.array_equal(o, value) for o in options
    ):
        options.append(value)


def known_tensors(
    model: onnx.ModelProto, shapes: Mapping[str, ValueInfo], exclude: set[str]
) -> dict[str, onnx.TensorProto]:
    """The integer and boolean values of the model's main graph that nodes other than ``Constant``
    compute from constants and static shapes (:func:`known_values`), as tensors, for the gradient
    builder to read like initializers. Names in ``exclude`` (overridable values) are left out."""
    opset = _opset(model)
    producers = {n.output[0]: n for n in model.graph.node if len(n.output) == 1}
    found = {}
    for name, value in known_values(model.graph, shapes, opset).items():
        node = producers.get(name)
        if node is None or node.op_type == "Constant" or name in exclude or value.dtype.kind not in "biu":
            continue
        found[name] = numpy_helper.from_array(value, name)
    return found


def fold_for_inference(model: onnx.ModelProto, shapes: Mapping[str, ValueInfo]) -> int:
    """Replace, in ``model`` (a copy made for shape inference, edited in place), every node whose
    output :func:`known_values` knows by a ``Constant`` node holding it, in every graph.

    Returns the number of nodes replaced.
    """
    return _fold_graph(model.graph, shapes, _opset(model), {})


def _fold_graph(graph: onnx.GraphProto, shapes: Mapping[str, ValueInfo], opset: int, outer: _Values) -> int:
    values = known_values(graph, shapes, opset, outer)
    count = 0
    for node in graph.node:
        for sub in subgraphs(node):
            count += _fold_graph(sub, shapes, opset, values)
        if (
            node.domain in ("", "ai.onnx")
            and node.op_type != "Constant"
            and len(node.output) == 1
            and node.output[0] in values
        ):
            value = values[node.output[0]]
            folded = helper.make_node(
                "Constant", [], [node.output[0]], name=node.name, value=numpy_helper.from_array(value)
            )
            node.CopyFrom(folded)
            count += 1
    return count


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 1


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _size_ok(shape: object) -> bool:
    dims = [int(d) for d in np.asarray(shape).reshape(-1)]
    return all(d >= 0 for d in dims) and math.prod(dims) <= MAX_ELEMENTS


def _evaluate(
    node: onnx.NodeProto, values: _Values, shapes: Mapping[str, ValueInfo], opset: int
) -> np.ndarray | None:
    """The output of ``node`` when its inputs are known, else None."""
    op = node.op_type
    if op == "Constant":
        return constant_of(node)
    if op in ("Shape", "Size"):
        info = shapes.get(node.input[0])
        static = None if info is None or info.sequence else info.static_shape
        if static is None:
            return None
        if op == "Size":
            return np.array(math.prod(static), dtype=np.int64)
        rank = len(static)
        start, end = int(_attr(node, "start", 0)), _attr(node, "end", None)  # type: ignore[arg-type]
        stop = rank if end is None else int(end)  # type: ignore[arg-type]
        return np.array(static[slice(*slice(start, stop).indices(rank))], dtype=np.int64)
    ins = [values.get(i) if i else None for i in node.input]
    present = [i for i, name in enumerate(node.input) if name]
    if not node.input or any(ins[i] is None for i in present):
        return None
    x = ins[0]
    if op in _UNARY:
        return _UNARY[op](x)
    if op in _BINARY:
        out = _BINARY[op](x, ins[1])
        return out if op in _COMPARISONS else out.astype(x.dtype)
    if op == "Div":
        return _divide(x, ins[1])
    if op == "Mod":
        y = ins[1]
        if x.dtype.kind in "iu" and np.any(y == 0):
            return None
        fmod = int(_attr(node, "fmod", 0))  # type: ignore[arg-type]
        return (np.fmod(x, y) if fmod else np.mod(x, y)).astype(x.dtype)
    if op == "Cast":
        return x.astype(np_dtype(int(_attr(node, "to"))))  # type: ignore[arg-type]
    if op == "CastLike":
        return x.astype(ins[1].dtype)
    if op == "Where":
        return np.where(x, ins[1], ins[2])
    if op == "Squeeze":
        axes = _axes(node, ins, opset, 13)
        return np.squeeze(x) if axes is None else np.squeeze(x, axis=tuple(int(a) for a in axes))
    if op == "Unsqueeze":
        axes = [int(a) for a in _axes(node, ins, opset, 13)]  # type: ignore[union-attr]
        rank = x.ndim + len(axes)
        out = x
        for a in sorted(a + rank if a < 0 else a for a in axes):
            out = np.expand_dims(out, a)
        return out
    if op == "Reshape":
        if opset < 5:
            return None
        shape = [int(d) for d in ins[1]]
        if not int(_attr(node, "allowzero", 0)):  # type: ignore[arg-type]
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return x.reshape(shape)
    if op == "Flatten":
        axis = int(_attr(node, "axis", 1))  # type: ignore[arg-type]
        axis = axis + x.ndim if axis < 0 else axis
        return x.reshape(math.prod(x.shape[:axis]), -1)
    if op == "Concat":
        return np.concatenate([ins[i] for i in present], axis=int(_attr(node, "axis")))  # type: ignore[arg-type]
    if op == "Gather":
        axis = int(_attr(node, "axis", 0))  # type: ignore[arg-type]
        idx = ins[1].astype(np.int64)
        size = x.shape[axis]
        if np.any((idx < -size) | (idx >= size)):
            return None
        return np.take(x, np.where(idx < 0, idx + size, idx), axis=axis)
    if op == "Slice":
        return _slice(node, x, ins, opset)
    if op == "Transpose":
        perm = _attr(node, "perm")
        return np.transpose(x, None if perm is None else list(perm))  # type: ignore[arg-type]
    if op == "ConstantOfShape":
        if not _size_ok(x):
            return None
        value = _attr(node, "value")
        fill = numpy_helper.to_array(value) if value is not None else np.zeros(1, np.float32)
        return np.full([int(d) for d in x], fill.reshape(-1)[0], dtype=fill.dtype)
    if op == "Range":
        start, limit, delta = (np.asarray(v).reshape(()) for v in ins[:3])
        if delta == 0:
            return None
        count = max(math.ceil((float(limit) - float(start)) / float(delta)), 0)
        if count > MAX_ELEMENTS:
            return None
        return (start + np.arange(count) * delta).astype(start.dtype)
    if op == "Expand":
        shape = np.broadcast_shapes(x.shape, tuple(int(d) for d in ins[1]))
        return np.broadcast_to(x, shape).copy() if _size_ok(shape) else None
    if op == "Tile":
        reps = [int(r) for r in ins[1]]
        return np.tile(x, reps) if _size_ok([*x.shape, *reps]) else None
    if op in _REDUCTIONS:
        axes = _axes(node, ins, opset, _AXES_INPUT_SINCE[op])
        keepdims = bool(_attr(node, "keepdims", 1))
        if axes is None or len(axes) == 0:
            if int(_attr(node, "noop_with_empty_axes", 0)) and axes is not None:  # type: ignore[arg-type]
                return x
            axes = None
        ax = None if axes is None else tuple(int(a) for a in axes)
        return np.asarray(_REDUCTIONS[op](x, axis=ax, keepdims=keepdims)).astype(x.dtype)
    return None


def _axes(node: onnx.NodeProto, ins: list, opset: int, input_since: int) -> np.ndarray | list | None:
    """The ``axes`` of a node: its second input from ``input_since`` on, else its attribute."""
    if opset >= input_since:
        return ins[1] if len(ins) > 1 and ins[1] is not None else None
    return _attr(node, "axes")  # type: ignore[return-value]


def _divide(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    if x.dtype.kind not in "iu":
        return (x / y).astype(x.dtype)
    if np.any(y == 0):
        return None
    q = np.abs(x) // np.abs(y)  # ONNX integer division truncates toward zero
    return (np.sign(x) * np.sign(y) * q).astype(x.dtype)


def _slice(node: onnx.NodeProto, x: np.ndarray, ins: list, opset: int) -> np.ndarray | None:
    if opset < 10:
        starts, ends, axes, steps = _attr(node, "starts"), _attr(node, "ends"), _attr(node, "axes"), None
    else:
        starts, ends = ins[1], ins[2]
        axes = ins[3] if len(ins) > 3 else None
        steps = ins[4] if len(ins) > 4 else None
    if starts is None or ends is None:
        return None
    starts, ends = [int(s) for s in starts], [int(e) for e in ends]  # type: ignore[union-attr]
    axes = list(range(len(starts))) if axes is None else [int(a) for a in axes]  # type: ignore[union-attr]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]  # type: ignore[union-attr]
    out = x
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = axis + x.ndim if axis < 0 else axis
        dim = x.shape[axis]
        start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
        if step > 0:  # ONNX clamps to [0, dim]
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        elif step < 0:  # ... and, stepping backwards, the start to [0, dim - 1], the end to [-1, dim - 1]
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        else:
            return None
        out = np.take(out, np.arange(start, end, step, dtype=np.int64), axis=axis)
    return out
