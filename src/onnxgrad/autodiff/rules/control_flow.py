"""Control flow: If, Loop and Scan, at any depth of nesting.

A subgraph (a branch, a body) is differentiated like the main graph, by the engine's own
:func:`~onnxgrad.autodiff.backward.mark` and :func:`~onnxgrad.autodiff.backward.reverse_pass`, with a
child :class:`~onnxgrad.autodiff.builder.GradBuilder` whose nodes become the backward subgraph.
Gradients flow to a node's inputs and to the outer values its subgraphs capture (a weight read
inside a Loop body is differentiated like an input). What the backward subgraph reads from the
forward subgraph (its ``saved`` values) cannot be seen outside the forward subgraph, so it is
exported:

* **If**: the backward is an If on the same (saved) condition whose branches are the backward
  graphs of the two branches. A value a backward branch reads becomes an extra output of its forward
  branch, and of the If; the other branch outputs an empty tensor in that slot. Both backward
  branches return the gradient of every captured value that needs one (zeros where a branch does
  not use it).
* **Loop** and **Scan**: a value the backward body reads becomes an extra scan output of the forward
  node: a *tape* stacking it over the iterations. The backward is a Loop over the ``T`` iterations
  in reverse order; iteration ``j`` reads ``tape[T-1-j]``, carries the gradients of the loop-carried
  values from one iteration to the one before, and accumulates the gradients of captured values.
  The iteration number and the slices of a Scan input are not taped: the backward recomputes them.
  Gradients of Scan inputs are scan outputs of the backward Loop, reversed and moved to the scan
  axis. With zero iterations the carried gradients pass straight through. onnxruntime fails on a
  Scan over an empty sequence, so a differentiated Scan is wrapped in an If that skips it then.

Limits: a value taped by a Loop or Scan must keep its shape across iterations (scan outputs are
stacked), and sequences cannot be taped (a GradientNotImplementedError says which value).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...errors import GradientNotImplementedError
from ...model.graph import (
    ValueInfo,
    captured_names,
    constant_values,
    graph_attr,
    local_names,
    node_operands,
    sort_nodes,
)
from ..backward import mark, quantized_mode, reverse_pass
from ..builder import BOOL, INT64, GradBuilder, Var
from ..registry import NodeContext, rule
from .common import Grads, flip

_INT64_MAX = int(np.iinfo(np.int64).max)


# ---- differentiating one subgraph -------------------------------------------------------------
def _scope(g: GradBuilder, graph: onnx.GraphProto) -> GradBuilder:
    """A child builder for the backward of ``graph``, a subgraph of the scope ``g`` builds."""
    return g.child(local_names(graph), constant_values(graph))


def _reverse_body(
    sub: GradBuilder,
    graph: onnx.GraphProto,
    seeds: Sequence[tuple[str, Var]],
    requires: set[str],
    wanted: Sequence[str],
) -> dict[str, Var | None]:
    """Gradients of ``wanted`` (subgraph inputs, captured values) given those of its outputs.

    ``seeds`` pairs an output name with its gradient (a name may come twice: the gradients add up);
    ``requires`` are the inputs and captured values that carry a gradient into the subgraph.
    """
    nodes = list(graph.node)
    outs = [name for name, _ in seeds]
    marks = mark(nodes, requires, outs, sub.infos, sub.versions, quantized_mode(sub))
    grads: dict[str, list[Var]] = {}
    for name, grad in seeds:
        grads.setdefault(name, []).append(grad)
    reverse_pass(sub, nodes, marks, grads, outs)
    return {w: sub.sum(grads.get(w, [])) for w in wanted}


def _or_zeros(sub: GradBuilder, grad: Var | None, name: str) -> Var:
    return grad if grad is not None else sub.zeros_like(sub.fwd(name))


def _bind_outputs(sub: GradBuilder, values: Sequence[Var]) -> list[onnx.ValueInfoProto]:
    """Graph outputs for ``values``: a subgraph output must be a value its own nodes define, once."""
    produced = {o for node in sub.nodes for o in node.output}
    used: set[str] = set()
    protos = []
    for v in values:
        name = v.name
        if name not in produced or name in used:
            name = sub.fresh(f"{v.name}_out")
            sub.nodes.append(helper.make_node("Identity", [sub.read(v)], [name]))
        used.add(name)
        protos.append(ValueInfo(name, v.dtype, v.shape, v.sequence).rank_only().to_proto())
    return protos


def _subgraph(
    sub: GradBuilder,
    name: str,
    prefix: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
) -> onnx.GraphProto:
    """The backward subgraph ``sub`` built, after ``prefix`` (which defines the values it reads)."""
    return helper.make_graph(
        sort_nodes([*prefix, *sub.nodes]),
        name,
        list(inputs),
        list(outputs),
        initializer=list(sub.initializers.values()),
    )


def _finish_forward(graph: onnx.GraphProto, sub: GradBuilder, extra: Sequence[onnx.NodeProto]) -> None:
    """Add the forward nodes the backward asked for (shapes, tape copies) and re-sort the subgraph."""
    nodes = sort_nodes([*graph.node, *extra, *sub.fwd_nodes])
    copies = []
    for node in nodes:  # copies: the nodes are about to leave the repeated field
        c = onnx.NodeProto()
        c.CopyFrom(node)
        copies.append(c)
    del graph.node[:]
    graph.node.extend(copies)


def _emit(
    g: GradBuilder, op_type: str, inputs: Sequence[Var | None], outs: Sequence[ValueInfo], **attrs: Any
) -> list[Var]:
    """One node whose outputs have the types ``outs`` (the names there serve as hints)."""
    names = [g.read(x) if x is not None else "" for x in inputs]
    results = [Var(g, g.fresh(o.name), o.dtype, o.shape, sequence=o.sequence) for o in outs]
    g.nodes.append(helper.make_node(op_type, names, [v.name for v in results], **attrs))
    return results


def _type(info: ValueInfo, name: str) -> onnx.ValueInfoProto:
    return ValueInfo(name, info.dtype, info.shape, info.sequence).rank_only().to_proto()


def _empty(name: str, info: ValueInfo, shape: Sequence[int] | None = None) -> onnx.NodeProto:
    """A node making an empty value of ``info``'s type: the dummy a branch or a skipped Scan returns."""
    if info.sequence:
        return helper.make_node("SequenceEmpty", [], [name], dtype=info.dtype)
    if shape is None:
        shape = [0] * (info.rank if info.rank is not None else 1)
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, info.dtype, list(shape), [])
    )


