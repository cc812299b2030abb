"""Softmax and LogSoftmax, in every opset form (one axis from opset 13, flattened trailing dims before).

Both backwards are one sum over the softmax axes: dx = y (dy - sum(dy y)) and dx = dy - exp(y) sum(dy).
Hardmax, a one-hot of the argmax, has no gradient (:mod:`.nondiff`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..builder import GradBuilder, Var, exp
from ..registry import NodeContext, rule
from .common import Grads


def _softmax_grad(
    g: GradBuilder, n: NodeContext, fn: Callable[[Var, Var, Callable[[Var], Var]], Var]
) -> Grads:
    """Call ``fn(y, dy, sum_over_softmax_axes)`` in the node's opset semantics.

    From opset 13 the normalization runs over one axis (default -1). Before, it runs over the
    flattened dims ``[axis:]`` (default 1): a sum over all those axes with keepdims, or, when the
    rank is unknown and the axis non-negative, over the 2-D ``Flatten`` of the tensors.
    """
    if not n.needs[0]:
        return [None]
    y, dy = n.y, n.dy
    if n.opset >= 13:
        axis = int(n.attr("axis", -1))
        return [fn(y, dy, lambda v: g.reduce_sum(v, [axis], keepdims=True))]
    axis = int(n.attr("axis", 1))
    rank = y.rank
    if rank is not None or axis < 0:
        axes = list(range(axis, 0)) if rank is None else list(range(axis % rank, rank))
        return [fn(y, dy, lambda v: g.reduce_sum(v, axes, keepdims=True))]
    y2, dy2 = g.Flatten(y, axis=axis), g.Flatten(dy, axis=axis)
    dx2 = fn(y2, dy2, lambda v: g.reduce_sum(v, [1], keepdims=True))
    return [g.Reshape(dx2, g.Shape(dy))]


@rule("Softmax")
def softmax(g: GradBuilder, n: NodeContext) -> Grads:
    """y = softmax(x): dx = y (dy - sum(dy y))."""
    return _softmax_grad(g, n, lambda y, dy, s: y * (dy - s(dy * y)))


@rule("LogSoftmax")
def log_softmax(g: GradBuilder, n: NodeContext) -> Grads:
    """y = log softmax(x): dx = dy - exp(y) sum(dy)."""
    return _softmax_grad(g, n, lambda y, dy, s: dy - exp(y) * s(dy))
