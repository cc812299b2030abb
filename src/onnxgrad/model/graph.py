"""Describing models: types and shapes of values, versions, names, subgraphs, the ONNX checker.

Everything the engine needs to know about the *input* model lives here, so the engine and the rules
never touch raw protobuf type fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ModelError
from .pythonop_spec import complete_class_names

FLOAT_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE})

# onnxruntime 1.31 loads IR <= 13 and opset <= 26; onnx 1.23 writes IR 14 unless told otherwise.
MAX_IR_VERSION = 13
# The backward graph is written at this opset or the model's, whichever is higher: from 18 on, every
# reduction takes its axes as an input, which keeps the rules free of version branches.
MIN_BACKWARD_OPSET = 18

Dim = int | str | None  # static size, symbolic name, or unknown
# ops whose outputs are random draws (Dropout's mask is random too, but its output is not a draw)
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)


class Shaped:
    """Rank and static shape of anything with a ``shape`` (``None`` when the rank is unknown):
    a :class:`ValueInfo`, or a value of the graph a gradient rule builds (``autodiff.builder.Var``)."""

    __slots__ = ()
    shape: tuple[Dim, ...] | None

    @property
    def rank(self) -> int | None:
        """The number of dimensions, ``None`` when unknown."""
        return None if self.shape is None else len(self.shape)

    @property
    def static_shape(self) -> tuple[int, ...] | None:
        """The shape as ints when every dimension is known, else ``None``."""
        if self.shape is None or not all(isinstance(d, int) for d in self.shape):
            return None
        return tuple(self.shape)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ValueInfo(Shaped):
    """Type of one value: ONNX element type and shape (``None`` when the rank is unknown).

    ``sequence`` marks a sequence of tensors (``dtype`` and ``shape`` are then those of its elements).
    """

    name: str
    dtype: int
    shape: tuple[Dim, ...] | None
    sequence: bool = False

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_TYPES

    def to_proto(self, name: str | None = None) -> onnx.ValueInfoProto:
        shape = None if self.shape is None else [d if d is not None else "" for d in self.shape]
        if shape is not None:
            shape = [None if d == "" else d for d in shape]
        if self.sequence:
            return helper.make_tensor_sequence_value_info(name or self.name, self.dtype, shape)
        return helper.make_tensor_value_info(name or self.name, self.dtype, shape)

    def rank_only(self) -> ValueInfo:
        """The same type with every dimension unknown (symbolic names kept)."""
        if self.shape is None:
            return self
        dims = tuple(d if isinstance(d, str) else None for d in self.shape)
        return ValueInfo(self.name, self.dtype, dims, self.sequence)


def np_dtype(onnx_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))


def dtype_name(onnx_type: int) -> str:
    """The numpy name of an ONNX element type (``"float32"``), else ONNX's own in lower case."""
    try:
        return np_dtype(onnx_type).name
    except Exception:
        return helper.tensor_dtype_to_string(onnx_type).removeprefix("TensorProto.").lower()


def onnx_dtype(dtype: np.dtype | type) -> int:
    """The ONNX element type of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


# Initializers up to this many elements stay in :func:`without_weights` (shapes, axes, scalars).
SMALL_CONSTANT = 64


def without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without the data of its large initializers, declared as inputs of the same type
    and shape instead: what shape inference and the checker need, without copying or serializing
    the weights (on a 24-layer transformer, 3x faster gradient building)."""
    skel = onnx.ModelProto()
    for field in ("ir_version", "opset_import", "functions", "domain", "producer_name"):
        value = getattr(model, field)
        if isinstance(value, int | str):
            setattr(skel, field, value)
        else:
            getattr(skel, field).extend(value)
    g, src = skel.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    g.input.extend(src.input)
    declared = {i.name for i in src.input}
    for t in src.initializer:
        if math.prod(t.dims) <= SMALL_CONSTANT and t.data_location != TensorProto.EXTERNAL:
            g.initializer.append(t)  # small constants: shapes, axes, scalars inference reads
        elif t.name not in declared:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    for sp in src.sparse_initializer:
        if sp.values.name not in declared:
            g.input.append(helper.make_tensor_value_info(sp.values.name, sp.values.data_type, list(sp.dims)))
    return skel


# onnxruntime's own ops of the default domain (opset 1) that the ONNX opset of a model may lack:
# SimplifiedLayerNormalization is in none (onnxruntime-genai's model builder writes it),
# LayerNormalization only from 17 (exporters write it at lower opsets for onnxruntime)
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization", "LayerNormalization"})


def import_used_domains(model: onnx.ModelProto) -> None:
    """Import (version 1) the custom domains that nodes of the main graph use without an import, as
    onnxruntime does: its transformer optimizer writes com.microsoft nodes unimported at opt_level 0."""
    imported = {i.domain for i in model.opset_import}
    for domain in sorted({n.domain for n in model.graph.node} - imported - {"", "ai.onnx"}):
        model.opset_import.append(helper.make_opsetid(domain, 1))


