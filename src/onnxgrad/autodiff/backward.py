"""The backward pass in one screen: which values need a gradient, then every rule in reverse order.

:func:`mark` finds the values that *require* a gradient (flowing forward from the values
differentiated with respect to, through ops that carry one) and those that *reach* an output given a
gradient; :func:`reverse_pass` walks the nodes backwards and, for every node with an output in both
sets, sums the gradients of its outputs and calls the node's rule, which returns one gradient per
input. :func:`~onnxgrad.autodiff.engine.build_gradient` runs both on the model's graph; the rules of
If, Loop and Scan (``rules/control_flow.py``) run them on every branch and body.
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
) -> Marks:
    """Values requiring grad (flowing forward from ``wrt``) and reaching ``grad_outs`` (backward).

    A node's operands include the outer values its subgraphs capture (see ``node_operands``).
    """
    requires = set(wrt)
    for node in nodes:
        r = lookup(node.domain, node.op_type, version_of(versions, node.domain))
        if r is not None and r.kind == "zero":
            continue
        if any(i in requires for i in node_operands(node) if i):
            # unknown types count as float: better an error for a missing rule than a silent zero
            requires.update(o for o in node.output if o and _may_be_float(infos, o))
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
) -> None:
    """Walk ``nodes`` backwards, adding to ``grads`` (value -> contributions) what each rule returns.

    Used for the main graph and, by the control-flow rules, for every subgraph.
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
