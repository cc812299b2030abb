"""The normalization family: InstanceNormalization, GroupNormalization, LpNormalization, LRN,
MeanVarianceNormalization, RMSNormalization, and the backward they share with LayerNormalization and
BatchNormalization (whose rules live in ``nn.py``).

Every standardization ``xh = (x - mean(x)) inv`` with ``inv = (var(x) + eps)^-1/2`` over some set
of elements has the same backward (:func:`normalize_backward`), whatever the set: trailing axes
(LayerNormalization, RMSNormalization), spatial axes (InstanceNormalization, BatchNormalization in
training mode, MeanVarianceNormalization) or channel groups (GroupNormalization). The statistics
are recomputed from ``x`` in the backward (:func:`standardize`): ``x`` is read anyway, and these ops
have no output that holds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ...errors import GradientNotImplementedError
from ..builder import GradBuilder, Var, sign, where
from ..registry import NodeContext, rule

Reducer = Callable[[Var], Var]  # the mean over the normalized elements, dims kept


def node_label(n: NodeContext) -> str:
    """``"Op node 'name'"``, to start error messages with."""
    return f"{n.node.op_type} node {n.node.name!r}"


def norm_axes(n: NodeContext, x: Var, axis: int) -> list[int]:
    """The axes ``[axis, rank)``; negative when the rank is unknown."""
    if x.rank is not None:
        return list(range(axis % x.rank, x.rank))
    if axis < 0:
        return list(range(axis, 0))
    raise GradientNotImplementedError(f"{node_label(n)}: the rank of its input must be known")


def mean_over(g: GradBuilder, axes: list[int]) -> Reducer:
    """A :data:`Reducer` averaging over ``axes``."""
    return lambda v: g.ReduceMean(v, axes, keepdims=1)


def normalized_count(g: GradBuilder, x: Var, axes: list[int], stat: Var) -> Var:
    """D, the number of elements each statistic summarizes: size(x) / size(statistic)."""
    static = x.static_shape
    if static is not None:
        return g.const(float(math.prod(static[a] for a in axes)), x.dtype)
    size_x = g.ReduceProd(g.shape_of(x), keepdims=0)
    return g.Cast(g.Div(size_x, g.Size(stat)), to=x.dtype)


def standardize(g: GradBuilder, x: Var, mean: Reducer, eps: float, centered: bool = True) -> tuple[Var, Var]:
    """``(xh, inv)`` recomputed from ``x``: inv = (mean((x - mean x)^2) + eps)^-1/2, xh = (x - mean x) inv.

    Uncentered (RMS normalization): inv = (mean(x^2) + eps)^-1/2 and xh = x inv.

    Centered, the mean is taken twice: ``x - mean(x)`` is exact where x is near its mean, but the
    mean itself is rounded to x's precision, a shift of up to half a unit in the last place of the
    mean that every xh would carry (for a float32 channel of mean 1000 and std 1: 3e-5, which made
    the scale's gradient 3x further from float64 than torch's); the mean of the centered values
    measures that shift and the second subtraction removes it.
    """
    if centered:
        xc = x - mean(x)
        xc = xc - mean(xc)
    else:
        xc = x
    inv = g.Reciprocal(g.Sqrt(mean(xc * xc) + eps))
    return xc * inv, inv


def normalize_backward(
    dxh: Var, xh: Var, inv: Var, mean: Reducer, centered: bool = True, coupling: Var | None = None
) -> Var:
    """dx of xh = (x - mean(x)) inv(x), given dxh = dL/dxh.

    With inv = (var + eps)^-1/2 (so d inv / dx = -inv^3 (x - mean) / D):
    ``dx = inv (dxh - mean(dxh) - xh mean(dxh xh))``; uncentered (xh = x inv, inv from mean(x^2)),
    the ``mean(dxh)`` term goes. ``coupling`` multiplies the last term when inv is not of that form
    (MeanVarianceNormalization adds eps to the standard deviation, not to the variance).
    """
    proj = mean(dxh * xh)
    if coupling is not None:
        proj = proj * coupling
    out = dxh - xh * proj
    if centered:
        out = out - mean(dxh)
    return inv * out


# ---- InstanceNormalization and GroupNormalization -------------------------------------------
def _grouped_norm(
    g: GradBuilder, n: NodeContext, groups: int, eps: float, per_channel: bool
) -> list[Var | None]:
    """Normalization over groups of channels (and all spatial positions), with an affine map.

    Computed on 3-D views: x as (N, groups, L) for the statistics (``groups=0``: one group per
    channel), and dy as (N, C, L) for a per-channel scale and bias, or (N, groups, L) for per-group
    ones. Any rank works, and only x's run-time shape is needed to undo the views.
    """
    x, scale = n.inputs[0], n.inputs[1]
    assert x is not None and scale is not None
    bias = n.inputs[2] if len(n.inputs) > 2 else None
    dy = n.dy
    grads: list[Var | None] = [None] * len(n.inputs)
    stat_view = [0, groups, -1]
    dy_v = g.Reshape(dy, [0, 0, -1] if per_channel else stat_view)  # the layout of scale and bias
    if bias is not None and n.needs[2]:
        grads[2] = g.reduce_sum(dy_v, [0, 2], keepdims=False)
    if not (n.needs[0] or n.needs[1]):
        return grads
    mean = mean_over(g, [2])
    xh, inv = standardize(g, g.Reshape(x, stat_view), mean, eps)
    if n.needs[1]:
        xh_v = g.Reshape(xh, g.Shape(dy_v)) if per_channel else xh
        grads[1] = g.reduce_sum(dy_v * xh_v, [0, 2], keepdims=False)
    if n.needs[0]:
        dxh = dy_v * g.Unsqueeze(scale, [1])
        if per_channel:
            dxh = g.Reshape(dxh, stat_view)
        dx = normalize_backward(dxh, xh, inv, mean)
        grads[0] = g.Reshape(dx, g.shape_of(x), shape=x.shape)
    return grads


@rule("InstanceNormalization")
def instance_norm(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = xh scale[c] + B[c], xh standardized over the spatial dims of each (n, c).

    dx = normalize_backward(dy scale); dscale = sum(dy xh); dB = sum(dy), sums over N and space.
    """
    return _grouped_norm(g, n, 0, float(n.attr("epsilon", 1e-5)), per_channel=True)


