"""Reductions: every ``Reduce*`` op in every opset form, and the cumulative CumSum and CumProd.

Reduction gradients are written in the *keepdims layout*: the output and its gradient first get the
reduced axes back as size-1 dims (``Unsqueeze``, skipped when ``keepdims=1``), after which
broadcasting against the input does the expansion. That layout needs no static shape, so one rule
covers axes as an attribute (before opset 13 for ReduceSum, 18 for the others) or as an input
(constant or computed at run time), negative axes, absent axes (= all) and
``noop_with_empty_axes`` (where the op is elementwise and so is its gradient).

A cumulative sum is transposed by the cumulative sum in the other direction; CumProd's backward is
exact where x has zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..builder import GradBuilder, Var, cast, exp, sign, where
from ..registry import NodeContext, rule
from .common import Grads, first_only, max_grad


@dataclass(frozen=True)
class Reduction:
    """Which axes a forward reduction reduced, in a form the backward can reuse.

    ``axes``: an int64 Var (constant or forward value), or ``None`` for every axis.
    ``identity``: axes known empty with ``noop_with_empty_axes``: the op was elementwise.
    ``noop``: the ``noop_with_empty_axes`` flag, passed on when ``axes`` is only known at run time.
    """

    axes: Var | None
    keepdims: bool
    noop: bool = False
    identity: bool = False
    static: tuple[int, ...] | None = None  # the axes when known before running

    def keep(self, g: GradBuilder, v: Var) -> Var:
        """``v`` (shaped like the output) with the reduced axes back as size-1 dims."""
        if self.keepdims or self.identity or self.axes is None:
            return v  # already aligned, or a scalar that broadcasts
        return g.Unsqueeze(v, self.axes)

    def reduce(self, g: GradBuilder, op: str, v: Var) -> Var:
        """``op`` over the same axes as the forward, keeping dims (aligned with the input)."""
        if self.identity:
            return v
        if self.axes is None:
            return g.op(op, v, keepdims=1)
        return g.op(op, v, self.axes, keepdims=1, noop_with_empty_axes=int(self.noop) or None)


def reduction_of(g: GradBuilder, n: NodeContext, axes_input_since: int) -> Reduction:
    """The axes of a ``Reduce*`` node in any opset form (attribute before ``axes_input_since``)."""
    keepdims = bool(n.attr("keepdims", 1))
    noop = bool(n.attr("noop_with_empty_axes", 0))
    if n.opset >= axes_input_since:
        axes_var = n.inputs[1] if len(n.inputs) > 1 else None
        value = n.const_input(1)
        if axes_var is not None and value is None:  # computed at run time
            return Reduction(axes_var, keepdims, noop=noop)
        axes = None if value is None else [int(a) for a in np.asarray(value).reshape(-1)]
    else:
        attr = n.attr("axes")
        axes = None if attr is None else [int(a) for a in attr]
    if not axes:
        if noop:  # the op was elementwise (the pre-step of L1, L2, LogSum... applied alone)
            return Reduction(None, keepdims, identity=True, static=())
        return Reduction(None, keepdims)
    return Reduction(g.const(np.array(axes, dtype=np.int64)), keepdims, static=tuple(axes))


def _expand(g: GradBuilder, v: Var, x: Var) -> Var:
    return g.Expand(v, g.shape_of(x), shape=x.shape)


def _reduced_count(g: GradBuilder, x: Var, dy: Var, red: Reduction) -> Var:
    """How many input elements each output element summarizes, as a scalar of x's dtype."""
    shape = x.static_shape
    if shape is not None and (red.static is not None or red.axes is None):
        axes = range(len(shape)) if red.axes is None else red.static
        return g.const(float(np.prod([shape[a] for a in axes or ()], dtype=np.float64)), x.dtype)
    # At run time: size(x) / size(y), where size(y) is read from the gradient (no saved value).
    size_x = g.ReduceProd(g.shape_of(x), keepdims=0)
    return g.Cast(g.Div(size_x, g.Size(dy)), to=x.dtype)


def _axes_since(op: str) -> int:
    return 13 if op == "ReduceSum" else 18


def _reduce_rule(op: str, grad: Callable[[GradBuilder, NodeContext, Reduction], Var]) -> None:
    def fn(g: GradBuilder, n: NodeContext) -> Grads:
        if not n.needs[0]:
            return [None]
        red = reduction_of(g, n, _axes_since(op))
        return [grad(g, n, red)]

    fn.__name__ = f"grad_{op}"
    fn.__doc__ = grad.__doc__
    rule(op)(fn)


