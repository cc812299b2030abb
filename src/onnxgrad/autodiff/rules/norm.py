"""The normalization family: LayerNormalization, BatchNormalization, InstanceNormalization,
GroupNormalization, RMSNormalization, MeanVarianceNormalization, LpNormalization and LRN.

Every standardization ``xh = (x - mean(x)) inv`` with ``inv = (var(x) + eps)^-1/2`` over some set
of elements has the same backward (:func:`normalize_backward`), whatever the set: trailing axes
(LayerNormalization, RMSNormalization), spatial axes (InstanceNormalization, BatchNormalization in
training mode, MeanVarianceNormalization) or channel groups (GroupNormalization). The statistics
are recomputed from ``x`` in the backward (:func:`standardize`): ``x`` is read anyway, and these ops
have no output that holds them, except LayerNormalization, whose forward node computes its mean
and inverse standard deviation anyway (the rule reads them).

onnxruntime's fused normalizations compose the same pieces: SkipLayerNormalization and
SkipSimplifiedLayerNormalization (``com.microsoft``: the residual sum normalized), the default
domain's SimplifiedLayerNormalization (RMS) and LayerNormalization before opset 17, and
EmbedLayerNormalization (``com.microsoft``: embeddings gathered, summed and normalized).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto

from ...errors import GradientNotImplementedError
from ...model.contrib_schemas import MS_DOMAIN
from ..builder import GradBuilder, Var, cast, sign, where
from ..registry import NodeContext, rule
from .common import Grads, as_int64, node_label, optional_input, refuse_output_grads, zeros

Reducer = Callable[[Var], Var]  # the mean over the normalized elements, dims kept


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
def _grouped_norm(g: GradBuilder, n: NodeContext, groups: int, eps: float, per_channel: bool) -> Grads:
    """Normalization over groups of channels (and all spatial positions), with an affine map.

    Computed on 3-D views: x as (N, groups, L) for the statistics (``groups=0``: one group per
    channel), and dy as (N, C, L) for a per-channel scale and bias, or (N, groups, L) for per-group
    ones. Any rank works, and only x's run-time shape is needed to undo the views.
    """
    x, scale = n.inputs[0], n.inputs[1]
    assert x is not None and scale is not None
    bias = n.inputs[2] if len(n.inputs) > 2 else None
    dy = n.dy
    grads: Grads = [None] * len(n.inputs)
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
def instance_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """y = xh scale[c] + B[c], xh standardized over the spatial dims of each (n, c).

    dx = normalize_backward(dy scale); dscale = sum(dy xh); dB = sum(dy), sums over N and space.
    """
    return _grouped_norm(g, n, 0, float(n.attr("epsilon", 1e-5)), per_channel=True)


@rule("GroupNormalization", since=18)
def group_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """y = xh scale + bias, xh standardized over each group of C / num_groups channels (and space).

    Opset 18 has one scale and bias per group, opset 21 one per channel; the backward is the same
    as :func:`instance_norm` over groups.
    """
    groups = int(n.attr("num_groups"))
    return _grouped_norm(g, n, groups, float(n.attr("epsilon", 1e-5)), per_channel=n.opset >= 21)


# ---- RMSNormalization and MeanVarianceNormalization -----------------------------------------
@rule("RMSNormalization", since=23)
def rms_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """y = x inv scale with inv = (mean(x^2) + eps)^-1/2 over the axes [axis, rank).

    dx = inv (dxh - xh mean(dxh xh)) with dxh = dy scale, xh = x inv; dscale = sum(dy xh).
    """
    x, scale = n.inputs[0], n.inputs[1]
    assert x is not None and scale is not None
    mean = mean_over(g, norm_axes(n, x, int(n.attr("axis", -1))))
    xh, inv = standardize(g, x, mean, float(n.attr("epsilon", 1e-5)), centered=False)
    grads: Grads = [None, None]
    if n.needs[0]:
        grads[0] = normalize_backward(n.dy * scale, xh, inv, mean, centered=False)
    if n.needs[1]:
        grads[1] = g.unbroadcast(n.dy * xh, scale, x.shape)
    return grads


_MVN_EPS = 1e-9  # fixed by the ONNX function body, added to the standard deviation


@rule("MeanVarianceNormalization")
def mean_variance_norm(g: GradBuilder, n: NodeContext) -> Grads:
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
def lp_norm(g: GradBuilder, n: NodeContext) -> Grads:
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
def lrn(g: GradBuilder, n: NodeContext) -> Grads:
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


# ---- LayerNormalization and BatchNormalization ---------------------------------------------
@rule("LayerNormalization", since=17)
def layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """y = xh * scale + B with xh = (x - mean) inv, over the axes [axis, rank).

    dx = normalize_backward(dy * scale); dscale = sum(dy xh); dB = sum(dy). The forward's own Mean
    and InvStdDev outputs (in ``stash_type``) are read. Where the model uses those outputs too:
    dx += (dMean - dInv inv^2 xh) / D, D the normalized size (d inv / d x = -inv^3 (x - mean) / D).
    """
    x, scale = n.inputs[0], n.inputs[1]
    assert x is not None and scale is not None
    b = n.inputs[2] if len(n.inputs) > 2 else None
    dy = n.dout_or_zeros(0)
    d_mean = n.dout[1] if len(n.dout) > 1 else None
    d_inv = n.dout[2] if len(n.dout) > 2 else None
    grads: Grads = [None] * len(n.inputs)
    if b is not None and n.needs[2]:
        grads[2] = g.unbroadcast(dy, b, x.shape)
    if not (n.needs[0] or n.needs[1]):
        return grads
    axes = norm_axes(n, x, int(n.attr("axis", -1)))
    stash = int(n.attr("stash_type", TensorProto.FLOAT))
    stat_shape = None
    if x.shape is not None:
        stat_shape = (*x.shape[: axes[0] % len(x.shape)], *(1,) * len(axes))
    mean = cast(g.extra_output(n.node, 1, stash, stat_shape), x)
    inv = cast(g.extra_output(n.node, 2, stash, stat_shape), x)
    xh = (x - mean) * inv
    if n.needs[1]:
        grads[1] = g.unbroadcast(dy * xh, scale, x.shape)
    if n.needs[0]:
        dx = normalize_backward(dy * scale, xh, inv, mean_over(g, axes))
        if d_mean is not None or d_inv is not None:  # dx += (dMean - dInv inv^2 xh) / D
            extra = cast(d_mean, x) if d_mean is not None else None
            if d_inv is not None:
                term = cast(d_inv, x) * inv * inv * xh
                extra = -term if extra is None else extra - term
            stat = d_mean if d_mean is not None else d_inv
            dx = dx + extra / normalized_count(g, x, axes, stat)  # type: ignore[operator,arg-type]
        grads[0] = dx
    return grads


def _batch_norm_training(n: NodeContext) -> bool:
    """Training mode: the ``training_mode`` attribute from opset 14; before, asking for the
    statistics outputs (``is_test=0`` before opset 7), as onnxruntime reads it."""
    if n.opset >= 14:
        return bool(n.attr("training_mode", 0))
    if n.opset < 7 and not n.attr("is_test", 0):
        return True
    return any(o for o in n.node.output[1:])


@rule("BatchNormalization")
def batch_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """y = xh scale + B over the batch and spatial axes (per channel).

    Inference mode, xh = (x - mean) inv with the given statistics, inv = (var + eps)^-1/2:
    dx = dy scale inv; dscale = sum(dy (x - mean)) inv; dB = sum(dy); dmean = -dB scale inv;
    dvar = -1/2 scale inv^3 sum(dy (x - mean)).
    Training mode, xh standardized with the batch's own (biased) statistics, recomputed from x:
    dx = normalize_backward(dy scale) (as torch's batch_norm backward); dscale = sum(dy xh);
    dB = sum(dy).

    The running statistics outputs, where a loss reads them, take the gradient the ONNX definition
    implies: running_mean = input_mean m + mean_b(x) (1 - m) and running_var = input_var m +
    var_b(x) (1 - m), m the momentum and mean_b, var_b the batch's mean and population variance
    per channel (what Y is normalized with). So d input_mean = m d running_mean, d input_var =
    m d running_var, and dx gains (1 - m) (d running_mean + 2 (x - mean_b) d running_var) / M,
    M the elements per channel. This is the same convention as for any other output (torch, whose
    running statistics are buffers updated outside autograd, gives them none). Before opset 14, the
    saved mean and variance outputs (training only) still carry no gradient.
    """
    x, scale, bias, mean, var = n.inputs[:5]
    assert x is not None and scale is not None and mean is not None and var is not None
    dy = n.dout[0]
    training = _batch_norm_training(n)
    d_stats = [n.dout[k] if training and k < len(n.dout) else None for k in (1, 2)]
    if dy is None and not any(d is not None for d in d_stats):
        return [None] * len(n.inputs)
    if x.rank is None:
        raise GradientNotImplementedError(f"{node_label(n)}: the rank of its input must be known")
    # Parameters are (C,) (or (C, D1...) with spatial=0 in old opsets): align them at axis 1.
    p_rank = scale.rank if scale.rank is not None else 1
    trailing = list(range(1 + p_rank, x.rank))
    axes = [0, *trailing]

    def aligned(p: Var) -> Var:  # (C,) -> (C, 1, ...): the new axes counted from axis 1 of x
        return g.Unsqueeze(p, [a - 1 for a in trailing]) if trailing else p

    eps = float(n.attr("epsilon", 1e-5))
    s = cast(scale, x)
    grads: Grads = [None] * len(n.inputs)
    if training:
        if dy is not None:
            if n.needs[2]:
                grads[2] = cast(g.reduce_sum(dy, axes, keepdims=False), bias)  # type: ignore[arg-type]
            if n.needs[0] or n.needs[1]:
                batch_mean = mean_over(g, axes)
                xh, inv = standardize(g, x, batch_mean, eps)
                if n.needs[0]:
                    grads[0] = normalize_backward(dy * aligned(s), xh, inv, batch_mean)
                if n.needs[1]:
                    grads[1] = cast(g.reduce_sum(dy * xh, axes, keepdims=False), scale)
        _running_stats_grads(g, n, x, axes, aligned, d_stats, grads)
        return grads  # y does not depend on the running statistics
    assert dy is not None
    sum_dy = g.reduce_sum(dy, axes, keepdims=False) if n.needs[2] or n.needs[3] else None
    if n.needs[2]:
        grads[2] = cast(sum_dy, bias)  # type: ignore[arg-type]
    m = cast(mean, x)
    inv = g.Reciprocal(g.Sqrt(cast(var, x) + eps))
    if n.needs[0]:
        grads[0] = dy * aligned(s * inv)
    if n.needs[1] or n.needs[4]:
        sum_dy_xc = g.reduce_sum(dy * (x - aligned(m)), axes, keepdims=False)
        if n.needs[1]:
            grads[1] = cast(sum_dy_xc * inv, scale)
        if n.needs[4]:
            grads[4] = cast(sum_dy_xc * s * inv * inv * inv * -0.5, var)
    if n.needs[3]:
        grads[3] = cast(-(sum_dy * s * inv), mean)  # type: ignore[operator]
    return grads


def _running_stats_grads(
    g: GradBuilder,
    n: NodeContext,
    x: Var,
    axes: list[int],
    aligned: Any,
    d_stats: Grads,
    grads: Grads,
) -> None:
    """Add the gradients of the running mean and variance outputs (see :func:`batch_norm`)."""
    d_rm, d_rv = d_stats
    if d_rm is None and d_rv is None:
        return
    momentum = float(n.attr("momentum", 0.9))
    for slot, d in ((3, d_rm), (4, d_rv)):
        if d is not None and n.needs[slot]:
            grads[slot] = cast(d * momentum, n.inputs[slot])  # type: ignore[arg-type]
    if not n.needs[0]:
        return
    stat = n.inputs[3]
    assert stat is not None
    count = normalized_count(g, x, axes, stat)
    dx = None
    if d_rm is not None:
        dx = g.Expand(aligned(cast(d_rm, x)), g.shape_of(x)) if d_rv is None else aligned(cast(d_rm, x))
    if d_rv is not None:
        centered = x - mean_over(g, axes)(x)
        term = centered * aligned(cast(d_rv, x)) * 2.0
        dx = term if dx is None else dx + term
    assert dx is not None
    dx = dx * ((1.0 - momentum) / count)
    grads[0] = dx if grads[0] is None else grads[0] + dx


# ---- onnxruntime's fused normalizations ----------------------------------------------------------
_SKIP_LN_EPS = 1e-12  # onnxruntime's default epsilon of SkipLayerNormalization and EmbedLayerNormalization


def _skip_norm(g: GradBuilder, n: NodeContext, centered: bool) -> Grads:
    """SkipLayerNormalization (centered) and SkipSimplifiedLayerNormalization: y = norm(s) gamma (+
    beta) with s = input + skip (+ bias) over the last axis; outputs 1 and 2 are the mean (centered
    only) and inverse standard deviation of s, output 3 s itself.

    ds = normalize_backward(dy gamma) + (dmean - dinv inv^2 xh) / D (as the LayerNormalization rule)
    + the gradient of output 3; dinput = ds, dskip and dbias = ds summed to their shapes;
    dgamma = sum(dy xh), dbeta = sum(dy). s is the forward's output 3 (added when the model leaves
    it unused); the statistics are recomputed from it.
    """
    if not centered:
        refuse_output_grads(n, (1,), "mean")
    x = n.inputs[0]
    assert x is not None
    gamma = n.inputs[2]
    beta = optional_input(n, 3) if centered else None
    bias = optional_input(n, 4) if centered else optional_input(n, 3)
    bias_slot = 4 if centered else 3
    grads: Grads = [None] * len(n.inputs)
    dy = n.dout[0]
    d_mean, d_inv, d_sum = (n.dout[k] if len(n.dout) > k else None for k in (1, 2, 3))
    if dy is not None and beta is not None and n.needs[3]:
        grads[3] = g.unbroadcast(dy, beta, x.shape)
    s = g.extra_output(n.node, 3, x.dtype, x.shape)
    mean = mean_over(g, [-1])
    ds = d_sum
    if dy is not None or d_mean is not None or d_inv is not None:
        xh, inv = standardize(g, s, mean, float(n.attr("epsilon", _SKIP_LN_EPS)), centered=centered)
        if dy is not None:
            if n.needs[2]:
                grads[2] = g.unbroadcast(dy * xh, gamma, x.shape)  # type: ignore[arg-type]
            dn = normalize_backward(dy * gamma, xh, inv, mean, centered=centered)
            ds = dn if ds is None else ds + dn
        if d_mean is not None or d_inv is not None:  # d inv / ds = -inv^3 (s - mean) / D
            extra = cast(d_mean, x) if d_mean is not None else None
            if d_inv is not None:
                term = cast(d_inv, x) * inv * inv * xh
                extra = -term if extra is None else extra - term
            stat = d_mean if d_mean is not None else d_inv
            extra = extra / normalized_count(g, x, [-1], stat)  # type: ignore[operator,arg-type]
            ds = extra if ds is None else ds + extra
    if ds is None:
        return grads
    if n.needs[0]:
        grads[0] = ds
    skip = n.inputs[1]
    if skip is not None and n.needs[1]:
        grads[1] = g.unbroadcast(ds, skip, x.shape)
    if bias is not None and n.needs[bias_slot]:
        grads[bias_slot] = g.unbroadcast(ds, bias, x.shape)
    return grads


@rule("SkipLayerNormalization", domain=MS_DOMAIN)
def skip_layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """LayerNormalization(input + skip + bias) gamma + beta over the last axis (see :func:`_skip_norm`)."""
    return _skip_norm(g, n, centered=True)


@rule("SkipSimplifiedLayerNormalization", domain=MS_DOMAIN)
def skip_simplified_layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """RMSNormalization(input + skip + bias) gamma over the last axis (see :func:`_skip_norm`)."""
    return _skip_norm(g, n, centered=False)


@rule("SimplifiedLayerNormalization")
def simplified_layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """onnxruntime's RMS normalization of the default domain (``axis``, ``epsilon``; no ONNX opset
    has it): the RMSNormalization rule; its
    inv_std_var output carries no gradient here (refused where the model differentiates it)."""
    refuse_output_grads(n, (1,), "the inverse standard deviation")
    if n.dy is None:
        return [None] * len(n.inputs)
    return rms_norm(g, n)


# onnxruntime runs LayerNormalization at any opset (its own kernel before ONNX's opset 17): the
# same op, the same rule
rule("LayerNormalization", since=1)(layer_norm)


@rule("EmbedLayerNormalization", domain=MS_DOMAIN)
def embed_layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """y = LayerNormalization(word[ids] + position[pos] + segment[segment_ids]) gamma + beta, pos
    the position_ids input or 0..S-1; output 2 is the sum, mask_index (output 1) is integer.

    dsum = normalize_backward(dy gamma) (+ the gradient of output 2); each table's gradient is dsum
    scatter-added at the rows it gathered (positions 0..S-1: dsum summed over the batch, padded with
    zero rows); dgamma = sum(dy xh), dbeta = sum(dy).
    """
    ids, seg_ids, words, positions, segments = (optional_input(n, k) for k in range(5))
    gamma, beta, pos_ids = optional_input(n, 5), optional_input(n, 6), optional_input(n, 8)
    assert ids is not None and words is not None and gamma is not None
    grads: Grads = [None] * len(n.inputs)
    dy = n.dout[0]
    d_sum = n.dout[2] if len(n.dout) > 2 else None
    out_shape = n.y.shape
    s = g.extra_output(n.node, 2, words.dtype, out_shape)
    mean = mean_over(g, [-1])
    ds = d_sum
    if dy is not None:
        if beta is not None and n.needs[6]:
            grads[6] = g.unbroadcast(dy, beta, out_shape)
        xh, inv = standardize(g, s, mean, float(n.attr("epsilon", _SKIP_LN_EPS)))
        if n.needs[5]:
            grads[5] = g.unbroadcast(dy * xh, gamma, out_shape)
        dn = normalize_backward(dy * gamma, xh, inv, mean)
        ds = dn if ds is None else ds + dn
    if ds is None:
        return grads
    if n.needs[2]:
        grads[2] = _scatter_rows(g, words, ids, ds)
    if segments is not None and seg_ids is not None and n.needs[4]:
        grads[4] = _scatter_rows(g, segments, seg_ids, ds)
    if positions is not None and n.needs[3]:
        if pos_ids is not None:  # (B, S), or (1, S) shared by the batch
            shared = pos_ids.shape is not None and pos_ids.shape[0] == 1
            grads[3] = _scatter_rows(
                g, positions, pos_ids, g.ReduceSum(ds, [0], keepdims=1) if shared else ds
            )
        else:  # rows 0..S-1, the same for every sequence of the batch
            per_pos = g.ReduceSum(ds, [0], keepdims=0)  # (S, hidden)
            length = g.Gather(g.shape_of(per_pos), g.const(np.int64(0)))
            rows = g.Range(g.const(np.int64(0)), length, g.const(np.int64(1)))
            grads[3] = _scatter_rows(g, positions, rows, per_pos)
    return grads


def _scatter_rows(g: GradBuilder, table: Var, ids: Var, d: Var) -> Var:
    """The gradient of ``table[ids]`` (rows gathered): ``d`` scatter-added into zero rows."""
    rows = g.Unsqueeze(as_int64(g, ids), [-1])
    dx = g.ScatterND(zeros(g, g.shape_of(table), d.dtype), rows, d, reduction="add")
    return g.reshape(dx, table)
