"""Which initializers of a model train by default: each one's decision, with its reason.

Exporters store much more than weights as initializers: exponents, epsilons, shapes, masks, scales,
values they folded. The default trainable set (``trainable=None`` everywhere) is what a user would
call the model's parameters. Each floating-point initializer is judged by the first of these
reasons that applies (:data:`RULES`, in order): what the file *declares* first, then how the graph
*uses* the value.

1. not floating-point (``"integer"``, ``"bool"``...): never trainable, even when named;
2. the model declares its trainable set (``onnxgrad.trainable`` metadata, written by
   ``onnxgrad.lora``): trainable if named there, frozen otherwise;
3. the exporter declares the torch input kind (``pkg.torch.export.graph_signature.InputSpec.kind``,
   written by ``torch.onnx.export(dynamo=True)`` on ``graph.value_info``, or on the initializer by
   some saves): ``PARAMETER`` trains, ``BUFFER`` and ``CONSTANT_TENSOR`` do not;
4. the exporter folded it (``pkg.onnxscript.optimizer.folded_from``) from no tensor of the module
   (only from values the forward computed: every name it lists is a node's or a constant that
   torch.export lifted, ``lifted_tensor_N``, none a module's parameter or buffer, dotted paths) and it
   holds one value repeated: ``"folded constant"`` (T5's zero position bias of its
   cross-attention, the ones and zeros of Wav2Vec2's GroupNorm lowering, an all-zero padding mask);
5. every op that reads it does so in a slot that takes a constant, not a weight (one read as a
   weight makes it a parameter): a ``Pow`` exponent, a ``Clip`` bound, a ``Reshape``/``Expand``
   shape, ``Range`` arguments, a ``Pad`` or ``ConstantOfShape`` value, ``Dropout``'s ratio, ``Resize``
   scales, a ``BatchNormalization`` running statistic, quantization scales, an RNN's initial state
   (table :data:`CONSTANT_SLOTS`), read directly or through ops that pass a part of it on
   (``Slice``, ``Split``, ``Gather``, ``Concat``, ``Tile``: the dynamo exporter's zero initial state
   of a multi-layer RNN, a scalar expanded over the batch and sliced per layer); and, in
   onnxruntime's ops, the ``cos_cache`` / ``sin_cache`` of a ``RotaryEmbedding`` or
   ``GroupQueryAttention`` (the rotary tables, constants in torch; the ONNX RotaryEmbedding's too):
   ``"rotary cache"`` (table :data:`ROTARY_CACHE_SLOTS`);
6. it has one value and is added to the result of a reduction or a square root (the epsilon of a
   hand-written normalization): ``"epsilon"``;
7. it is read by elementwise ops only and holds a mask: only 0 and one or more values at most
   :data:`MASK_NEGATIVE` (or -inf) added to scores (``"additive mask"``: BERT's -3.4e38, Swin's
   shifted-window -100), or only 0 and 1 multiplied (``"0/1 mask"``);
8. it is only multiplied and is a rotary position table that the exporter folded from a buffer
   (RoPE's cos and sin: values in [-1, 1], the row of position 0, along axis -2, all ones or all
   zeros): ``"rotary position table"``;
9. it has one value and every elementwise op that reads it broadcasts it along a last dimension
   longer than 1 (a scale or offset, ``x * 0.5``), or along a symbolic one (a sequence length)
   where another op reads it along a static one longer than 1 (the attention scale of a key
   transposed to (..., head size, past + sequence)): ``"scalar constant"``. One value against a
   last dimension of 1 or unknown is kept: that is the bias of a one-output linear layer.

Boolean ops (a value cast to bool, then And-ed) take no gradient and do not count as uses: a value
read by them alone is ``"read as a boolean"`` (after rule 5); and a value that holds RoPE's inverse
frequencies unfolded (a model exported with dynamic positions: ``1, r, r^2...`` with ``0 < r < 1``,
every read a MatMul or Mul by positions cast from integers) is ``"rotary inverse frequencies"``
(before rule 6).

Otherwise it trains: ``"read as a weight"``, or ``"read by no node"`` (its gradient is zero).

Rules 6 to 9 are the value/rank/size heuristics: they apply only to values that the usage leaves
ambiguous (elementwise operands). Usage is read through ops that pass a value on unchanged but
for its type or layout (``Identity``, ``Cast``, ``CastLike``, ``Reshape``, ``Unsqueeze``,
``Squeeze``, ``Flatten``, ``Expand``, ``Transpose``): a scalar cast and then multiplied is a
scalar constant. A learned scalar gain (``alpha * x`` with one ``alpha``) is thus left out by
default; name it in ``trainable=`` to train it. Any floating-point initializer can be named
explicitly. Which initializers are one parameter stored twice is :mod:`onnxgrad.autodiff.ties`.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import InputError
from ..model.graph import FLOAT_TYPES, subgraphs, to_array
from ..model.infer import infer_value_infos

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
# (domain, op type) -> the input slots of the cos and sin caches of a rotary embedding
ROTARY_CACHE_SLOTS: dict[tuple[str, str], tuple[int, ...]] = {
    ("", "RotaryEmbedding"): (1, 2),
    ("com.microsoft", "RotaryEmbedding"): (2, 3),
    ("com.microsoft", "GroupQueryAttention"): (7, 8),
}
for _op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare",
            "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp"):  # fmt: skip
    CONSTANT_SLOTS[_op] = {1: "axes"}

_BOOLEAN_OPS = {"And", "Or", "Xor", "Not"}  # their inputs are bool: no gradient reaches a float there

# ops whose operands are combined elementwise (with broadcasting): usage leaves them ambiguous
ELEMENTWISE = {
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Mean", "Sum", "Where", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Mod", "Pow",
}  # fmt: skip

# producers of a variance or a norm, to which an epsilon is added
_NORM_PRODUCERS = {
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceL1", "Sqrt", "ReduceLogSumExp",
}  # fmt: skip


MASK_NEGATIVE = -100.0
"""Additive masks hold 0 and values at most this (or -inf): -100 is Swin's shifted-window mask."""