def check_model(model: onnx.ModelProto) -> None:
    """Run the ONNX checker, turning its failures into :class:`ModelError`.

    The weights are left out (:func:`without_weights`): serializing them is most of the checker's
    time, and :mod:`onnxgrad.model.validate` has checked their sizes when the model was loaded. PythonOp
    nodes naming their class by ``func_name`` only are checked as if they had ``name`` too. What
    onnxruntime runs passes: a custom domain its nodes use without importing it (onnxruntime's
    transformer optimizer writes such files at opt_level 0; version 1 is assumed), onnxruntime's own
    default-domain ops (:data:`ORT_DEFAULT_DOMAIN_OPS`).
    """
    skeleton = without_weights(model)
    complete_class_names(skeleton.graph)  # files that name the class by func_name only
    import_used_domains(skeleton)
    try:
        onnx.checker.check_model(skeleton)
    except onnx.checker.ValidationError as exc:
        # onnx deprecates some op versions that onnxruntime still runs (GroupNormalization-18)
        text = str(exc)
        if "is deprecated in domain_version" in text:
            return
        if any(f"No Op registered for {op} with domain_version" in text for op in ORT_DEFAULT_DOMAIN_OPS):
            return
        raise ModelError(f"the model is not valid ONNX: {text}") from exc


def opset_of(model: onnx.ModelProto, domain: str = "") -> int:
    """The opset version the model imports for ``domain`` (0 when not imported)."""
    for imp in model.opset_import:
        if imp.domain in (domain, "ai.onnx" if domain == "" else domain):
            return imp.version
    return 0


def ir_version_for(opsets: Iterable[onnx.OperatorSetIdProto]) -> int:
    """The IR version to write for these opsets: what they need, at most what onnxruntime loads."""
    standard = [helper.make_opsetid("", o.version) for o in opsets if o.domain in ("", "ai.onnx")]
    needed = helper.find_min_ir_version_for(standard, ignore_unknown=True) if standard else 8
    return min(max(needed, 8), MAX_IR_VERSION)


def _shape_of(tt: onnx.TypeProto.Tensor) -> tuple[Dim, ...] | None:
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
    """The :class:`ValueInfo` of a protobuf value info; ``None`` for types other than tensors and
    sequences of tensors."""
    if vi.type.HasField("tensor_type"):
        return ValueInfo(vi.name, vi.type.tensor_type.elem_type, _shape_of(vi.type.tensor_type))
    if vi.type.HasField("sequence_type") and vi.type.sequence_type.elem_type.HasField("tensor_type"):
        tt = vi.type.sequence_type.elem_type.tensor_type
        return ValueInfo(vi.name, tt.elem_type, _shape_of(tt), sequence=True)
    return None