@rule("GroupNormalization", since=18)
def group_norm(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = xh scale + bias, xh standardized over each group of C / num_groups channels (and space).

    Opset 18 has one scale and bias per group, opset 21 one per channel; the backward is the same
    as :func:`instance_norm` over groups.
    """
    groups = int(n.attr("num_groups"))
    return _grouped_norm(g, n, groups, float(n.attr("epsilon", 1e-5)), per_channel=n.opset >= 21)


# ---- RMSNormalization and MeanVarianceNormalization -----------------------------------------
@rule("RMSNormalization", since=23)
def rms_norm(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = x inv scale with inv = (mean(x^2) + eps)^-1/2 over the axes [axis, rank).

    dx = inv (dxh - xh mean(dxh xh)) with dxh = dy scale, xh = x inv; dscale = sum(dy xh).
    """
    x, scale = n.inputs[0], n.inputs[1]
    assert x is not None and scale is not None
    mean = mean_over(g, norm_axes(n, x, int(n.attr("axis", -1))))
    xh, inv = standardize(g, x, mean, float(n.attr("epsilon", 1e-5)), centered=False)
    grads: list[Var | None] = [None, None]
    if n.needs[0]:
        grads[0] = normalize_backward(n.dy * scale, xh, inv, mean, centered=False)
    if n.needs[1]:
        grads[1] = g.unbroadcast(n.dy * xh, scale, x.shape)
    return grads


_MVN_EPS = 1e-9  # fixed by the ONNX function body, added to the standard deviation


@rule("MeanVarianceNormalization")
def mean_variance_norm(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = (x - mean) / (std + 1e-9) over ``axes`` (default [0, 2, 3]).

    With inv = 1 / (std + eps): d inv / dx = -inv^2 (x - mean) / (D std), so dx is
    :func:`normalize_backward` with the last term scaled by (std + eps) / std (1 where std = 0:
    xh = 0 there and the term vanishes).
    """
    if not n.needs[0]:
        return [None]
    x = n.x
    mean = mean_over(g, [int(a) for a in n.attr("axes", [0, 2, 3])])
    xc = x - mean(x)
    std = g.Sqrt(mean(xc * xc))
    inv = g.Reciprocal(std + _MVN_EPS)
    coupling = (std + _MVN_EPS) / where(g.Equal(std, 0), _MVN_EPS, std)
    return [normalize_backward(n.dy, xc * inv, inv, mean, coupling=coupling)]


# ---- LpNormalization and LRN ----------------------------------------------------------------
@rule("LpNormalization")
def lp_norm(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = x / |x|_p along ``axis`` (0 where the norm is 0), p = 1 or 2.

    With r = |x|_p and y = x / r: dx = (dy - dr sum(dy y)) / r, where dr = dr/dx is y (p = 2) or
    sign(x) (p = 1); 0 where r = 0, as the forward. r is recomputed from x.
    """
    if not n.needs[0]:
        return [None]
    p, axis = int(n.attr("p", 2)), int(n.attr("axis", -1))
    if p not in (1, 2):
        raise GradientNotImplementedError(f"{node_label(n)}: LpNormalization with p={p} (only 1 and 2)")
    x = n.x
    r = g.op("ReduceL2" if p == 2 else "ReduceL1", x, [axis], keepdims=1)
    zero = g.Equal(r, 0)
    safe = where(zero, 1, r)
    y = x / safe
    dr = y if p == 2 else sign(x)
    dx = (n.dy - dr * g.reduce_sum(n.dy * y, [axis], keepdims=True)) / safe
    return [where(zero, 0, dx)]


def _channel_window_sum(g: GradBuilder, v: Var, like: Var, size: int, before: int) -> Var:
    """Sum of ``v`` over the channel window [c - before, c - before + size) of each channel c.

    One ``Conv`` with a ones kernel on the view (N, 1, C, L) of v, zero padded along C.
    """
    view = g.Reshape(g.Unsqueeze(v, [1]), [0, 0, 0, -1])
    ones = g.const(np.ones((1, 1, size, 1)), v.dtype)
    summed = g.Conv(view, ones, pads=[before, 0, size - 1 - before, 0])
    return g.Reshape(summed, g.shape_of(like), shape=like.shape)


@rule("LRN")
def lrn(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = x s^-beta with s = bias + alpha / size * W(x^2), W the sum over a window of channels
    [c - floor((size - 1) / 2), c + ceil((size - 1) / 2)].

    dx = dy s^-beta - 2 alpha beta / size * x W'(dy y / s), W' the window sum mirrored (the
    adjoint of W).
    """
    if not n.needs[0]:
        return [None]
    x, dy = n.x, n.dy
    size = int(n.attr("size"))
    alpha, beta = float(n.attr("alpha", 1e-4)), float(n.attr("beta", 0.75))
    bias = float(n.attr("bias", 1.0))
    before = (size - 1) // 2
    s = _channel_window_sum(g, x * x, x, size, before) * (alpha / size) + bias
    s_pow = g.Pow(s, g.const(-beta, x.dtype))
    back = _channel_window_sum(g, dy * x * s_pow / s, x, size, size - 1 - before)
    return [dy * s_pow - x * back * (2 * alpha * beta / size)]