TORCH_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
"""Where ``torch.onnx.export(dynamo=True)`` writes a torch input's kind (PARAMETER, BUFFER...)."""

FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
"""Where the dynamo exporter's optimizer lists the values it folded an initializer from."""


@dataclass(frozen=True)
class Decision:
    """Whether one initializer trains by default, and why (the rule that decided)."""

    trainable: bool
    reason: str


class _Judge:
    """What the rules read about one model, computed once and only when a rule asks."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.declared = declared_trainable(model)
        self.meta: dict[str, dict[str, str]] = {}
        for v in (*self.graph.value_info, *self.graph.input, *self.graph.output):
            if v.metadata_props:
                self.meta.setdefault(v.name, {}).update((p.key, p.value) for p in v.metadata_props)
        for t in self.graph.initializer:  # the initializer's own metadata wins
            if t.metadata_props:
                self.meta.setdefault(t.name, {}).update((p.key, p.value) for p in t.metadata_props)

    @cached_property
    def nodes(self) -> list[onnx.NodeProto]:
        # an If's branches read the main graph's initializers too (optimum's merged decoders)
        return list(_all_nodes(self.graph))

    @cached_property
    def consumers(self) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
        values = set(self.inits) | {o for n in self.nodes for o in n.output if o}
        return _uses(self.graph, values)

    @cached_property
    def uses(self) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
        return {n: _through(self.consumers, n, set()) for n in self.inits}

    @cached_property
    def uses_through_parts(self) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
        """The uses, read through the ops that pass a part of a value on too (:data:`_PARTS`)."""
        return {n: _through(self.consumers, n, set(), parts=True) for n in self.inits}

    @cached_property
    def used(self) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
        """The uses that can carry a gradient: boolean ops' are left out."""
        return {k: [(n, i) for n, i in v if n.op_type not in _BOOLEAN_OPS] for k, v in self.uses.items()}

    @cached_property
    def producer(self) -> dict[str, onnx.NodeProto]:
        return {o: n for n in self.nodes for o in n.output}

    @cached_property
    def infos(self) -> dict:
        return infer_value_infos(self.model)


Rule = Callable[[_Judge, str, TensorProto], "Decision | None"]