# ---- If ---------------------------------------------------------------------------------------
@rule("If")
def if_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """Backward of If: an If on the same condition whose branches are the backward branches.

    Each returns the gradients of the captured values needing one, in the same order (zeros where
    the branch does not read a value).
    """
    node = n.node
    operands = node_operands(node)
    wanted = [w for k, w in enumerate(operands) if k >= len(node.input) and n.needs[k]]
    if not wanted:
        return [None] * len(operands)
    branches = [graph_attr(node, "then_branch"), graph_attr(node, "else_branch")]
    subs, results = [], []
    for branch in branches:
        sub = _scope(g, branch)
        seeds = [(branch.output[k].name, sub.outer(d)) for k, d in enumerate(n.dout) if d is not None]
        grads = _reverse_body(sub, branch, seeds, set(wanted), wanted)
        results.append([_or_zeros(sub, grads[w], w) for w in wanted])
        subs.append(sub)
    prefixes = _export_branch_values(g, node, branches, subs)
    for branch, sub in zip(branches, subs):
        _finish_forward(branch, sub, [])
    backward = [
        _subgraph(sub, f"{node.name or 'If'}_grad_{side}", prefix, [], _bind_outputs(sub, res))
        for sub, prefix, res, side in zip(subs, prefixes, results, ("then", "else"))
    ]
    outs = _emit(
        g,
        "If",
        [n.inputs[0]],
        [_grad_type(g, w) for w in wanted],
        then_branch=backward[0],
        else_branch=backward[1],
    )
    by_name = dict(zip(wanted, outs))
    return [by_name.get(w) if k >= len(node.input) else None for k, w in enumerate(operands)]


def _grad_type(g: GradBuilder, name: str) -> ValueInfo:
    info = _value_info(g, name, None).rank_only()
    return ValueInfo(f"{name}_grad", info.dtype, info.shape, info.sequence)


