"""The backward pass in one screen: which values need a gradient, then every rule in reverse order.

:func:`mark` finds the values that *require* a gradient (flowing forward from the values
differentiated with respect to, through ops that carry one) and those that *reach* an output given a
gradient; :func:`reverse_pass` walks the nodes backwards and, for every node with an output in both
sets, sums the gradients of its outputs and calls the node's rule, which returns one gradient per
input. :func:`~onnxgrad.autodiff.engine.build_gradient` runs both on the model's graph; the rules of
If, Loop and Scan (``rules/control_flow.py``) run them on every branch and body. After the pass,
:func:`cut_paths` finds the trainable values whose gradient an op without one cut (the engine warns).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import GradientNotImplementedError
from ..model.graph import ValueInfo, node_operands
from .builder import GradBuilder, Var
from .registry import NodeContext, lookup

# The quantization ops (rules/quant.py): their integer tensors stand for the real numbers
# (q - zero_point) * scale, and the gradient flows through them as a float gradient of that real
# number under build_gradient(quantized="ste"); "zero" makes them stop the gradient, "refuse" raises
# where a gradient would cross a rounding.
QUANTIZED_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "ConvInteger",
    }
)
QUANTIZED_MODES = ("ste", "zero", "refuse")
# Zero-gradient ops whose outputs do not depend on the values of their inputs (shapes, sizes,
# random draws shaped like the input): a trainable value feeding only these is unused, not cut.
_VALUE_FREE = frozenset(
    {
        "Shape",
        "Size",
        "ConstantOfShape",
        "EyeLike",
        "RandomNormalLike",
        "RandomUniformLike",
        "OptionalHasElement",
        "SequenceLength",
        "SequenceEmpty",
        "HannWindow",
        "HammingWindow",
        "BlackmanWindow",
    }
)

# Inputs (by position) whose values do not matter, only their type, or that set a random draw:
# CastLike's target, Dropout's ratio (no effect in inference, a random mask's rate in training).
_VALUE_FREE_INPUTS = {"CastLike": (1,), "Dropout": (1, 2)}


def is_quantized_op(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is one of the standard-domain :data:`QUANTIZED_OPS`."""
    return node.op_type in QUANTIZED_OPS and node.domain in ("", "ai.onnx")


def quantized_mode(g: GradBuilder) -> str:
    """The ``quantized=`` choice of the build ``g`` (a child scope asks its root)."""
    while g.parent is not None:
        g = g.parent  # type: ignore[assignment]
    return str(getattr(g, "quantized", "ste"))


def note_straight_through(g: GradBuilder, node: str) -> None:
    """Record that rounding node ``node`` passed its gradient straight through (``quantized="ste"``),
    for the build's one :class:`~onnxgrad.errors.GradientWarning` (a child scope tells its root)."""
    while g.parent is not None:
        g = g.parent  # type: ignore[assignment]
    noted = getattr(g, "straight_through", None)
    if noted is not None and node not in noted:
        noted.append(node)


