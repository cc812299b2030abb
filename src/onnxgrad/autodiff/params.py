"""Which initializers of a model are its parameters, and which are one parameter stored twice.

Every front end (:func:`~onnxgrad.autodiff.engine.build_gradient`, ``ForwardBackward``,
``OnnxModule``, the compat and scikit-learn layers, ``onnxgrad info``) chooses what to train with
:func:`select_parameters`.

**The default set** (``trainable=None``) is what a user would call the model's parameters. Exporters
store much more than weights as initializers: exponents, epsilons, shapes, masks, scales. An
initializer is judged by how the graph *uses* it, not by its name, and is left out, with a reason,
when (first rule that applies):

1. it is not floating-point (``"integer"``, ``"bool"``...): never trainable, even when named;
2. the exporter marked it as a buffer or a constant of the source model (torch.export's input kind,
   kept by ``torch.onnx.export(dynamo=True)`` in some saves): ``"torch buffer"``;
3. every op that reads it does so in a slot that takes a constant, not a weight (one read as a
   weight makes it a parameter): a ``Pow`` exponent, a ``Clip``
   bound, a ``Reshape``/``Expand`` shape, ``Range`` arguments, a ``Pad`` or ``ConstantOfShape``
   value, ``Dropout``'s ratio, ``Resize`` scales, a ``BatchNormalization`` running statistic,
   quantization scales, an RNN's initial state (table :data:`CONSTANT_SLOTS`);
4. it has one value and is added to the result of a reduction or a square root (the epsilon of a
   hand-written normalization): ``"epsilon"``;
5. it is read by elementwise ops only and holds a mask: only 0 and very negative values (at most
   -1e4, or -inf) added to scores (``"additive mask"``), or only 0 and 1 multiplied
   (``"0/1 mask"``); or it is only multiplied and is a rotary position table that the exporter
   folded from a buffer (RoPE's cos and sin: values in [-1, 1], the row of position 0, along
   axis -2, all ones or all zeros): ``"rotary position table"``; or it holds RoPE's inverse
   frequencies unfolded (a model exported with dynamic positions: ``1, r, r^2...`` with
   ``0 < r < 1``, multiplied by positions cast from integers): ``"rotary inverse frequencies"``;
6. it has one value and every elementwise op that reads it broadcasts it along a last dimension
   longer than 1 (a scale or offset, ``x * 0.5``), or along a symbolic one (a sequence length)
   where another op reads it along a static one longer than 1 (the attention scale of a key
   transposed to (..., head size, past + sequence)): ``"scalar constant"``. One value against a
   last dimension of 1 or unknown is kept: that is the bias of a one-output linear layer. Boolean
   ops (a value cast to bool, then And-ed) take no gradient and do not count; a value read by
   them alone is ``"read as a boolean"``.

An initializer no node reads stays in the set (its gradient is zero).

Rules 4 to 6 are the value/rank/size heuristics: they apply only to values that the usage leaves
ambiguous (elementwise operands). Usage is read through ops that pass a value on unchanged but
for its type or layout (``Identity``, ``Cast``, ``CastLike``, ``Reshape``, ``Unsqueeze``,
``Squeeze``, ``Flatten``, ``Expand``, ``Transpose``): a scalar cast and then multiplied is a
scalar constant. A learned scalar gain (``alpha * x`` with one ``alpha``) is thus
left out by default; name it in ``trainable=`` to train it. Any floating-point initializer can be
named explicitly.

**Tied weights.** Exporters fold a transposed copy of a tied embedding (GPT-2's ``lm_head``), so the
file holds two initializers for one parameter. Two floating-point initializers are *one parameter*
when one is bit-equal to the other, to a transpose of it, to a cast of it, or to a cast of a
transpose of it; and both have at least :data:`TIE_MIN_SIZE` values, not all equal (small and
constant tensors, such as zero biases or LayerNorm weights at initialization, are equal by
accident); and neither is a graph input (those can be fed at run time). With ``tie_weights=True``
(the default) such a group is trained as one: the first member (in initializer order, among those
the others can be computed from, preferring one named in ``trainable=``) stays the parameter and
the others are computed from it by ``Identity``/``Transpose``/``Cast`` nodes, so the gradients of
every use add up, as in torch. :func:`untie` turns those nodes back into initializers (what
``to_onnx()`` returns). A group is tied when one of its members is trainable.

**Broadcast copies.** Constant folding also stores a parameter expanded over a batch or a sequence
(BERT's token-type row repeated for every token, ViT's ``cls_token`` for every image, BART's position
rows for every sequence). An initializer ``B`` is *one parameter* with ``A`` when ``B`` equals,
bit for bit, ``np.broadcast_to`` of ``A`` or of a contiguous block of its rows (``A[k:k+n]``, one row
or more), reshaped as needed: every axis of ``B`` along which it repeats holds exact copies, ``B`` is
strictly larger than that core, the core holds at least :data:`BROADCAST_MIN_DISTINCT` distinct
values, both have the same type, ``A`` is itself no broadcast (repeats along no axis) nor the copy
of another initializer, and ``B`` is in no group of equal, transposed or cast copies. ``B`` is then
computed from ``A`` by ``Slice``/``Reshape``/``Expand`` nodes (its gradient sums over the copies
back into ``A``, as torch's does) and :func:`untie` writes it back.
When no initializer holds the core (the exporter folded the parameter away: ViT's ``cls_token`` is
stored only as ``expand``, 2x1x32), the core becomes a new initializer, ``B_core`` (``B`` cut to
length 1 along its repeated axes), which is the parameter; :func:`untie` writes ``B`` back and drops
``B_core``. Types must match exactly (no cast).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import InputError
from ..model.graph import FLOAT_TYPES, np_dtype, subgraphs, to_array, unique_name
from ..model.infer import infer_value_infos

TIE_MIN_SIZE = 256
"""The fewest values an initializer needs to be tied to another (smaller ones agree by accident)."""

BROADCAST_MIN_DISTINCT = 16
"""The fewest distinct values the core of a broadcast copy needs (see the module's documentation)."""

MASK_NEGATIVE = -1e4
"""Additive masks hold 0 and values at most this (or -inf)."""

# op type -> {input slot: reason}: slots that take a constant, not a weight
CONSTANT_SLOTS: dict[str, dict[int, str]] = {
    "Pow": {1: "Pow exponent"},
    "Clip": {1: "Clip bound", 2: "Clip bound"},
    "Reshape": {1: "Reshape shape"},
    "Expand": {1: "Expand shape"},
    "Tile": {1: "Tile repeats"},
    "ConstantOfShape": {0: "ConstantOfShape shape"},
    "Range": {0: "Range arguments", 1: "Range arguments", 2: "Range arguments"},
    "Slice": {1: "Slice arguments", 2: "Slice arguments", 3: "Slice arguments", 4: "Slice arguments"},
    "Pad": {1: "Pad pads", 2: "Pad value", 3: "Pad axes"},
    "Dropout": {1: "Dropout ratio", 2: "Dropout training mode"},
    "Resize": {1: "Resize roi", 2: "Resize scales", 3: "Resize sizes"},
    "Upsample": {1: "Upsample scales"},
    "BatchNormalization": {3: "BatchNormalization running mean", 4: "BatchNormalization running variance"},
    "QuantizeLinear": {1: "quantization scale", 2: "quantization zero point"},
    "DequantizeLinear": {1: "quantization scale", 2: "quantization zero point"},
    "DynamicQuantizeLinear": {},
    "OneHot": {1: "OneHot depth", 2: "OneHot values"},
    "LSTM": {4: "sequence lengths", 5: "RNN initial state", 6: "RNN initial state"},
    "GRU": {4: "sequence lengths", 5: "RNN initial state"},
    "RNN": {4: "sequence lengths", 5: "RNN initial state"},
    "Trilu": {1: "Trilu diagonal"},
    "TopK": {1: "TopK k"},
    "CumSum": {1: "CumSum axis"},
    "Where": {0: "Where condition"},
    "NonMaxSuppression": {2: "NMS arguments", 3: "NMS arguments", 4: "NMS arguments"},
    # integer slots: such initializers are never trainable, these say what they are
    "Squeeze": {1: "axes"},
    "Unsqueeze": {1: "axes"},
    "Split": {1: "split sizes"},
    "Gather": {1: "indices"},
    "GatherElements": {1: "indices"},
    "GatherND": {1: "indices"},
    "ScatterND": {1: "indices"},
    "ScatterElements": {1: "indices"},
}
for _op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare",
            "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp"):  # fmt: skip
    CONSTANT_SLOTS[_op] = {1: "axes"}