def _export_branch_values(
    g: GradBuilder, node: onnx.NodeProto, branches: list[onnx.GraphProto], subs: list[GradBuilder]
) -> list[list[onnx.NodeProto]]:
    """Make what each backward branch reads from its forward branch an output of the forward If.

    Returns, per branch, the nodes that define those values in the backward branch.
    """
    prefixes: list[list[onnx.NodeProto]] = [[], []]
    for b, (branch, sub) in enumerate(zip(branches, subs)):
        other = branches[1 - b]
        outputs = [o.name for o in branch.output]
        for local, info in sub.saved.items():
            if local in outputs:  # already an output of the If
                outer = node.output[outputs.index(local)]
            else:
                outer = g.new_fwd_value(f"{local}_saved", info.rank_only())
                branch.output.append(_type(info, local))
                dummy = g.fresh(f"{local}_unused")
                other.node.append(_empty(dummy, info))
                other.output.append(_type(info, dummy))
                node.output.append(outer)
            sub.outer(g.fwd(outer))
            if outer != local:  # a branch output may carry the If output's own name (optimum)
                prefixes[b].append(helper.make_node("Identity", [outer], [local]))
    return prefixes


# ---- Loop and Scan ----------------------------------------------------------------------------
@dataclass
class _Carried:
    """A loop-carried value: output ``k`` of the node, input ``index`` of the node, its body values."""

    k: int
    index: int
    body_in: str
    body_out: str


@dataclass
class _Scanned:
    """A scan input or output: its position on the node, its body slice, axis and direction."""

    index: int
    body: str
    axis: int = 0
    reverse: bool = False


@dataclass
class _LoopSpec:
    """A Loop or a Scan, described alike."""

    node: onnx.NodeProto
    body: onnx.GraphProto
    carried: list[_Carried]
    scan_inputs: list[_Scanned] = field(default_factory=list)
    scan_outputs: list[_Scanned] = field(default_factory=list)
    iteration: str | None = None  # the body's iteration number (Loop)
    n_outputs: int = 0  # outputs the node declares: carried values, then scan outputs


@rule("Loop")
def loop_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """Backward of Loop: a Loop over the executed iterations in reverse, reading the forward's tape."""
    node = n.node
    body = graph_attr(node, "body")
    n_carried = len(node.input) - 2
    ins = [i.name for i in body.input]
    outs = [o.name for o in body.output]
    spec = _LoopSpec(
        node=node,
        body=body,
        carried=[_Carried(k, 2 + k, ins[2 + k], outs[1 + k]) for k in range(n_carried)],
        scan_outputs=[_Scanned(n_carried + k, o) for k, o in enumerate(outs[1 + n_carried :])],
        iteration=ins[0],
        n_outputs=len(outs) - 1,
    )
    return _loop_backward(g, n, spec)


@rule("Scan", since=9)
def scan_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """Backward of Scan (opset 9+): as Loop; scan input slices are re-read, their gradients stacked."""
    node = n.node
    body = graph_attr(node, "body")
    m = int(n.attr("num_scan_inputs"))
    n_state = len(node.input) - m
    n_scan_out = len(body.output) - n_state
    ins = [i.name for i in body.input]
    outs = [o.name for o in body.output]

    def attr_list(name: str, count: int) -> list[int]:
        return list(n.attr(name, None) or [0] * count)

    in_axes, in_dirs = attr_list("scan_input_axes", m), attr_list("scan_input_directions", m)
    out_axes = attr_list("scan_output_axes", n_scan_out)
    out_dirs = attr_list("scan_output_directions", n_scan_out)
    spec = _LoopSpec(
        node=node,
        body=body,
        carried=[_Carried(k, k, ins[k], outs[k]) for k in range(n_state)],
        scan_inputs=[_Scanned(n_state + k, ins[n_state + k], in_axes[k], bool(in_dirs[k])) for k in range(m)],
        scan_outputs=[
            _Scanned(n_state + k, outs[n_state + k], out_axes[k], bool(out_dirs[k]))
            for k in range(n_scan_out)
        ],
        n_outputs=len(outs),
    )
    return _loop_backward(g, n, spec)


