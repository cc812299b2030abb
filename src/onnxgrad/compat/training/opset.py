"""The training model at the base model's opset, as onnxruntime-training 1.19.2 wrote it.

onnxgrad writes a backward at opset 18 or more (:func:`onnxgrad.autodiff.compose.compose` raises
the forward to it). 1.19.2 kept the base model's opset, and onnxruntime's own ORT-format test
asserts it. :func:`lower_opset` writes the composed graph back at an older opset (13 and up) when
every node means the same there: its operator has a definition at that opset that takes its
attributes, inputs and outputs. Two rewrites: the axes of the ``Reduce*`` operators (an input
from opset 18, an attribute before, the values constant) and ``Shape`` with ``start``/``end``
(opset 15) as ``Shape`` then ``Slice``. ``onnx.version_converter``
has no down-adapter for most operators (``Shape``, ``Pow``...), hence this.

The definitions that changed meaning, not only types or optional attributes, between 13 and 18
are refused rather than lowered: ``RoiAlign`` (16 changed the default coordinate mode) and the
``max``/``min`` reductions of ``ScatterElements``/``ScatterND`` (18).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...model.graph import all_names, subgraphs, unique_name

__all__ = ["MIN_OPSET", "lower_opset"]

MIN_OPSET = 13  # ReduceSum's axes an input, Unsqueeze's too, Softmax over one axis
_AXES_INPUT_SINCE_18 = {
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
}  # fmt: skip
_CHANGED_MEANING = {"RoiAlign": 16}  # op -> the opset whose definition means something else


def lower_opset(model: onnx.ModelProto, target: int) -> onnx.ModelProto | str:
    """A copy of ``model`` declaring opset ``target`` for the standard domain, every node meaning
    what it did; or, when a node has no such form at ``target``, the reason (a string)."""
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if current is None or current <= target:
        return model
    if target < MIN_OPSET:
        return f"opset {target} is below {MIN_OPSET}, the oldest the training model can be written at"
    if model.functions:
        return "the model holds local functions"
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    taken = all_names(lowered.graph) | {n.name for n in lowered.graph.node}
    reason = _lower_graph(lowered.graph, current, target, [], taken)
    if reason is not None:
        return reason
    for o in lowered.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = target
    try:
        onnx.checker.check_model(lowered, full_check=True)  # types and shapes at the old definitions
    except Exception as exc:  # onnx's checker raises its own ValidationError / InferenceError
        return f"the graph does not check at opset {target}: {str(exc).splitlines()[0]}"
    return lowered


def _lower_graph(
    graph: onnx.GraphProto, current: int, target: int, outer: list[onnx.GraphProto], taken: set[str]
) -> str | None:
    """Rewrite ``graph``'s nodes (and their subgraphs) for opset ``target``, in place; the reason
    when one cannot be."""
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        if (
            node.op_type == "Shape"
            and target < 15
            and any(a.name in ("start", "end") for a in node.attribute)
        ):
            nodes.extend(_shape_then_slice(node, taken))
            continue
        nodes.append(node)
        what = f"{node.op_type} node {node.name or node.output[0]!r}"
        try:
            old = onnx.defs.get_schema(node.op_type, target, "")
            new = onnx.defs.get_schema(node.op_type, current, "")
        except onnx.defs.SchemaError:
            return f"the {what} has no definition at opset {target}"
        since = _CHANGED_MEANING.get(node.op_type)
        if old.since_version != new.since_version and since is not None and target < since <= current:
            return f"the {what} means something else before opset {since}"
        reduction = next((a.s for a in node.attribute if a.name == "reduction"), b"none")
        if node.op_type in ("ScatterElements", "ScatterND") and reduction in (b"max", b"min") and target < 18:
            return f"the {what} reduces by {reduction.decode()}, which needs opset 18"
        if node.op_type in _AXES_INPUT_SINCE_18 and old.since_version < 18 <= new.since_version:
            reason = _axes_to_attribute(node, [graph, *outer], what)
            if reason is not None:
                return reason
        unknown = [a.name for a in node.attribute if a.name not in old.attributes]
        if unknown:
            return f"the {what} has attributes {unknown}, which opset {target} does not define"
        if not old.min_input <= len(node.input) <= old.max_input or len(node.output) > old.max_output:
            n_in, n_out = len(node.input), len(node.output)
            return f"the {what} has {n_in} inputs and {n_out} outputs, not a form of opset {target}"
        for sub in subgraphs(node):
            reason = _lower_graph(sub, current, target, [graph, *outer], taken)
            if reason is not None:
                return reason
    del graph.node[:]
    graph.node.extend(nodes)
    return None


def _shape_then_slice(node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    """``Shape(x, start, end)`` (opset 15) as ``Slice(Shape(x), [start], [end])``."""
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", np.iinfo(np.int64).max)
    base = node.name or node.output[0]
    full, starts, ends = (unique_name(f"{base}/{k}", taken) for k in ("full", "start", "end"))

    def const(name: str, value: int) -> onnx.NodeProto:
        array = np.array([value], np.int64)
        return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(array))

    return [
        helper.make_node("Shape", [node.input[0]], [full], name=unique_name(f"{base}/shape", taken)),
        const(starts, start),
        const(ends, end),
        helper.make_node("Slice", [full, starts, ends], list(node.output), name=node.name),
    ]


def _axes_to_attribute(node: onnx.NodeProto, scopes: list[onnx.GraphProto], what: str) -> str | None:
    """A ``Reduce*`` node's axes input made the attribute of the older definition."""
    if len(node.input) < 2 or not node.input[1]:
        return None  # no axes: every axis, in both definitions (noop_with_empty_axes aside)
    if any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute):
        return f"the {what} sets noop_with_empty_axes, which opset 17 does not define"
    axes = _constant(node.input[1], scopes)
    if axes is None:
        return f"the {what} reduces over axes computed at run time, an input only from opset 18"
    del node.input[1:]
    node.attribute.append(helper.make_attribute("axes", [int(a) for a in axes.ravel()]))
    return None


def _constant(name: str, scopes: list[onnx.GraphProto]) -> np.ndarray | None:
    """The value of ``name`` when an initializer or a ``Constant`` node of a scope holds it."""
    for g in scopes:
        for t in g.initializer:
            if t.name == name:
                return numpy_helper.to_array(t)
        for n in g.node:
            if n.op_type == "Constant" and n.output[0] == name:
                value = next((a for a in n.attribute if a.name in ("value", "value_ints")), None)
                if value is None:
                    return None
                if value.name == "value_ints":
                    return np.array(value.ints, np.int64)
                return numpy_helper.to_array(value.t)
    return None