def _not_floating_point(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    if t.data_type in FLOAT_TYPES:
        return None
    slot = next((r for r in (_slot_reason(n, k) for n, k in j.uses[name]) if r), None)
    return Decision(False, _kind(t) if slot is None else f"{slot} ({_dtype_name(t.data_type)})")


def _declared_by_model(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    if j.declared is None:
        return None
    if name in j.declared:
        return Decision(True, f"named in the model's {TRAINABLE_KEY}")
    return Decision(False, f"frozen (not in the model's {TRAINABLE_KEY})")


_KINDS = {
    "PARAMETER": Decision(True, "torch parameter"),
    "BUFFER": Decision(False, "torch buffer"),
    "CONSTANT_TENSOR": Decision(False, "torch constant"),
}


def _declared_by_exporter(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    return _KINDS.get(j.meta.get(name, {}).get(TORCH_KIND, ""))


_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")
_LIFTED = re.compile(r"^([\w.]+\.)?lifted_tensor_\d+$")


def _folded_constant(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    listed = j.meta.get(name, {}).get(FOLDED_FROM)
    if listed is None:
        return None
    try:
        sources = ast.literal_eval(listed)
    except (ValueError, SyntaxError):
        return None
    # node outputs are identifiers (val_3, zeros, add_24); module tensors are dotted paths, but for
    # the constants torch.export lifts out of the forward (model.lifted_tensor_0: BERT's mask fill)
    if not isinstance(sources, list) or not all(
        isinstance(s, str) and (_IDENTIFIER.match(s) or _LIFTED.match(s)) for s in sources
    ):
        return None
    flat = to_array(t).ravel()
    if flat.size and (flat == flat[0]).all():
        return Decision(False, "folded constant")
    return None


def _constant_slots(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    # every read in a constant slot: exporters alias equal initializers (the TorchScript one reads a
    # BatchNormalization's ones running variance through Identity of its ones weight), so one read
    # as a weight makes a parameter (a Mul of scales read as a quantization scale is such a slot).
    # Read through parts too: the dynamo exporter's zero initial state of a multi-layer RNN is a
    # scalar Expanded over the batch, then Sliced per layer
    for uses in (j.uses[name], j.uses_through_parts[name]):
        slots = [_slot_reason(n, k) or _scale_product(j, n) for n, k in uses]
        if slots and all(slots):
            return Decision(False, slots[0])
    return None


def _scale_product(j: _Judge, node: onnx.NodeProto) -> str | None:
    """``"quantization scale"`` for a ``Mul`` of initializers read only as a quantization scale:
    the bias scale ``x_scale * w_scale`` of a quantized Gemm/Conv (``rewrite._tied_bias_scales``),
    so that the scales it multiplies stay constants by default as in the file (named in
    ``trainable=``, they train)."""
    if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or not node.output:
        return None
    if not all(i in j.inits for i in node.input):
        return None
    reads = _through(j.consumers, node.output[0], set())
    reasons = {_slot_reason(n, k) for n, k in reads}
    return "quantization scale" if reads and reasons == {"quantization scale"} else None


def _rotary_caches(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    # read only as the cos/sin cache of a rotary embedding: onnxruntime-genai's builder stores them
    # as initializers, torch computes them from the inverse frequencies (a buffer) without a gradient
    uses = j.uses[name]
    if uses and all(k in ROTARY_CACHE_SLOTS.get((n.domain or "", n.op_type), ()) for n, k in uses):
        return Decision(False, "rotary cache")
    return None


def _read_as_boolean(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    return Decision(False, "read as a boolean") if j.uses[name] and not j.used[name] else None


def _rotary_frequencies(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    used = j.used[name]
    if used and _inverse_frequencies(t, used, j.producer):
        return Decision(False, "rotary inverse frequencies")
    return None


def _ambiguous(j: _Judge, name: str) -> bool:
    uses = j.used[name]
    return bool(uses) and all(n.domain in ("", "ai.onnx") and n.op_type in ELEMENTWISE for n, _ in uses)


def _size(t: TensorProto) -> int:
    return int(np.prod(t.dims, dtype=np.int64))


def _epsilon(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    if _ambiguous(j, name) and _size(t) == 1 and _is_epsilon(name, j.used[name], j.producer):
        return Decision(False, "epsilon")
    return None


def _masks(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    reason = _mask(t, j.used[name]) if _ambiguous(j, name) else None
    return None if reason is None else Decision(False, reason)


def _rotary_table(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    reason = _rotary(t, j.used[name]) if _ambiguous(j, name) else None
    return None if reason is None else Decision(False, reason)


def _scalar_constant(j: _Judge, name: str, t: TensorProto) -> Decision | None:
    if _ambiguous(j, name) and _size(t) == 1 and _broadcast(name, t, j.used[name], j.infos):
        return Decision(False, "scalar constant")
    return None


RULES: list[Rule] = [
    _not_floating_point,
    _declared_by_model,
    _declared_by_exporter,
    _folded_constant,
    _constant_slots,
    _rotary_caches,
    _read_as_boolean,
    _rotary_frequencies,
    _epsilon,
    _masks,
    _rotary_table,
    _scalar_constant,
]
"""The reasons, in the order they are asked (see the module's documentation): the first that
returns a :class:`Decision` decides."""


def decisions(model: onnx.ModelProto) -> dict[str, Decision]:
    """Every initializer of ``model``'s main graph, in order, with its default decision and reason."""
    judge = _Judge(model)
    out: dict[str, Decision] = {}
    for name, t in judge.inits.items():
        decision = next((d for d in (rule(judge, name, t) for rule in RULES) if d is not None), None)
        if decision is None:
            decision = Decision(True, "read as a weight" if judge.uses[name] else "read by no node")
        out[name] = decision
    return out


def parameter_reasons(model: onnx.ModelProto) -> dict[str, str | None]:
    """For every initializer of ``model``'s main graph: ``None`` if it is a parameter (part of the
    default trainable set), else why not (see the module's documentation for the rules)."""
    return {n: None if d.trainable else d.reason for n, d in decisions(model).items()}


def default_trainable(model: onnx.ModelProto) -> list[str]:
    """The default trainable set of ``model`` (before tying): its parameters, in initializer order."""
    return [n for n, d in decisions(model).items() if d.trainable]


# ---- how the graph uses a value ------------------------------------------------------------------
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


def _all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    """The nodes of ``graph`` and of its subgraphs, at any depth."""
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from _all_nodes(sub)


# ops that pass a value on unchanged but for its type, shape or layout (input 0): an initializer
# read through them is judged by what reads their output
_TRANSPARENT = {
    "Identity", "Cast", "CastLike", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose",
}  # fmt: skip


# ops that pass a part of a value on (input 0; any input of a Concat): read through them only where
# a value that reaches nothing but constant slots is a constant (rule 5)
_PARTS = {"Slice", "Split", "Gather", "Concat", "Tile"}


def _through(
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]], name: str, seen: set[str], parts: bool = False
) -> list[tuple[onnx.NodeProto, int]]:
    out = []
    for node, k in consumers.get(name, []):
        standard = node.domain in ("", "ai.onnx")
        passes = k == 0 and standard and node.op_type in _TRANSPARENT
        if parts and standard and node.op_type in _PARTS:
            passes = k == 0 or node.op_type == "Concat"
        if passes and node.output and all(o in consumers for o in node.output if o):
            for o in node.output:
                if o and o not in seen:
                    seen.add(o)
                    out.extend(_through(consumers, o, seen, parts))
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


# A model may name its default trainable set itself, as a JSON list of initializer names in this
# metadata_props key (onnxgrad.lora.add_adapters writes it: the adapters, the base frozen). Those
# names are never tied to one another (LoRA's B matrices all start at zero, equal but separate).
TRAINABLE_KEY = "onnxgrad.trainable"


def declared_trainable(model: onnx.ModelProto) -> list[str] | None:
    """The initializer names ``model`` declares as its default trainable set, or ``None``."""
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


def record_trainable(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Make ``model``'s :data:`TRAINABLE_KEY` (where it has one: an adapted model) name what
    trained, ``names`` (those that are initializers of ``model``), in place, and return ``model``:
    the one writer every ``to_onnx`` uses, so that ``lora.save_adapters`` keeps the weights that
    trained beside the adapters (a head) instead of the input's stale list."""
    inits = {t.name for t in model.graph.initializer}
    for p in model.metadata_props:
        if p.key == TRAINABLE_KEY:
            p.value = json.dumps([n for n in names if n in inits])
    return model


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


def _inverse_frequencies(t: TensorProto, uses: list[tuple[onnx.NodeProto, int]], producer: dict) -> bool:
    """RoPE's inverse frequencies (``base ** (-2i / d)``: 1, then a constant ratio below 1), every
    read a MatMul or Mul by positions cast from integers."""
    for node, k in uses:
        if node.op_type not in ("MatMul", "Mul") or len(node.input) != 2:
            return False
        other = producer.get(node.input[1 - k])
        if other is None or other.op_type != "Cast":
            return False
    value = to_array(t).astype(np.float64).ravel()
    if value.size < 2 or value[0] != 1 or not ((value > 0) & (value < 1))[1:].all():
        return False
    ratios = value[1:] / value[:-1]
    return bool(np.allclose(ratios, ratios[0], rtol=1e-4))


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