def _loop_backward(g: GradBuilder, n: NodeContext, spec: _LoopSpec) -> Grads:
    """The reverse Loop shared by Loop and Scan (see the module docstring)."""
    node, body = spec.node, spec.body
    operands = node_operands(node)
    rows = _rows_read_by_iteration(g, n, spec, operands)
    by_rows = {s.index for s in rows}
    captures = [
        (k, w) for k, w in enumerate(operands) if k >= len(node.input) and n.needs[k] and k not in by_rows
    ]
    slices = [s for s in spec.scan_inputs if n.needs[s.index]] + rows
    carried = _carried_with_gradient(g, n, spec, {w for _, w in captures} | {s.body for s in slices})
    sub = _scope(g, body)

    # Backward iteration j handles forward iteration i = T-1-j.
    t_minus_1 = Var(g, g.fresh("trips_minus_1"), INT64, ())  # defined once the tapes are known
    j = Var(sub, sub.fresh("j"), INT64, ())
    cond = Var(sub, sub.fresh("cond"), BOOL, ())
    i = sub.op("Sub", sub.outer(t_minus_1), j, shape=())
    dcarried = [
        _new_var(sub, f"{c.body_in}_grad", _value_info(g, c.body_in, n.inputs[c.index])) for c in carried
    ]
    acc = [_new_var(sub, f"{w}_grad_acc", _value_info(g, w, None)) for _, w in captures]
    seeds = [(c.body_out, d) for c, d in zip(carried, dcarried)]
    for s in spec.scan_outputs:
        dout = n.dout[s.index] if s.index < len(n.dout) else None
        if dout is not None:
            seeds.append((s.body, sub.op("Gather", sub.outer(dout), j if s.reverse else i, axis=s.axis)))
    wanted = [c.body_in for c in carried] + [s.body for s in slices] + [w for _, w in captures]
    grads = _reverse_body(sub, body, seeds, set(wanted), wanted)
    new_carried = [_or_zeros(sub, grads[c.body_in], c.body_in) for c in carried]
    new_acc = [a if grads[w] is None else sub.sum([a, grads[w]]) for a, (_, w) in zip(acc, captures)]
    per_slice: dict[int, list[Var]] = {}  # operand -> this iteration's gradient of its slice(s)
    for s in slices:
        if grads[s.body] is not None:
            per_slice.setdefault(s.index, []).append(grads[s.body])  # type: ignore[arg-type]
    slice_grads = {k: sub.sum(parts) for k, parts in per_slice.items()}

    # What the backward body reads from the forward body is recomputed there or taped by the forward.
    prefix, tapes, copies = _define_saved(g, sub, spec, n, i, j, [*spec.scan_inputs, *rows])
    trips = _trip_count(g, n, spec, tapes, copies)
    g.nodes.append(helper.make_node("Sub", [g.read(trips), g.read(g.const(np.int64(1)))], [t_minus_1.name]))
    bwd_inputs = [v.info.rank_only().to_proto() for v in (j, cond, *dcarried, *acc)]
    bwd_outputs = [sub.op("Identity", cond), *new_carried, *new_acc, *slice_grads.values()]
    bwd_body = _subgraph(
        sub, f"{node.name or node.op_type}_grad_body", prefix, bwd_inputs, _bind_outputs(sub, bwd_outputs)
    )
    start = [_carried_grad_at_end(g, n, spec, c) for c in carried]
    start += [g.zeros_like(n.inputs[k]) for k, _ in captures]  # type: ignore[arg-type]
    out_types = [
        ValueInfo(f"{operands[c.index]}_grad", d.dtype, d.shape, d.sequence)
        for c, d in zip(carried, dcarried)
    ]
    out_types += [ValueInfo(f"{w}_grad", a.dtype, a.shape) for a, (_, w) in zip(acc, captures)]
    out_types += [ValueInfo(f"{operands[k]}_grad_slices", d.dtype, None) for k, d in slice_grads.items()]  # type: ignore[union-attr]
    results = _emit(g, "Loop", [trips, None, *start], out_types, body=bwd_body)
    _finish_forward(body, sub, copies)
    if spec.scan_inputs:
        _guard_empty_scan(g, n, spec)

    out: Grads = [None] * len(operands)
    for c, r in zip(carried, results):
        out[c.index] = r
    for (k, _), r in zip(captures, results[len(carried) :]):
        out[k] = r
    stacked = dict(zip(slice_grads, results[len(carried) + len(captures) :]))
    for s in slices:
        if out[s.index] is None:
            rows_of = trips if s.index in by_rows else None
            out[s.index] = _scan_input_grad(g, n.inputs[s.index], s, stacked.get(s.index), rows_of)  # type: ignore[arg-type]
    return out