def _sum(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """dx = dy broadcast back over the reduced axes."""
    return _expand(g, red.keep(g, n.dy), n.x)


def _mean(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """dx = dy / count, broadcast back over the reduced axes."""
    if red.identity:
        return n.dy
    return _expand(g, red.keep(g, n.dy) / _reduced_count(g, n.x, n.dy, red), n.x)


def _extremum(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """dx = dy * [x == y] / #ties: ties share the gradient evenly."""
    if red.identity:
        return n.dy
    return max_grad(g, n.x, red.keep(g, n.y), red.keep(g, n.dy), lambda m: red.reduce(g, "ReduceSum", m))


def _prod(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """dx_i = dy * prod_{j != i} x_j, exact with zeros (no division by x where x == 0).

    With P the product of the non-zero elements and Z the number of zeros in a slice: no zero gives
    P / x_i; one zero gives P at the zero and 0 elsewhere; two or more give 0 everywhere.
    """
    if red.identity:
        return n.dy
    x = n.x
    is_zero = g.Equal(x, 0)
    nonzero = where(is_zero, 1, x)
    p = red.reduce(g, "ReduceProd", nonzero)
    zeros = red.reduce(g, "ReduceSum", g.Cast(is_zero, to=x.dtype))
    at_zero = where(g.Equal(zeros, 1), p, 0)
    elsewhere = where(g.Equal(zeros, 0), p / nonzero, 0)
    return red.keep(g, n.dy) * where(is_zero, at_zero, elsewhere)


def _sum_square(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """y = sum x^2: dx = 2 x dy."""
    return n.x * 2 * red.keep(g, n.dy)


def _l1(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """y = sum |x|: dx = sign(x) dy."""
    return sign(n.x) * red.keep(g, n.dy)


def _l2(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """y = sqrt(sum x^2): dx = x dy / y, and 0 where y == 0 (as PyTorch's norm)."""
    y, dy = n.y, n.dy
    return n.x * red.keep(g, where(g.Equal(y, 0), 0, dy / y))


def _log_sum(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """y = log(sum x): dx = dy / sum x = dy exp(-y), broadcast back."""
    return _expand(g, red.keep(g, n.dy * exp(-n.y)), n.x)


def _log_sum_exp(g: GradBuilder, n: NodeContext, red: Reduction) -> Var:
    """y = log(sum exp x): dx = dy softmax(x) = dy exp(x - y)."""
    return exp(n.x - red.keep(g, n.y)) * red.keep(g, n.dy)


for _op, _fn in {
    "ReduceSum": _sum,
    "ReduceMean": _mean,
    "ReduceMax": _extremum,
    "ReduceMin": _extremum,
    "ReduceProd": _prod,
    "ReduceSumSquare": _sum_square,
    "ReduceL1": _l1,
    "ReduceL2": _l2,
    "ReduceLogSum": _log_sum,
    "ReduceLogSumExp": _log_sum_exp,
}.items():
    _reduce_rule(_op, _fn)


# ---- cumulative ops ----------------------------------------------------------------------------
@rule("CumSum")
def cum_sum(g: GradBuilder, n: NodeContext) -> Grads:
    """y_i = sum of x_j for j before i (inclusive or not): dx_j = the sum of dy_i over the same i,
    which is CumSum(dy) in the opposite direction with the same ``exclusive``."""
    dx = g.CumSum(
        n.dy,
        n.inputs[1],
        exclusive=int(n.attr("exclusive", 0)),
        reverse=1 - int(n.attr("reverse", 0)),
        shape=n.x.shape,
    )
    return first_only(n, dx)


@rule("CumProd", since=26)
def cum_prod(g: GradBuilder, n: NodeContext) -> Grads:
    """y_i = product of x_j for j before i: dx_k = sum over i after k of dy_i * prod_{j before i, j != k} x_j.

    Exact with zeros (as torch.cumprod), per line along the axis, with z the first zero:
    before z, dx_k = rcumsum(dy * y)_k / x_k (no zero divides); at z, dx_z = rcumsum(dy * y')_z
    where y' is the CumProd of x with that zero replaced by 1; after z, dx = 0.
    """
    if not n.needs[0]:
        return first_only(n, None)
    x, y, dy, axis = n.x, n.y, n.dy, n.inputs[1]
    excl, rev = int(n.attr("exclusive", 0)), int(n.attr("reverse", 0))

    def rcumsum(t: Var) -> Var:
        return g.CumSum(t, axis, exclusive=excl, reverse=1 - rev, shape=x.shape)

    is_zero = g.Equal(x, g.const(0.0, x.dtype))
    zeros_so_far = g.CumSum(cast(is_zero, x), axis, reverse=rev)  # inclusive count, forward order
    before = zeros_so_far < 0.5
    first = g.And(is_zero, zeros_so_far < 1.5)
    safe = where(is_zero, 1.0, x)
    dx_before = rcumsum(dy * y) / safe
    y_skip = g.CumProd(where(first, 1.0, x), axis, exclusive=excl, reverse=rev, shape=x.shape)
    dx_first = rcumsum(dy * y_skip)
    return first_only(n, where(before, dx_before, where(first, dx_first, 0.0)))