# ops whose operands are combined elementwise (with broadcasting): usage leaves them ambiguous
_BOOLEAN_OPS = {"And", "Or", "Xor", "Not"}  # their inputs are bool: no gradient reaches a float there
ELEMENTWISE = {
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Mean", "Sum", "Where", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Mod", "Pow",
}  # fmt: skip

# producers of a variance or a norm, to which an epsilon is added
_NORM_PRODUCERS = {
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceL1", "Sqrt", "ReduceLogSumExp",
}  # fmt: skip

_TORCH_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"


@dataclass(frozen=True)
class Tie:
    """``name`` is ``source``, transposed by ``perm`` (when given), cast to ``to`` (when given); or
    for a broadcast copy: rows ``rows[0]:rows[1]`` of ``source`` (when given), reshaped to ``shape``
    (when given), expanded to ``expand``."""

    name: str
    source: str
    perm: tuple[int, ...] | None = None
    to: int | None = None
    rows: tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None
    expand: tuple[int, ...] | None = None
    made: bool = False  # source is a new initializer: the core of ``name``, made by tie_parameters

    def core(self, value: np.ndarray) -> np.ndarray:
        """For a ``made`` tie: the source's value, from the value of ``name``."""
        assert self.shape is not None
        return np.ascontiguousarray(value[tuple(slice(0, d) for d in self.shape)])

    @property
    def how(self) -> str:
        parts = []
        if self.rows is not None:
            parts.append(f"rows {self.rows[0]}:{self.rows[1]}")
        if self.shape is not None and not self.made:
            parts.append(f"reshape {list(self.shape)}")
        if self.expand is not None:
            parts.append(f"expand to {list(self.expand)}")
        if self.perm is not None:
            parts.append(f"transpose {list(self.perm)}")
        if self.to is not None:
            parts.append(f"cast to {_dtype_name(self.to)}")
        return " then ".join(parts) or "identical"

    def compute(self, value: np.ndarray) -> np.ndarray:
        """This tied value, from the value of ``source``."""
        if self.rows is not None:
            value = value[self.rows[0] : self.rows[1]]
        if self.shape is not None:
            value = value.reshape(self.shape)
        if self.expand is not None:
            value = np.broadcast_to(value, self.expand)
        if self.perm is not None:
            value = np.transpose(value, self.perm)
        if self.to is not None:
            value = value.astype(np_dtype(self.to))
        return np.ascontiguousarray(value)