def _rows_read_by_iteration(
    g: GradBuilder, n: NodeContext, spec: _LoopSpec, operands: list[str]
) -> list[_Scanned]:
    """Captured tensors a Loop body only reads as ``Gather(x, iteration number)`` (``x[t]`` in
    TorchScript): scanned like Scan inputs, so that the backward stacks one row gradient per
    iteration instead of adding a full-size gradient at every iteration."""
    if spec.iteration is None:
        return []
    body, node = spec.body, spec.node
    elsewhere = {o.name for o in body.output}
    for inner in body.node:
        elsewhere.update(captured_names(inner))
    found = []
    for k, w in enumerate(operands):
        info = g.infos.get(w)
        if k < len(node.input) or not n.needs[k] or w in elsewhere or info is None or info.rank is None:
            continue
        uses = [u for u in body.node if w in u.input]
        if uses and all(_reads_row(u, w, spec.iteration) for u in uses):
            found += [_Scanned(k, u.output[0]) for u in uses]
    return found


def _reads_row(node: onnx.NodeProto, x: str, iteration: str) -> bool:
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return (
        node.op_type == "Gather"
        and node.domain in ("", "ai.onnx")
        and list(node.input) == [x, iteration]
        and axis == 0
    )


def _new_var(sub: GradBuilder, hint: str, info: ValueInfo) -> Var:
    return Var(sub, sub.fresh(hint), info.dtype, info.shape, sequence=info.sequence)


def _value_info(g: GradBuilder, name: str, fallback: Var | None) -> ValueInfo:
    info = g.infos.get(name)
    if info is None and fallback is not None:
        info = fallback.info
    if info is None:
        raise GradientNotImplementedError(
            f"the type of {name!r} is unknown: shape inference could not type it"
        )
    return info


def _carried_with_gradient(
    g: GradBuilder, n: NodeContext, spec: _LoopSpec, seeds: set[str]
) -> list[_Carried]:
    """Carried values whose gradient the reverse loop carries: those whose initial value needs one,
    and those the body makes depend on a value that needs one (``seeds``, or another such carried
    value: a fixed point over the body)."""
    floats = [c for c in spec.carried if (info := g.infos.get(c.body_in)) is None or info.is_float]
    active = {c.k for c in floats if n.needs[c.index]}
    nodes = list(spec.body.node)
    while True:
        marks = mark(
            nodes,
            seeds | {c.body_in for c in floats if c.k in active},
            [],
            g.infos,
            g.versions,
            quantized_mode(g),
        )
        more = {c.k for c in floats if c.k not in active and c.body_out in marks.requires}
        if not more:
            return [c for c in floats if c.k in active]
        active |= more


def _carried_grad_at_end(g: GradBuilder, n: NodeContext, spec: _LoopSpec, c: _Carried) -> Var:
    """The gradient of a carried value's final value: the node's output gradient, or zeros."""
    dout = n.dout[c.k] if c.k < len(n.dout) else None
    if dout is not None:
        return dout
    final = n.outputs[c.k] if c.k < len(n.outputs) else None
    if final is None:  # the model does not use the final value: ask the node for it
        info = _value_info(g, c.body_out, n.inputs[c.index])
        final = g.extra_output(spec.node, c.k, info.dtype, info.shape)
    return g.zeros_like(final)


