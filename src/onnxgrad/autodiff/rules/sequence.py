"""Sequence and optional ops: the gradient of a sequence is the sequence of its elements' gradients.

Each rule is the adjoint of its op, written with the sequence ops themselves: SequenceConstruct and
SequenceAt, ConcatFromSequence and SplitToSequence, SequenceInsert and SequenceErase are each
other's transposes. Positions are made non-negative with the forward sequence's length (saved, one
int64); a zero gradient for a whole sequence is built from its elements' shapes (saved as an
``[n, rank]`` tensor, see :meth:`~onnxgrad.autodiff.builder.GradBuilder.shape_of`), never from the
elements themselves.

``Optional`` wraps a tensor and ``OptionalGetElement`` unwraps it: each is the other's adjoint, so
the gradient passes through them like Identity. The engine types values as tensors or sequences of
tensors only, so a gradient through an optional value works when it flows straight from an
``OptionalGetElement`` back to an ``Optional`` (nothing optional is saved or zero-filled); anything
needing the optional's type (a zero gradient for it, an optional sequence) is refused.

SequenceMap runs a graph per element: its rule would differentiate the body per element like Loop;
it is refused with :class:`~onnxgrad.errors.GradientNotImplementedError`. SequenceLength,
SequenceEmpty and OptionalHasElement carry no gradient (:mod:`.nondiff`).
"""

from __future__ import annotations

import numpy as np

from ...model.graph import to_array
from ..builder import INT64, GradBuilder, Var, where, zero_tensor
from ..registry import NodeContext, rule
from .common import Grads, optional_input, refuse


def _position(g: GradBuilder, seq: Var, pos: Var | None, default_end: bool) -> Var:
    """``pos`` as a non-negative int64 scalar index into ``seq`` (the forward sequence).

    Absent, it is the end (``len``, where SequenceInsert appends) or the last element (``len - 1``,
    what SequenceErase removes).
    """
    if pos is not None and pos.name in g.consts:
        value = int(to_array(g.consts[pos.name]))
        if value >= 0:  # known and already an index: no length needed
            return g.const(np.int64(value))
    length = g.length_of(seq)
    if pos is None:
        return length if default_end else length - 1
    p = pos if pos.dtype == INT64 else g.op("Cast", pos, to=INT64)
    return where(p < 0, p + length, p)


@rule("SequenceConstruct")
def sequence_construct_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``S = [x_0, ..., x_k]``: ``dx_i = dS[i]``."""
    return [
        g.op("SequenceAt", n.dy, g.const(np.int64(i)), dtype=x.dtype, shape=x.shape) if need else None
        for i, (x, need) in enumerate(zip(n.inputs, n.needs))
    ]


@rule("SequenceAt")
def sequence_at_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``y = S[p]``: ``dS`` is zero but at ``p``, where it is ``dy``."""
    seq, pos = n.inputs
    p = _position(g, seq, pos, default_end=False)
    rest = g.op("SequenceErase", g.zeros_like(seq), p)
    return [g.op("SequenceInsert", rest, n.dy, p, dtype=seq.dtype, shape=seq.shape), None]


@rule("SequenceInsert")
def sequence_insert_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``S' = insert(S, t, p)``: ``dt = dS'[p]``, ``dS = erase(dS', p)``."""
    seq, t = n.inputs[0], n.inputs[1]
    p = _position(g, seq, optional_input(n, 2), default_end=True)
    dseq = g.op("SequenceErase", n.dy, p, dtype=seq.dtype, shape=seq.shape) if n.needs[0] else None
    dt = g.op("SequenceAt", n.dy, p, dtype=t.dtype, shape=t.shape) if n.needs[1] else None
    return [dseq, dt, None]


@rule("SequenceErase")
def sequence_erase_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``S' = erase(S, p)``: ``dS = insert(dS', zeros like S[p], p)``."""
    seq = n.inputs[0]
    p = _position(g, seq, optional_input(n, 1), default_end=False)
    erased = g.op("ConstantOfShape", g.op("Gather", g.shape_of(seq), p), value=zero_tensor(seq.dtype))
    return [g.op("SequenceInsert", n.dy, erased, p, dtype=seq.dtype, shape=seq.shape), None]


@rule("ConcatFromSequence")
def concat_from_sequence_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``y = concat(S, axis)`` (a stack with ``new_axis=1``): ``dS = split(dy)`` at the elements' sizes."""
    seq = n.inputs[0]
    axis = int(n.attr("axis"))
    if n.attr("new_axis", 0):
        return [g.op("SplitToSequence", n.dy, axis=axis, keepdims=0, dtype=seq.dtype, shape=seq.shape)]
    size = seq.shape[axis] if seq.shape is not None and -len(seq.shape) <= axis < len(seq.shape) else None
    if isinstance(size, int):  # every element has this size along the axis: equal chunks
        split = g.const(np.int64(size))
    else:
        split = g.op("Gather", g.shape_of(seq), g.const(np.int64(axis)), axis=1)
    return [g.op("SplitToSequence", n.dy, split, axis=axis, dtype=seq.dtype, shape=seq.shape)]


@rule("SplitToSequence")
def split_to_sequence_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``S = split(x, axis)``: ``dx = concat(dS, axis)``, a stack where the split dropped the axis."""
    x = n.inputs[0]
    dropped = optional_input(n, 1) is None and not n.attr("keepdims", 1)
    axis = int(n.attr("axis", 0))
    dx = g.op("ConcatFromSequence", n.dy, axis=axis, new_axis=int(dropped), dtype=x.dtype, shape=x.shape)
    return [dx, None]


# ---- optionals -------------------------------------------------------------------------------
@rule("Optional")
def optional_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``o = Optional(x)``: ``dx = OptionalGetElement(do)``."""
    if not n.inputs or n.inputs[0] is None:
        return []  # an empty optional: nothing to differentiate
    x = n.inputs[0]
    if x.sequence:
        raise refuse(n, "optional sequences are not supported, only optional tensors")
    return [g.op("OptionalGetElement", n.dy, dtype=x.dtype, shape=x.shape)]


@rule("OptionalGetElement")
def optional_get_element_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``y = OptionalGetElement(o)``: ``do = Optional(dy)``; on a plain tensor (opset 18+) ``dx = dy``."""
    if n.y.sequence:
        raise refuse(n, "optional sequences are not supported, only optional tensors")
    # ONNX shape inference types tensors but the engine does not keep optional types: an input it
    # could not type (no rank) is the optional; a typed one is a tensor and the op is Identity.
    if n.x.rank is not None:
        return [n.dy]
    return [g.op("Optional", n.dy, dtype=n.y.dtype, shape=n.y.shape)]


@rule("SequenceMap")
def sequence_map_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """Refused: the body would have to be differentiated per element (as Loop does)."""
    raise refuse(
        n,
        "SequenceMap is not differentiable in onnxgrad yet; rewrite it as a Loop over the sequence "
        "(Loop is supported) or mark the values before it as not trainable",
    )