@dataclass
class Selection:
    """The result of :func:`select_parameters`.

    ``model``: the model, with tied initializers computed from their parameter (a copy; the input
    model when nothing was tied). ``trainable``: the names to train. ``reasons``: for every
    initializer left out of the default set, why. ``ties``: the initializers now computed from a
    parameter.
    """

    model: onnx.ModelProto
    trainable: list[str]
    reasons: dict[str, str] = field(default_factory=dict)
    ties: list[Tie] = field(default_factory=list)

    @property
    def groups(self) -> dict[str, list[Tie]]:
        """Parameter -> the initializers computed from it."""
        out: dict[str, list[Tie]] = {}
        for t in self.ties:
            out.setdefault(t.source, []).append(t)
        return out


# ---- the default set -----------------------------------------------------------------------------
def _uses(graph: onnx.GraphProto, names: set[str]) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    """For each of ``names``: the (node, input slot) pairs that read it, in subgraphs too (a value a
    subgraph captures counts with the node and slot that read it inside)."""
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {n: [] for n in names}

    def walk(g: onnx.GraphProto, visible: set[str]) -> None:
        for node in g.node:
            for k, i in enumerate(node.input):
                if i in visible:
                    uses[i].append((node, k))
            for sub in subgraphs(node):
                made = {o for n in sub.node for o in n.output}
                local = {i.name for i in sub.input} | {i.name for i in sub.initializer} | made
                walk(sub, (visible - local) | (made & names))  # its own values, when asked for

    walk(graph, set(names))
    return uses


# ops that pass a value on unchanged but for its type, shape or layout (input 0): an initializer
# read through them is judged by what reads their output
_TRANSPARENT = {
    "Identity", "Cast", "CastLike", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose",
}  # fmt: skip


def _all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    """The nodes of ``graph`` and of its subgraphs, at any depth."""
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from _all_nodes(sub)


def _through(
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]], name: str, seen: set[str]
) -> list[tuple[onnx.NodeProto, int]]:
    out = []
    for node, k in consumers.get(name, []):
        passes = k == 0 and node.domain in ("", "ai.onnx") and node.op_type in _TRANSPARENT
        if passes and node.output and node.output[0] in consumers:
            if node.output[0] not in seen:
                seen.add(node.output[0])
                out.extend(_through(consumers, node.output[0], seen))
        else:
            out.append((node, k))
    return out


def _dtype_name(data_type: int) -> str:
    return helper.tensor_dtype_to_string(data_type).removeprefix("TensorProto.").lower()


def _kind(t: TensorProto) -> str:
    name = _dtype_name(t.data_type)
    if name.startswith(("int", "uint")):
        return f"integer ({name})"
    return f"not floating-point ({name})"