def _define_saved(
    g: GradBuilder,
    sub: GradBuilder,
    spec: _LoopSpec,
    n: NodeContext,
    i: Var,
    j: Var,
    scanned: list[_Scanned],
) -> tuple[list[onnx.NodeProto], list[Var], list[onnx.NodeProto]]:
    """Nodes defining, in the backward body, each forward-body value it reads.

    The iteration number is ``i``; a slice of a ``scanned`` tensor is gathered again from it; any
    other value is taped: stacked by the forward node as an extra scan output, gathered at ``i``.
    Returns those nodes, the tapes, and the copies the forward body needs to output its inputs.
    """
    prefix: list[onnx.NodeProto] = []
    tapes: list[Var] = []
    copies: list[onnx.NodeProto] = []
    slices = {s.body: s for s in scanned}
    for local, info in sub.saved.items():
        if local == spec.iteration:
            prefix.append(helper.make_node("Identity", [i.name], [local]))
        elif local in slices:
            s = slices[local]
            x = sub.outer(n.inputs[s.index])  # type: ignore[arg-type]
            pos = j if s.reverse else i
            prefix.append(helper.make_node("Gather", [x.name, pos.name], [local], axis=s.axis))
        elif info.sequence:
            raise GradientNotImplementedError(
                f"{spec.node.op_type} {spec.node.name!r}: the backward needs the sequence {local!r} at every "
                "iteration, and sequences cannot be stacked over the iterations"
            )
        else:
            tape = _add_tape(g, spec, local, info, copies)
            tapes.append(tape)
            prefix.append(helper.make_node("Gather", [sub.outer(tape).name, i.name], [local], axis=0))
    return prefix, tapes, copies


def _add_tape(
    g: GradBuilder, spec: _LoopSpec, local: str, info: ValueInfo, copies: list[onnx.NodeProto]
) -> Var:
    """Stack the body value ``local`` over the iterations: a new scan output of the forward node."""
    node, body = spec.node, spec.body
    value = local
    if local in {v.name for v in [*body.input, *body.output]}:  # an output must be a distinct value
        value = g.fresh(f"{local}_copy")
        copies.append(helper.make_node("Identity", [local], [value]))
        g.infos[value] = ValueInfo(value, info.dtype, info.shape)
    body.output.append(ValueInfo(value, info.dtype, info.shape).to_proto())
    while len(node.output) < spec.n_outputs:
        node.output.append("")
    elem = info.shape if info.shape is not None else None
    stacked = None if elem is None else (None, *(d if isinstance(d, int) else None for d in elem))
    name = g.new_fwd_value(f"{local}_tape", ValueInfo("", info.dtype, stacked))
    node.output.append(name)
    for attr in node.attribute:  # Scan: the tape is stacked along axis 0, in iteration order
        if attr.name in ("scan_output_axes", "scan_output_directions") and len(attr.ints):
            attr.ints.append(0)
    return g.fwd(name)


def _trip_count(
    g: GradBuilder, n: NodeContext, spec: _LoopSpec, tapes: list[Var], copies: list[onnx.NodeProto]
) -> Var:
    """The number of iterations the forward ran, as an int64 scalar of the backward graph."""
    if spec.scan_inputs:
        first = spec.scan_inputs[0]
        x = n.inputs[first.index]
        assert x is not None
        if x.shape is not None and -len(x.shape) <= first.axis < len(x.shape):
            d = x.shape[first.axis]
            if isinstance(d, int):
                return g.const(np.int64(d))
        return g.op("Gather", g.shape_of(x), g.const(np.int64(first.axis)), shape=())
    if not tapes:  # nothing taped: tape the iteration number, just to count
        assert spec.iteration is not None
        tapes.append(_add_tape(g, spec, spec.iteration, ValueInfo(spec.iteration, INT64, ()), copies))
    return g.op("Squeeze", g.op("Shape", tapes[0], start=0, end=1), [0], shape=())