def straight_through_message(nodes: list[str]) -> str:
    """The :class:`~onnxgrad.errors.GradientWarning` text for the rounding nodes a build passed
    straight through."""
    shown = ", ".join(repr(n) for n in nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
    return (
        f"{len(nodes)} rounding node(s) ({shown}) pass the gradient straight through "
        "(quantized='ste', the estimator of quantization-aware training, with LSQ's scale gradient): "
        "not the derivative almost everywhere, which is zero through a rounding (docs/quantized.md); "
        "quantized='zero' stops these gradients, quantized='refuse' raises"
    )


@dataclass
class Marks:
    """Which values require a gradient, and which reach an output that takes one."""

    requires: set[str]
    reaches: set[str]
    toward_output: dict[str, onnx.NodeProto]  # value -> the consumer that leads to an output


def mark(
    nodes: Sequence[onnx.NodeProto],
    wrt: Iterable[str],
    grad_outs: Iterable[str],
    infos: dict[str, ValueInfo],
    versions: dict[str, int],
    quantized: str = "ste",
) -> Marks:
    """Values requiring grad (flowing forward from ``wrt``) and reaching ``grad_outs`` (backward).

    A node's operands include the outer values its subgraphs capture (see ``node_operands``).
    ``quantized`` (see :data:`QUANTIZED_OPS`): with ``"ste"`` or ``"refuse"``, the integer outputs
    of the quantization ops require a gradient (a float gradient of the real number they stand
    for), and so do the integer outputs of an op fed such a value; with ``"zero"`` those ops stop
    the gradient, as the ops of ``rules/nondiff.py`` do.
    """
    requires = set(wrt)
    carry = quantized != "zero"
    for node in nodes:
        r = lookup(node.domain, node.op_type, version_of(versions, node.domain))
        if r is not None and r.kind == "zero":
            continue
        quant = is_quantized_op(node)
        if quant and not carry:
            continue
        fed = [i for i in node_operands(node) if i and i in requires]
        if fed:
            # unknown types count as float: better an error for a missing rule than a silent zero
            ints = carry and (quant or any(not _may_be_float(infos, i) for i in fed))
            requires.update(o for o in node.output if o and (ints or _may_be_float(infos, o)))
    reaches = set(grad_outs)
    toward_output: dict[str, onnx.NodeProto] = {}
    for node in reversed(nodes):
        if any(o in reaches for o in node.output):
            for i in node_operands(node):
                if i and i in requires:
                    reaches.add(i)
                    toward_output.setdefault(i, node)
    return Marks(requires, reaches, toward_output)


def reverse_pass(
    g: GradBuilder,
    nodes: Sequence[onnx.NodeProto],
    marks: Marks,
    grads: dict[str, list[Var]],
    grad_outs: Sequence[str],
    stopped: list[tuple[onnx.NodeProto, str]] | None = None,
) -> None:
    """Walk ``nodes`` backwards, adding to ``grads`` (value -> contributions) what each rule returns.

    Used for the main graph and, by the control-flow rules, for every subgraph. ``stopped`` collects
    (node, input) where a rule returned no gradient for a floating-point input that needed one
    (:func:`cut_paths` reads it).
    """
    for node in reversed(nodes):
        if not any(o in marks.requires and o in marks.reaches for o in node.output):
            continue
        dout = [g.sum(grads.get(o, [])) if o else None for o in node.output]
        if all(d is None for d in dout):
            continue
        operands = node_operands(node)
        needs = [bool(i) and i in marks.requires for i in operands]
        if not any(needs):  # its outputs were given a gradient directly (a control-flow rule does)
            continue
        version = version_of(g.versions, node.domain)
        r = lookup(node.domain, node.op_type, version)
        if r is None or r.fn is None:
            raise GradientNotImplementedError(_no_rule_message(g.versions, node, marks, grad_outs))
        for name in [*operands, *node.output]:
            if name and name not in g.infos:  # shape inference could not type it (custom op)
                g.infos[name] = ValueInfo(name, next(d for d in dout if d is not None).dtype, None)
        ctx = NodeContext(
            node=node,
            inputs=[g.fwd(i) if i else None for i in operands],
            outputs=[g.fwd(o) if o else None for o in node.output],
            dout=dout,
            needs=needs,
            opset=version,
            g=g,
        )
        for k, (name, need, grad) in enumerate(zip(operands, needs, r.fn(g, ctx))):
            if need and grad is None and stopped is not None and _may_be_float(g.infos, name):
                stopped.append((node, name))
            if need and grad is not None:
                if k == 0 and node.op_type == "Gather" and node.output[0] in g.padding_rows:
                    grad = _without_row(g, grad, g.infos[name], g.padding_rows[node.output[0]])
                grads.setdefault(name, []).append(grad)


def _without_row(g: GradBuilder, grad: Var, table: ValueInfo, row: int) -> Var:
    """``grad`` with row ``row`` zeroed: the gradient torch gives an Embedding's padding row."""
    shape = table.shape or ()
    mask = np.ones((shape[0],) + (1,) * (len(shape) - 1))
    mask[row] = 0
    return grad * g.const(mask, grad.dtype)


def _may_be_float(infos: dict[str, ValueInfo], name: str) -> bool:
    info = infos.get(name)
    return info is None or info.is_float


def version_of(versions: dict[str, int], domain: str) -> int:
    """The opset version of ``domain`` in ``versions`` (``ai.onnx`` is ``""``; 1 when absent)."""
    return versions.get("" if domain == "ai.onnx" else domain) or 1


def _no_rule_message(
    versions: dict[str, int], node: onnx.NodeProto, marks: Marks, grad_outs: Sequence[str]
) -> str:
    toward_output = marks.toward_output
    domain = node.domain or "ai.onnx"
    path = [f"{node.name or '<unnamed>'} ({node.op_type})"]
    value = next((o for o in node.output if o in toward_output or o in grad_outs), node.output[0])
    seen = 0
    while value in toward_output and seen < 50:
        nxt = toward_output[value]
        path.append(f"{nxt.name or '<unnamed>'} ({nxt.op_type})")
        value = next((o for o in nxt.output if o in toward_output or o in grad_outs), nxt.output[0])
        seen += 1
    path.append(f"output {value!r}")
    return (
        f"no gradient rule for node {node.name!r}: op {node.op_type!r}, domain {domain!r}, "
        f"opset {version_of(versions, node.domain)}; the gradient is needed on the path "
        + " -> ".join(path)
        + ". Mark the values before it as not trainable, or register a rule "
        "(onnxgrad.autodiff.registry.rule)."
    )


def cut_paths(
    nodes: Sequence[onnx.NodeProto],
    wrt: Iterable[str],
    grad_outs: Iterable[str],
    marks: Marks,
    stopped: Sequence[tuple[onnx.NodeProto, str]],
    versions: dict[str, int],
    quantized: str,
) -> dict[str, onnx.NodeProto]:
    """Values of ``wrt`` (those that got no gradient) cut by an op that stopped it -> the first such op.

    A value is *cut* when it reaches an output (through ops whose result depends on the values of
    their inputs) and every such path crosses a zero-gradient op (``rules/nondiff.py``, the
    :data:`QUANTIZED_OPS` under ``quantized="zero"``), an op with no floating-point result (a Cast
    to an integer type), or a rule that returned no gradient for a floating-point input
    (``stopped``, from :func:`reverse_pass`). Values that only feed shape
    computations, or reach no output, are not cut: they are unused.
    """
    leads = set(grad_outs)  # values with a value-dependent path to an output
    for node in reversed(nodes):
        if node.op_type not in _VALUE_FREE and any(o in leads for o in node.output):
            free = _VALUE_FREE_INPUTS.get(node.op_type, ())
            leads.update(i for k, i in enumerate(node_operands(node)) if i and k not in free)
    stops = {(id(node), name) for node, name in stopped}
    cuts: dict[str, onnx.NodeProto] = {}
    for w in wrt:
        if w not in leads:
            continue
        seen = {w}
        for node in nodes:
            free = _VALUE_FREE_INPUTS.get(node.op_type, ())
            fed = [i for k, i in enumerate(node_operands(node)) if i in seen and k not in free]
            if not fed or node.op_type in _VALUE_FREE:
                continue
            r = lookup(node.domain, node.op_type, version_of(versions, node.domain))
            stopping = (
                (r is not None and r.kind == "zero")
                or (quantized == "zero" and is_quantized_op(node))
                or any((id(node), i) in stops for i in fed)
                # no output carries a gradient: integer or boolean results (a Cast to int64)
                or not any(o in marks.requires for o in node.output)
            )
            if stopping:
                if any(o in leads for o in node.output):
                    cuts[w] = node
                    break
                continue
            seen.update(o for o in node.output if o in marks.requires)
    return cuts


def cut_message(cuts: dict[str, onnx.NodeProto], quantized: str) -> str:
    """The :class:`~onnxgrad.errors.GradientWarning` text for :func:`cut_paths`' result."""
    parts = [f"{w!r} by node {n.name!r} ({n.op_type})" for w, n in cuts.items()]
    text = (
        f"{len(cuts)} trainable value(s) get a zero gradient: an op without a gradient cuts every "
        f"path to the outputs: {'; '.join(parts)}"
    )
    if any(is_quantized_op(n) for n in cuts.values()):
        text += f" (quantized={quantized!r}; quantized='ste' passes the gradient straight through)"
    return text + "."