def parameter_reasons(model: onnx.ModelProto) -> dict[str, str | None]:
    """For every initializer of ``model``'s main graph: ``None`` if it is a parameter (part of the
    default trainable set), else why not (see the module's documentation for the rules)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    nodes = list(_all_nodes(graph))  # an If's branches read the main graph's initializers too
    values = set(inits) | {o for n in nodes for o in n.output if o}
    consumers = _uses(graph, values)
    uses = {n: _through(consumers, n, set()) for n in inits}
    producer = {o: n for n in nodes for o in n.output}
    infos: dict | None = None
    reasons: dict[str, str | None] = {}
    declared = declared_trainable(model)
    for name, t in inits.items():
        if declared is not None and name not in declared:  # the model names its parameters
            reasons[name] = "frozen (not in the model's onnxgrad.trainable)"
            continue
        if t.data_type not in FLOAT_TYPES:  # never trainable; the usage, when it says more
            slot = next((r for r in (_slot_reason(n, k) for n, k in uses[name]) if r), None)
            reasons[name] = _kind(t) if slot is None else f"{slot} ({_dtype_name(t.data_type)})"
            continue
        kind = next((p.value for p in t.metadata_props if p.key == _TORCH_KIND), None)
        if kind in ("BUFFER", "CONSTANT_TENSOR"):
            reasons[name] = "torch buffer" if kind == "BUFFER" else "torch constant"
            continue
        # every read in a constant slot: exporters alias equal initializers (the TorchScript one
        # reads a BatchNormalization's ones running variance through Identity of its ones weight),
        # so one read as a weight makes a parameter
        slots = [_slot_reason(n, k) for n, k in uses[name]]
        reason = slots[0] if slots and all(slots) else None
        used = [(n, k) for n, k in uses[name] if n.op_type not in _BOOLEAN_OPS]
        if reason is None and uses[name] and not used:
            reason = "read as a boolean"
        if reason is None and used:
            reason = _inverse_frequencies(t, used, producer)
        if reason is None and used:
            ambiguous = all(n.domain in ("", "ai.onnx") and n.op_type in ELEMENTWISE for n, _ in used)
            size = int(np.prod(t.dims, dtype=np.int64))
            if ambiguous:
                if size == 1 and _is_epsilon(name, used, producer):
                    reason = "epsilon"
                else:
                    reason = _mask(t, used) or _rotary(t, used)
                if reason is None and size == 1:
                    if infos is None:
                        infos = infer_value_infos(model)
                    if _broadcast(name, t, used, infos):
                        reason = "scalar constant"
        reasons[name] = reason
    return reasons


# A model may name its default trainable set itself, as a JSON list of initializer names in this
# metadata_props key (onnxgrad.lora.add_adapters writes it: the adapters, the base frozen). Those
# names are never tied to one another (LoRA's B matrices all start at zero, equal but separate).
TRAINABLE_KEY = "onnxgrad.trainable"


def declared_trainable(model: onnx.ModelProto) -> list[str] | None:
    """The initializer names ``model`` declares as its default trainable set, or ``None``."""
    import json

    for p in model.metadata_props:
        if p.key == TRAINABLE_KEY:
            try:
                names = json.loads(p.value)
            except ValueError as exc:
                raise InputError(f"metadata {TRAINABLE_KEY!r} is not a JSON list of names: {exc}") from exc
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise InputError(f"metadata {TRAINABLE_KEY!r} is not a JSON list of names")
            return names
    return None


def _slot_reason(node: onnx.NodeProto, k: int) -> str | None:
    if node.domain not in ("", "ai.onnx"):
        return None
    return CONSTANT_SLOTS.get(node.op_type, {}).get(k)


def _is_epsilon(name: str, uses: list[tuple[onnx.NodeProto, int]], producer: dict) -> bool:
    for node, k in uses:
        if node.op_type != "Add" or len(node.input) != 2:
            return False
        other = producer.get(node.input[1 - k])
        if other is None or other.op_type not in _NORM_PRODUCERS:
            return False
    return True


def _mask(t: TensorProto, uses: list[tuple[onnx.NodeProto, int]]) -> str | None:
    ops = {n.op_type for n, _ in uses}
    if not ops <= {"Add", "Sub", "Mul", "Where"}:
        return None
    value = to_array(t)
    if value.size < 2:
        return None
    if ops <= {"Add", "Sub", "Where"}:
        zero, low = value == 0, (value <= MASK_NEGATIVE)  # -inf is <= too
        if zero.any() and low.any() and (zero | low).all():
            return "additive mask"
    if ops <= {"Mul", "Where"}:
        zero, one = value == 0, value == 1
        if zero.any() and one.any() and (zero | one).all():
            return "0/1 mask"
    return None


def _rotary(t: TensorProto, uses: list[tuple[onnx.NodeProto, int]]) -> str | None:
    """A rotary position table (RoPE's cos or sin, folded from the inverse frequencies): multiplied
    only, every value in [-1, 1], the row of position 0 (axis -2) all 1 (cos 0) or all 0 (sin 0)
    while the next row is not constant."""
    if len(t.dims) < 2 or t.dims[-2] < 2 or t.dims[-1] < 2 or any(n.op_type != "Mul" for n, _ in uses):
        return None
    value = to_array(t)
    first, second = np.take(value, 0, axis=-2), np.take(value, 1, axis=-2)
    if not (np.abs(value) <= 1).all() or (second == second.flat[0]).all():
        return None
    if (first == 1).all() or (first == 0).all():
        return "rotary position table"
    return None


def _inverse_frequencies(
    t: TensorProto, uses: list[tuple[onnx.NodeProto, int]], producer: dict
) -> str | None:
    """RoPE's inverse frequencies (``base ** (-2i / d)``: 1, then a constant ratio below 1), every
    read a MatMul or Mul by positions cast from integers."""
    for node, k in uses:
        if node.op_type not in ("MatMul", "Mul") or len(node.input) != 2:
            return None
        other = producer.get(node.input[1 - k])
        if other is None or other.op_type != "Cast":
            return None
    value = to_array(t).astype(np.float64).ravel()
    if value.size < 2 or value[0] != 1 or not ((value > 0) & (value < 1))[1:].all():
        return None
    ratios = value[1:] / value[:-1]
    return "rotary inverse frequencies" if np.allclose(ratios, ratios[0], rtol=1e-4) else None


def _broadcast(name: str, t: TensorProto, uses: list[tuple[onnx.NodeProto, int]], infos: dict) -> bool:
    """Whether every elementwise use spreads the one value of ``t`` along a last dim longer than 1,
    or along a symbolic one when some use has a static one longer than 1."""
    if len(t.dims) == 0:
        return True
    static = False
    for node, k in uses:
        others = [i for j, i in enumerate(node.input) if j != k and i]
        if node.op_type == "Where":
            others = [i for j, i in enumerate(node.input) if j not in (0, k) and i]
        last = []
        for o in others:
            info = infos.get(o)
            if info is not None and info.shape:
                last.append(info.shape[-1])
        if any(isinstance(d, int) and d > 1 for d in last):
            static = True
        elif not any(isinstance(d, str) for d in last):
            return False
    return static


def default_trainable(model: onnx.ModelProto) -> list[str]:
    """The default trainable set of ``model`` (before tying): its parameters, in initializer order."""
    return [n for n, r in parameter_reasons(model).items() if r is None]


# ---- tied weights --------------------------------------------------------------------------------
Extremes = tuple[np.generic, np.generic]  # (minimum, maximum) of a tensor


def find_ties(model: onnx.ModelProto, candidates: Iterable[str], prefer: Iterable[str] = ()) -> list[Tie]:
    """Ties among ``candidates`` (initializer names): for each group of initializers that are one
    parameter, one :class:`Tie` per member computed from the group's parameter."""
    graph = model.graph
    declared = {i.name for i in graph.input}
    inits = {i.name: i for i in graph.initializer}
    wanted = [n for n in dict.fromkeys(candidates) if n in inits and n not in declared]
    order = {n: k for k, n in enumerate(inits)}
    prefer = list(prefer)
    values: dict[str, np.ndarray] = {}
    extremes: dict[str, Extremes] = {}  # (min, max): a cheap reject of most pairs
    buckets: dict[tuple, list[str]] = {}
    for n in wanted:
        t = inits[n]
        if t.data_type not in FLOAT_TYPES or int(np.prod(t.dims, dtype=np.int64)) < TIE_MIN_SIZE:
            continue
        v = to_array(t)
        flat = v.ravel()
        if not np.isfinite(flat).all() or (flat == flat[0]).all():
            continue
        values[n] = v
        extremes[n] = (flat.min(), flat.max())
        buckets.setdefault(tuple(sorted(t.dims)), []).append(n)
    ties: list[Tie] = []
    for names in buckets.values():
        if len(names) < 2:
            continue
        # pairs (a, b) where b is computed exactly from a
        derive: dict[tuple[str, str], Tie] = {}
        for a, b in _candidate_pairs(names, extremes):
            back = derive.get((b, a))
            if back is not None and back.to is None:  # a transpose or a copy goes both ways
                perm = None if back.perm is None else tuple(int(i) for i in np.argsort(back.perm))
                derive[(a, b)] = Tie(b, a, perm)
                continue
            tie = _derivation(a, values[a], b, values[b], inits[a].data_type, inits[b].data_type)
            if tie is not None:
                derive[(a, b)] = tie
        ties.extend(_groups(names, derive, order, prefer))
    ties.extend(_broadcast_ties(model, wanted, ties, order, prefer, values))
    return ties


def _bits(v: np.ndarray) -> np.ndarray:
    return v.view(np.dtype(f"u{v.dtype.itemsize}"))


def _core(v: np.ndarray) -> tuple[np.ndarray, bool]:
    """``v`` (as bits) with every axis along which it repeats exactly cut to length 1, and whether
    there was one."""
    core = _bits(v)
    repeated = False
    for axis in range(core.ndim):
        if core.shape[axis] < 2:
            continue
        first = core[(slice(None),) * axis + (slice(0, 1),)]
        second = core[(slice(None),) * axis + (slice(1, 2),)]
        if first.flat[0] != second.flat[0] or not np.array_equal(first, second):  # cheap rejects
            continue
        if np.array_equal(core, np.broadcast_to(first, core.shape)):
            core, repeated = first, True
    return core, repeated


def _broadcast_ties(
    model: onnx.ModelProto,
    wanted: list[str],
    ties: list[Tie],
    order: dict[str, int],
    prefer: list[str],
    cache: dict[str, np.ndarray],
) -> list[Tie]:
    """Ties of initializers that are a broadcast of another's rows (see the module's documentation)."""
    inits = {i.name: i for i in model.graph.initializer}
    taken = set(inits) | {i.name for i in model.graph.input} | {o for n in model.graph.node for o in n.output}
    grouped = {t.name for t in ties} | {t.source for t in ties}
    copies = {t.name for t in ties}
    values: dict[str, np.ndarray] = {}
    cores: dict[str, np.ndarray] = {}
    for n in wanted:
        t = inits[n]
        if t.data_type not in FLOAT_TYPES or int(np.prod(t.dims, dtype=np.int64)) < BROADCAST_MIN_DISTINCT:
            continue
        v = cache.get(n)  # checked already (finite, not all equal)
        if v is None:
            v = to_array(t)
            if v.ndim == 0 or not np.isfinite(v).all():
                continue
        core, repeated = _core(v)
        values[n] = v
        if repeated:
            cores[n] = core
    rank = {n: (prefer.index(n) if n in prefer else len(prefer), order[n]) for n in values}
    sources = sorted((n for n in values if n not in cores and n not in copies), key=lambda n: rank[n])
    out: list[Tie] = []
    for b, core in cores.items():
        if b in grouped or np.unique(core).size < BROADCAST_MIN_DISTINCT:
            continue
        flat = core.ravel()
        matched = False
        for a in sources:
            va = values[a]
            if va.dtype != values[b].dtype or va.size < flat.size:
                continue
            row = va.size // va.shape[0]
            if flat.size % row:
                continue
            n_rows = flat.size // row
            table = _bits(va).reshape(va.shape[0], row)
            found = None
            for k in np.flatnonzero(table[: va.shape[0] - n_rows + 1, 0] == flat[0]):
                if np.array_equal(table[k : k + n_rows].ravel(), flat):
                    found = int(k)
                    break
            if found is None:
                continue
            matched = True
            rows = None if n_rows == va.shape[0] else (found, found + n_rows)
            shape = None if tuple(core.shape) == (n_rows, *va.shape[1:]) else tuple(core.shape)
            out.append(Tie(b, a, rows=rows, shape=shape, expand=tuple(values[b].shape)))
            break
        if not matched:  # no initializer holds the core: it becomes a new one, the parameter
            source = unique_name(f"{b}_core", taken)
            out.append(Tie(b, source, shape=tuple(core.shape), expand=tuple(values[b].shape), made=True))
    return out


def _candidate_pairs(names: list[str], extremes: dict[str, Extremes]) -> list[tuple[str, str]]:
    """The ordered pairs of ``names`` (in the order of ``itertools.permutations``) that may be one
    parameter: their extremes match (:func:`_same_extremes`). Pairs of one dtype are found by
    grouping on the extremes' bits, so a model's many same-shaped weights cost no pairwise work."""
    index = {n: k for k, n in enumerate(names)}
    groups: dict[tuple[str, bytes, bytes], list[str]] = {}
    for n in names:
        lo, hi = extremes[n]
        groups.setdefault((lo.dtype.str, lo.tobytes(), hi.tobytes()), []).append(n)
    pairs = [p for group in groups.values() for p in itertools.permutations(group, 2)]
    if len({extremes[n][0].dtype for n in names}) > 1:  # casts: across dtypes, compared in pairs
        pairs += [
            (a, b)
            for a, b in itertools.permutations(names, 2)
            if extremes[a][0].dtype != extremes[b][0].dtype and _same_extremes(extremes[a], extremes[b])
        ]
    return sorted(pairs, key=lambda p: (index[p[0]], index[p[1]]))


def _same_extremes(a: Extremes, b: Extremes) -> bool:
    """Whether a tensor of extremes ``a`` can be a transpose or a cast of one of extremes ``b``.

    Transposing keeps the minimum and the maximum, and a cast rounds monotonically, so the cast of
    the extremes are the extremes of the cast: unequal extremes rule a pair out without looking at
    the tensors (the comparison of a 24-layer model's 96 same-shaped weights went from 0.7 s to
    milliseconds). A dtype numpy cannot cast between says nothing: the pair is compared in full.
    """
    (lo_a, hi_a), (lo_b, hi_b) = a, b
    try:
        with np.errstate(all="ignore"):  # a cast may overflow to inf: then unequal, as it should
            lo, hi = np.asarray(lo_a).astype(lo_b.dtype), np.asarray(hi_a).astype(hi_b.dtype)
        return bool(lo == lo_b and hi == hi_b)
    except (TypeError, ValueError):
        return True


_SAMPLE = 64  # elements compared before whole tensors


def _derivation(a: str, va: np.ndarray, b: str, vb: np.ndarray, ta: int, tb: int) -> Tie | None:
    """The tie computing ``b`` from ``a`` bit for bit, or None."""
    to = None if ta == tb else tb
    perms: list[tuple[int, ...] | None] = [None]
    if va.ndim <= 4:
        perms += [p for p in itertools.permutations(range(va.ndim)) if p != tuple(range(va.ndim))]
    # a few elements first (cheap), then the whole tensor
    rng = np.random.default_rng(0)
    where = tuple(rng.integers(0, d, _SAMPLE) for d in vb.shape)
    for perm in perms:
        tie = Tie(b, a, perm, to)
        if (va.shape if perm is None else tuple(va.shape[i] for i in perm)) != vb.shape:
            continue
        source = list(where)
        if perm is not None:
            for k, p in enumerate(perm):
                source[p] = where[k]
        sample = va[tuple(source)]
        if to is not None:
            sample = sample.astype(vb.dtype)
        if sample.tobytes() != vb[where].tobytes():  # one differs: no need to look at all
            continue
        got = va if perm is None else np.transpose(va, perm)  # a view: no copy
        if to is not None:
            got = got.astype(vb.dtype)
        bits = np.dtype(f"u{vb.dtype.itemsize}")
        if got.dtype == vb.dtype and np.array_equal(got.view(bits), vb.view(bits)):  # bit for bit
            return tie
    return None


def _groups(
    names: list[str], derive: dict[tuple[str, str], Tie], order: dict[str, int], prefer: list[str]
) -> list[Tie]:
    ties: list[Tie] = []
    done: set[str] = set()
    rank = {n: (prefer.index(n) if n in prefer else len(prefer), order[n]) for n in names}
    for a in sorted(names, key=lambda n: rank[n]):
        if a in done:
            continue
        members = [b for b in names if b != a and b not in done and (a, b) in derive]
        if not members:
            continue
        done.add(a)
        for b in members:
            done.add(b)
            ties.append(derive[(a, b)])
    return ties


def tie_parameters(model: onnx.ModelProto, ties: list[Tie]) -> onnx.ModelProto:
    """A copy of ``model`` whose tied initializers are computed from their parameter by nodes put
    first in the graph."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not ties:
        return out
    graph = out.graph
    tied = {t.name for t in ties}
    made = [t for t in ties if t.made]
    if made:
        inits = {i.name: i for i in graph.initializer}
        cores = [numpy_helper.from_array(t.core(to_array(inits[t.name])), t.source) for t in made]
        graph.initializer.extend(cores)
    for k in reversed(range(len(graph.initializer))):  # in place: no copy of the other weights
        if graph.initializer[k].name in tied:
            del graph.initializer[k]
    taken = {n.name for n in graph.node} | {o for n in graph.node for o in n.output}
    taken |= {i.name for i in graph.initializer}
    nodes = []
    for t in ties:
        src = t.source
        if t.expand is not None:
            nodes.extend(_broadcast_nodes(t, taken))
            continue
        if t.perm is not None:
            dst = t.name if t.to is None else unique_name(f"{t.name}_transposed", taken)
            name = _node_name(t, taken)
            nodes.append(helper.make_node("Transpose", [src], [dst], name=name, perm=list(t.perm)))
            src = dst
        if t.to is not None:
            nodes.append(helper.make_node("Cast", [src], [t.name], name=_node_name(t, taken), to=t.to))
        if t.perm is None and t.to is None:
            nodes.append(helper.make_node("Identity", [src], [t.name], name=_node_name(t, taken)))
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)
    return out


def _node_name(t: Tie, taken: set[str]) -> str:
    return unique_name(f"onnxgrad_tie_{t.name}", taken)


def _broadcast_nodes(t: Tie, taken: set[str]) -> list[onnx.NodeProto]:
    """Slice, Reshape and Expand computing the broadcast copy ``t`` from its source; their int64
    arguments are Constant nodes (named as tie nodes, so that :func:`untie` drops them too)."""
    nodes: list[onnx.NodeProto] = []

    def const(label: str, value: list[int]) -> str:
        out = unique_name(f"{t.name}_{label}", taken)
        taken.add(out)
        tensor = numpy_helper.from_array(np.array(value, np.int64), out)
        nodes.append(helper.make_node("Constant", [], [out], name=_node_name(t, taken), value=tensor))
        return out

    def step(op: str, inputs: list[str], label: str, last: bool) -> str:
        out = t.name if last else unique_name(f"{t.name}_{label}", taken)
        taken.add(out)
        nodes.append(helper.make_node(op, inputs, [out], name=_node_name(t, taken)))
        return out

    assert t.expand is not None
    src = t.source
    if t.rows is not None:
        args = [const("starts", [t.rows[0]]), const("ends", [t.rows[1]]), const("axes", [0])]
        src = step("Slice", [src, *args], "rows", False)
    if t.shape is not None and not t.made:
        src = step("Reshape", [src, const("shape", list(t.shape))], "reshaped", False)
    step("Expand", [src, const("expand", list(t.expand))], "expanded", True)
    return nodes


def untie(model: onnx.ModelProto, ties: Iterable[Tie]) -> onnx.ModelProto:
    """``model`` (changed in place and returned) with each tied value that nodes compute from an
    initializer made an initializer again, holding the value computed from the parameter's."""
    ties = list(ties)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    new = []
    for t in ties:
        if t.source in inits:
            new.append(numpy_helper.from_array(t.compute(to_array(inits[t.source])), t.name))
    if not new:
        return model
    names = {t.name for t in new}
    producers = {}
    for node in graph.node:
        for o in node.output:
            producers[o] = node
    drop = set()
    stack = [producers.get(n) for n in names]
    while stack:  # the tie nodes computing them, arguments (Constant nodes) included
        node = stack.pop()
        if node is None or id(node) in drop or not node.name.startswith("onnxgrad_tie_"):
            continue
        drop.add(id(node))
        stack.extend(producers.get(i) for i in node.input if i)
    keep = [n for n in graph.node if id(n) not in drop]
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(new)
    made = {t.source for t in ties if t.made}
    for k in reversed(range(len(graph.initializer))):  # cores made by tie_parameters: gone again
        if graph.initializer[k].name in made:
            del graph.initializer[k]
    return model


# ---- the one selection ---------------------------------------------------------------------------
def checked_names(names: Iterable[str] | str, problem: Callable[[str], str | None]) -> list[str]:
    """``names`` in order, without repeats (one name may be given as a string), each checked:
    :class:`InputError` with the message ``problem(name)`` returns for the first name it faults."""
    selected = [names] if isinstance(names, str) else list(dict.fromkeys(names))
    for n in selected:
        message = problem(n)
        if message is not None:
            raise InputError(message)
    return selected


def select_parameters(
    model: onnx.ModelProto,
    trainable: Iterable[str] | str | None = None,
    *,
    tie_weights: bool = True,
) -> Selection:
    """What to train in ``model``: the default set (``trainable=None``) or the named initializers,
    checked; with ``tie_weights``, initializers that are one parameter become one (see the module's
    documentation). Raises :class:`InputError` for a name that is not a floating-point initializer.
    """
    inits = {i.name: i for i in model.graph.initializer}
    # named initializers, untied: the reasons are not needed (a front end building a variant)
    reasons = parameter_reasons(model) if trainable is None or tie_weights else {}
    if trainable is None:
        names = [n for n, r in reasons.items() if r is None]
        explicit: list[str] = []
    else:

        def problem(n: str) -> str | None:
            if n not in inits:
                return f"trainable name {n!r} is not an initializer of the model"
            if inits[n].data_type not in FLOAT_TYPES:
                return (
                    f"initializer {n!r} has type {helper.tensor_dtype_to_string(inits[n].data_type)}: "
                    "only floating-point initializers can be trained"
                )
            return None

        names = explicit = checked_names(trainable, problem)
    left_out = {n: r for n, r in reasons.items() if r is not None and n not in names}
    ties: list[Tie] = []
    if tie_weights:
        chosen = set(names)
        separate = set(declared_trainable(model) or ())
        candidates = [n for n in inits if (reasons.get(n) is None or n in chosen) and n not in separate]
        found = find_ties(model, candidates, prefer=explicit)
        by_source: dict[str, list[Tie]] = {}
        for t in found:
            by_source.setdefault(t.source, []).append(t)
        for source, group in by_source.items():
            if source in chosen or any(t.name in chosen for t in group):
                ties.extend(group)
    if not ties:
        return Selection(model, names, left_out, [])
    tied = {t.name: t.source for t in ties}
    selected: list[str] = []
    for n in names:
        n = tied.get(n, n)
        if n not in selected:
            selected.append(n)
    for t in ties:
        left_out.pop(t.name, None)
    return Selection(tie_parameters(model, ties), selected, left_out, ties)


# ---- what torch knows and ONNX forgets -------------------------------------------------------------
_FX_NODE = "pkg.torch.onnx.fx_node"
_EMBEDDING = re.compile(r"aten\.embedding\.default\]\(args = \(%[\w.]+, %[\w.]+, (-?\d+)")


def padding_rows(model: onnx.ModelProto, trainable: Iterable[str]) -> dict[str, int]:
    """Gather nodes of the main graph that are a torch ``Embedding`` with a ``padding_idx``, as the
    output name -> the padding row, for the tables in ``trainable``.

    torch gives that row no gradient. ``torch.onnx.export(dynamo=True)`` writes a plain ``Gather``
    but keeps the aten call in the node's ``pkg.torch.onnx.fx_node`` metadata
    (``aten.embedding.default(args = (%weight, %ids, 0))``), which is read here; the TorchScript
    exporter keeps no trace of it.
    """
    wanted = set(trainable)
    inits = {i.name: i for i in model.graph.initializer}
    rows: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        if node.input[0] not in wanted or node.input[0] not in inits:
            continue
        if any(a.name == "axis" and a.i != 0 for a in node.attribute):
            continue
        fx = next((p.value for p in node.metadata_props if p.key == _FX_NODE), "")
        match = _EMBEDDING.search(fx)
        if match is None:
            continue
        row, n_rows = int(match.group(1)), inits[node.input[0]].dims[0]
        if 0 <= row < n_rows:  # aten's -1: no padding row (nn.Embedding makes others positive)
            rows[node.output[0]] = row
    return rows