def _scan_input_grad(g: GradBuilder, x: Var, s: _Scanned, stacked: Var | None, trips: Var | None) -> Var:
    """Gradient of a scanned tensor from the per-iteration gradients of its slices.

    The reverse loop stacks them last iteration first; they are put back in scan order, reshaped
    with the scan axis first (which also gives an empty result its full shape), then transposed.
    ``trips``: a Loop reading rows ``0..trips-1`` of ``x``, whose other rows get zeros.
    """
    if stacked is None:  # the body does not use the slices differentiably
        return g.zeros_like(x)
    if not s.reverse:
        stacked = flip(g, stacked)
    if trips is not None:
        shape = g.shape_of(x)
        count = g.op("Unsqueeze", trips, [0])
        rows = g.op(
            "Reshape",
            stacked,
            g.op("Concat", count, g.op("Slice", shape, [1], [_INT64_MAX]), axis=0),
            allowzero=1,
        )
        missing = g.op("Sub", g.op("Slice", shape, [0], [1]), count)
        pads = g.op(
            "Concat",
            g.const(np.zeros(x.rank, np.int64)),
            missing,
            g.const(np.zeros(x.rank - 1, np.int64)),
            axis=0,
        )  # type: ignore[operator]
        return g.op("Pad", rows, pads, shape=x.shape)
    axis = s.axis
    if axis == 0:
        return g.op("Reshape", stacked, g.shape_of(x), allowzero=1, shape=x.shape)
    if x.rank is None:
        raise GradientNotImplementedError(f"Scan over axis {axis} of {x.name!r}: its rank must be known")
    axis %= x.rank
    front = [axis] + [d for d in range(x.rank) if d != axis]
    front_shape = g.op("Gather", g.shape_of(x), front)
    moved = g.op("Reshape", stacked, front_shape, allowzero=1)
    return g.op("Transpose", moved, perm=[front.index(d) for d in range(x.rank)], shape=x.shape)


def _guard_empty_scan(g: GradBuilder, n: NodeContext, spec: _LoopSpec) -> None:
    """Wrap the forward Scan in an If that skips it over an empty sequence (onnxruntime fails there).

    Skipped, it returns its initial states and empty scan outputs (dims unknown before running the
    body are 0 there).
    """
    node, first = spec.node, spec.scan_inputs[0]
    x = n.inputs[first.index]
    assert x is not None
    d = x.shape[first.axis] if x.shape is not None and -len(x.shape) <= first.axis < len(x.shape) else None
    if isinstance(d, int) and d > 0:
        return  # never empty
    # Shape, Gather and Cast: in the forward graph, at the model's opset
    length = g.fwd_op(
        "Gather", g.fwd_op("Shape", x, dtype=INT64), g.fwd_const(first.axis), dtype=INT64, shape=()
    )
    nonempty = g.fwd_op("Cast", length, dtype=BOOL, shape=(), to=TensorProto.BOOL)
    n_state = len(spec.carried)
    body_outs = [o.name for o in spec.body.output]
    outs = [o or g.fresh("unused") for o in node.output]
    while len(outs) < len(body_outs):
        outs.append(g.fresh("unused"))
    scan = onnx.NodeProto()
    scan.CopyFrom(node)
    inner = [g.fresh(f"{o}_scan") for o in outs]
    del scan.output[:]
    scan.output.extend(inner)
    then_types, else_nodes, else_types = [], [], []
    for k, (o, b_out) in enumerate(zip(outs, body_outs)):
        elem = _value_info(g, b_out, None)
        empty = g.fresh(f"{o}_empty")
        if k < n_state:
            then_types.append(_type(elem, inner[k]))
            else_nodes.append(helper.make_node("Identity", [node.input[k]], [empty]))
            else_types.append(_type(elem, empty))
            continue
        axis = spec.scan_outputs[k - n_state].axis if k - n_state < len(spec.scan_outputs) else 0
        dims = [d if isinstance(d, int) else 0 for d in elem.shape] if elem.shape is not None else None
        if dims is not None:
            dims.insert(axis if axis >= 0 else axis + len(dims) + 1, 0)
        stacked = ValueInfo(o, elem.dtype, None if dims is None else tuple(dims))
        then_types.append(_type(stacked, inner[k]))
        else_nodes.append(_empty(empty, stacked, dims))
        else_types.append(_type(stacked, empty))
    guarded = helper.make_node(
        "If",
        [nonempty.name],
        outs,
        name=node.name,
        then_branch=helper.make_graph([scan], f"{node.name or 'Scan'}_nonempty", [], then_types),
        else_branch=helper.make_graph(else_nodes, f"{node.name or 'Scan'}_empty", [], else_types),
    )
    node.CopyFrom(guarded)