def constant_values(model: onnx.ModelProto | onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Tensors known before running: initializers and outputs of ``Constant`` nodes with a tensor value
    (of the main graph of a model, or of one graph)."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    consts: dict[str, onnx.TensorProto] = {i.name: i for i in graph.initializer}
    for node in graph.node:
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
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    return sort_nodes(list(graph.node), defined)


def sort_nodes(nodes: list[onnx.NodeProto], defined: set[str] | None = None) -> list[onnx.NodeProto]:
    """``nodes`` in dependency order, keeping the given order where it already works.

    With ``defined`` (the graph inputs and initializers), a name that neither it nor a node defines
    is a :class:`ModelError`; without it such names are taken to come from an outer scope.
    """
    known = (defined or set()) | {""}
    producers: dict[str, int] = {}
    for idx, node in enumerate(nodes):
        for out in node.output:
            if out:
                if out in producers or out in known:
                    raise ModelError(
                        f"value {out!r} is defined twice (node {node.name or idx!r}, op {node.op_type})"
                    )
                producers[out] = idx
    order: list[onnx.NodeProto] = []
    state = [0] * len(nodes)  # 0 new, 1 on stack, 2 done
    for start in range(len(nodes)):
        if state[start]:
            continue
        stack = [(start, iter(_node_reads(nodes[start])))]
        state[start] = 1
        while stack:
            idx, it = stack[-1]
            for name in it:
                if name in known:
                    continue
                p = producers.get(name)
                if p is None:
                    if defined is None:
                        continue
                    node = nodes[idx]
                    raise ModelError(
                        f"node {node.name or idx!r} ({node.op_type}) reads {name!r}, which no node, "
                        "input or initializer defines"
                    )
                if state[p] == 1:
                    raise ModelError(f"the graph has a cycle through value {name!r} (node {nodes[p].name!r})")
                if state[p] == 0:
                    state[p] = 1
                    stack.append((p, iter(_node_reads(nodes[p]))))
                    break
            else:
                state[idx] = 2
                order.append(nodes[idx])
                stack.pop()
    return order


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held by a node's attributes (If branches, Loop and Scan bodies), in order."""
    graphs: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            graphs.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            graphs.extend(attr.graphs)
    return graphs


def all_subgraphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """Every graph nested in ``graph``, at any depth."""
    found = []
    for node in graph.node:
        for sub in subgraphs(node):
            found.append(sub)
            found.extend(all_subgraphs(sub))
    return found


def graph_attr(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    """The graph attribute ``name`` of ``node`` (the live message: editing it edits the node)."""
    for attr in node.attribute:
        if attr.name == name and attr.type == onnx.AttributeProto.GRAPH:
            return attr.g
    raise ModelError(f"node {node.name!r} ({node.op_type}) has no graph attribute {name!r}")


def captured_names(node: onnx.NodeProto) -> list[str]:
    """Outer-scope values the node's subgraphs read, each once, in order of first use."""
    names: list[str] = []
    for sub in subgraphs(node):
        names.extend(_free_names(sub))
    return list(dict.fromkeys(names))


def node_operands(node: onnx.NodeProto) -> list[str]:
    """What a node reads: its inputs, then the outer-scope values its subgraphs capture.

    Gradients flow to both: a Loop body that reads a weight from the enclosing graph differentiates
    with respect to it like with respect to an input.
    """
    return [*node.input, *captured_names(node)]


def local_names(graph: onnx.GraphProto) -> set[str]:
    """Values defined in ``graph`` itself (inputs, initializers, node outputs), not in nested graphs."""
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        names.update(o for o in node.output if o)
    return names


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_2``, ``base_3``... the first not in ``taken``; it is added to ``taken``."""
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def all_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name of ``graph`` and of its subgraphs (for choosing fresh names)."""
    names: set[str] = set()
    for g in [graph, *all_subgraphs(graph)]:
        names |= local_names(g)
        names.update(v.name for v in [*g.value_info, *g.output])
    return names


def unique_scope_names(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """Rename, in place, the values a subgraph defines under a name another scope defines too, so
    that every value name of the model is defined once; returns old name -> its new names.

    ONNX lets sibling subgraphs define the same name: optimum's merged decoders hold the decoder
    without past and the one with past as the two branches of an If, each with its own
    ``/transformer/Add_1_output_0`` (an int64 position in one, the float embeddings in the other).
    Whatever keys values by name (types, what the backward saves from a branch) would mix them.
    The first definition met (the main graph first, then the subgraphs in node order) keeps its
    name; a later one becomes ``<name>_2``, ``_3``... in its scope and in the subgraphs nested in it
    that read it. The main graph's names (inputs, outputs, initializers) never change, and an If's
    branch outputs bind by position, so the model computes the same.
    """
    taken = all_names(graph)
    defined: set[str] = set()
    renamed: dict[str, list[str]] = {}

    def visit(g: onnx.GraphProto, outer: dict[str, str]) -> None:
        mapping = dict(outer)
        for name in sorted(local_names(g), key=_definition_order(g)):
            if name in defined:
                mapping[name] = unique_name(name, taken)
                renamed.setdefault(name, []).append(mapping[name])
            else:
                defined.add(name)
                mapping.pop(name, None)  # defined here: not the outer value of that name
        if mapping:
            _apply_names(g, mapping)
        for node in g.node:
            for sub in subgraphs(node):
                visit(sub, mapping)

    visit(graph, {})
    return renamed


def _definition_order(graph: onnx.GraphProto) -> Callable[[str], int]:
    """Sort key: where ``graph`` defines a name (inputs, initializers, then node outputs)."""
    order = [i.name for i in graph.input] + [i.name for i in graph.initializer]
    order += [o for node in graph.node for o in node.output if o]
    first = {}
    for k, name in enumerate(order):
        first.setdefault(name, k)
    return first.__getitem__


def _apply_names(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename the values of ``graph`` itself (not of its subgraphs) by ``mapping``."""
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
    for info in [*graph.input, *graph.output, *graph.value_info]:
        info.name = mapping.get(info.name, info.name)
    for init in graph.initializer:
        init.name = mapping.get(init.name, init.name)


def inputs_read_only_in_branches(graph: onnx.GraphProto) -> set[str]:
    """The inputs of ``graph`` that only If branches read (a Shape node reads no value, only a
    shape, and does not count). Each branch may read such an input under its own contract on its
    dimensions: optimum's merged decoders declare the attention mask as long as ``input_ids``
    (``sequence_length``, the no-past branch's contract), and the cache branch reads one of past +
    new positions."""
    inputs = {i.name for i in graph.input} - {i.name for i in graph.initializer}
    elsewhere: set[str] = set()
    in_branches: set[str] = set()
    for node in graph.node:
        if node.op_type != "Shape":
            elsewhere.update(node.input)
        captured = set(captured_names(node))
        (in_branches if node.op_type == "If" else elsewhere).update(captured)
    return (inputs & in_branches) - elsewhere


def _node_reads(node: onnx.NodeProto) -> list[str]:
    """Names a node reads: its inputs and the outer-scope names its subgraphs use."""
    names = [n for n in node.input if n]
    for sub in subgraphs(node):
        names.extend(_free_names(sub))
    return names


def _free_names(graph: onnx.GraphProto) -> list[str]:
    local = local_names(graph) | {""}
    free = []
    for node in graph.node:
        free.extend(n for n in _node_reads(node) if n not in local)
    return free
