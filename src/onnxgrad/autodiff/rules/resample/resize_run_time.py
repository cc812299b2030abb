"""Resize's adjoint where sizes or scales are known only at run time: the backward computes the
same coordinates as onnxruntime with ONNX ops and applies one interpolation matrix per axis (a
MatMul)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ....errors import GradientNotImplementedError
from ...builder import INT64, GradBuilder, Var, where
from ...registry import NodeContext
from ..common import node_label
from .resize_mode import F32, ResizeMode, aspect_policy


# ---- Resize: taps computed at run time ----------------------------------------------------------
def _scalar_dim(g: GradBuilder, x: Var, axis: int) -> Var:
    """Size of ``x`` along ``axis`` as a scalar int64 (a constant when static)."""
    d = g.dim(x, axis)
    return g.const(np.int64(d)) if isinstance(d, int) else g.Squeeze(d, [0])


def _entry(g: GradBuilder, v: Var | np.ndarray, j: int, to: int) -> Var:
    """Element ``j`` of a 1-D constant or run-time tensor, as a scalar of type ``to``."""
    if isinstance(v, np.ndarray):
        return g.const(np.asarray(v[j], dtype=np.float64 if to != INT64 else np.int64), to)
    return g.Cast(g.Gather(v, g.const(np.int64(j)), axis=0), to=to)


def _run_time_input(n: NodeContext, i: int) -> Var | np.ndarray | None:
    """Input ``i``: its value when constant (None when absent or empty), else the forward value."""
    if i >= len(n.inputs) or n.inputs[i] is None:
        return None
    value = n.const_input(i)
    if value is None:
        return n.inputs[i]
    return value if value.size else None


def _run_time_coords(
    g: GradBuilder,
    mode: ResizeMode,
    pos: Var,
    n_out: Var,
    n_in: Var,
    scale: Var,
    roi: tuple[Var, Var] | None,
) -> Var:
    """:func:`_source_coords` as ONNX ops, in float32 with onnxruntime's order of operations."""
    f = TensorProto.FLOAT
    d = TensorProto.DOUBLE
    t = mode.transform
    half = g.const(0.5, f)
    zero = g.const(0.0, f)
    out_f, in_f = g.Cast(n_out, to=f), g.Cast(n_in, to=f)
    if t == "asymmetric":
        return pos / scale
    if t == "pytorch_half_pixel":
        return where(g.Greater(n_out, g.const(np.int64(1))), (pos + half) / scale - half, zero)
    if t == "tf_half_pixel_for_nn":
        return (pos + half) / scale
    if t == "align_corners":
        c = pos * (in_f - 1.0) / (out_f - 1.0)  # type: ignore[operator]
        return where(g.Equal(n_out, g.const(np.int64(1))), zero, c)
    if t == "tf_crop_and_resize":
        assert roi is not None
        start, end = roi
        last = in_f - 1.0  # type: ignore[operator]
        c = start * last + (pos * (end - start) * last) / (out_f - 1.0)  # type: ignore[operator]
        mid = g.Cast((g.Cast(start, to=d) + g.Cast(end, to=d)) * 0.5 * g.Cast(last, to=d), to=f)
        return where(g.Greater(n_out, g.const(np.int64(1))), c, mid)
    if t == "half_pixel_symmetric":
        adjustment = out_f / (scale * in_f)
        offset = in_f / 2.0 * (1.0 - adjustment)  # type: ignore[operator]
        c = g.Cast(offset, to=d) + (g.Cast(pos, to=d) + 0.5) / g.Cast(scale, to=d) - 0.5
        return g.Cast(c, to=f)
    return (pos + half) / scale - half  # half_pixel


def _run_time_nearest(g: GradBuilder, c: Var, how: str, scale: Var) -> Var:
    """:func:`_nearest_index` as ONNX ops (float32 in, float32 integral values out)."""

    def trunc(v: Var) -> Var:
        return g.Cast(g.Cast(v, to=INT64), to=TensorProto.FLOAT)

    def half_away(v: Var) -> Var:
        return g.Sign(v) * g.Floor(g.Abs(v) + 0.5)

    if how == "simple":
        return where(g.Less(scale, g.const(1.0, TensorProto.FLOAT)), g.Ceil(c), trunc(c))
    if how == "round_prefer_floor":
        return where(g.Equal(c, trunc(c) + 0.5), g.Floor(c), half_away(c))
    if how == "round_prefer_ceil":
        return half_away(c)
    return g.Floor(c) if how == "floor" else g.Ceil(c)


def _run_time_matrix(g: GradBuilder, mode: ResizeMode, c: Var, n_in: Var, scale: Var, dtype: int) -> Var:
    """The (n_out, n_in) interpolation matrix of one axis from the float32 source coordinates."""
    f = TensorProto.FLOAT
    last = g.Cast(n_in - 1, to=f)  # type: ignore[operator]
    zero = g.const(0.0, f)
    if mode.mode == "nearest":
        lo = _run_time_nearest(g, c, mode.nearest, scale)
        idx = g.Unsqueeze(lo, [1])
        w = g.Expand(g.const(np.ones((1, 1)), dtype), g.Shape(idx))
    elif mode.mode == "linear":
        cc = g.Min(g.Max(c, zero), last)
        lo = g.Floor(cc)
        frac = g.Unsqueeze(g.Cast(cc, to=dtype) - g.Cast(lo, to=dtype), [1])
        idx = g.Unsqueeze(lo, [1]) + g.const(np.array([[0.0, 1.0]]), f)
        w = g.Concat(1.0 - frac, frac, axis=1)
    else:
        lo = g.Floor(c)
        idx = g.Unsqueeze(lo, [1]) + g.const(np.array([[-1.0, 0.0, 1.0, 2.0]]), f)
        s = g.Unsqueeze(g.Cast(c, to=dtype) - g.Cast(lo, to=dtype), [1])
        dist = g.Concat(s + 1.0, s, 1.0 - s, 2.0 - s, axis=1)
        a = mode.cubic_a
        near = ((dist * (a + 2) - (a + 3)) * dist) * dist + 1.0
        far = ((dist * a - 5 * a) * dist + 8 * a) * dist - 4 * a
        w = where(g.LessOrEqual(dist, g.const(1.0, dtype)), near, far)
        if mode.exclude_outside:
            outside = g.Or(g.Less(idx, zero), g.Greater(idx, last))
            w = where(outside, g.const(0.0, dtype), w)
            total = g.ReduceSum(w, g.const(np.array([1])), keepdims=1)
            w = w / where(g.Equal(total, g.const(0.0, dtype)), g.const(1.0, dtype), total)
    idx = g.Min(g.Max(idx, zero), last)
    if mode.transform == "tf_crop_and_resize":  # outside the input: the extrapolation value
        out = g.Unsqueeze(g.Or(g.Less(c, zero), g.Greater(c, last)), [1])
        w = where(out, g.const(0.0, dtype), w)
    columns = g.Cast(g.Range(g.const(np.int64(0)), n_in, g.const(np.int64(1))), to=f)
    onehot = g.Cast(g.Equal(g.Unsqueeze(idx, [2]), columns), to=dtype)  # (n_out, K, n_in)
    return g.ReduceSum(onehot * g.Unsqueeze(w, [2]), g.const(np.array([1])), keepdims=0)


def _run_time_antialias_matrix(
    g: GradBuilder, mode: ResizeMode, c: Var, pos: Var, n_in: Var, scale: Var, dtype: int
) -> Var:
    """:func:`_antialias_taps` as ONNX ops (in float64), as an (n_out, n_in) matrix.

    The windows differ per output position, so the taps run over every input position any window
    reaches (a Range from the lowest window start to the highest end), weighted where inside each
    window and folded onto the edges by clipping (or dropped with exclude_outside).
    """
    d64, f = TensorProto.DOUBLE, TensorProto.FLOAT

    def lit(v: float) -> Var:
        return g.const(v, d64)

    half = 1.0 if mode.mode == "linear" else 2.0  # support_size / 2
    inv32 = g.const(1.0, f) / scale
    inv = g.Cast(inv32, to=d64)
    wide = g.GreaterOrEqual(inv, lit(1.0))
    support = where(wide, inv * half, lit(half))
    window = g.Ceil(support) * 2.0 + 1.0
    stretch = where(wide, lit(1.0) / inv, lit(1.0))
    exact = g.Equal(inv32, g.const(1.0, f))
    center = where(exact, g.Cast(pos, to=d64), g.Cast(c, to=d64)) + 0.5  # (n_out,)
    lo = g.Floor(center - support + 0.5)
    hi = lo + g.Min(g.Max(g.Floor(center + support + 0.5) - lo, lit(0.0)), window)
    size = g.Cast(n_in, to=d64)
    if mode.exclude_outside:
        lo = g.Min(g.Max(lo, lit(0.0)), size)
        hi = g.Min(g.Max(hi, lit(0.0)), size)
    start = g.ReduceMin(lo, keepdims=0)
    stop = g.Max(g.ReduceMax(hi, keepdims=0), start)
    taps = g.Unsqueeze(g.Range(start, stop, lit(1.0), dtype=d64), [0])  # (1, K)
    lo2, hi2, center2 = (g.Unsqueeze(v, [1]) for v in (lo, hi, center))
    inside = g.And(g.GreaterOrEqual(taps, lo2), g.Less(taps, hi2))
    dist = g.Abs((taps - center2 + 0.5) * stretch)
    one = lit(1.0)
    if mode.mode == "linear":
        fw = where(g.Less(dist, one), one - dist, lit(0.0))
    else:
        a = mode.cubic_a
        near = ((dist * (a + 2) - (a + 3)) * dist) * dist + 1.0
        far = (((dist - 5.0) * dist + 8.0) * dist - 4.0) * a
        fw = where(g.Less(dist, one), near, where(g.Less(dist, lit(2.0)), far, lit(0.0)))
    fw = where(inside, fw, lit(0.0))
    total = g.ReduceSum(fw, g.const(np.array([1])), keepdims=1)
    w = fw / where(g.Equal(total, lit(0.0)), one, total)  # (n_out, K)
    idx = g.Min(g.Max(taps, lit(0.0)), size - 1.0)  # (1, K)
    if mode.transform == "tf_crop_and_resize":  # outside the input: the extrapolation value
        c64 = g.Unsqueeze(g.Cast(c, to=d64), [1])
        w = where(g.Or(g.Less(c64, lit(0.0)), g.Greater(c64, size - 1.0)), lit(0.0), w)
    columns = g.Cast(g.Range(g.const(np.int64(0)), n_in, g.const(np.int64(1))), to=d64)
    onehot = g.Cast(g.Equal(g.Unsqueeze(idx, [2]), columns), to=d64)  # (1, K, n_in)
    matrix = g.ReduceSum(onehot * g.Unsqueeze(w, [2]), g.const(np.array([1])), keepdims=0)
    return g.Cast(matrix, to=dtype)


def resize_run_time(g: GradBuilder, n: NodeContext, mode: ResizeMode, rank: int) -> Var:
    """dX = W_a^T dy along each axis that may change, each W_a built at run time.

    Per axis, the source coordinate of each output position is computed in float32 as onnxruntime
    does (from the scale given, or from output size / input size when sizes are given, the aspect
    policy's min or max included), its taps are one-hot rows weighted by the interpolation weights,
    and dX is one MatMul with W_a. Where no dim changes size onnxruntime copies X: the coordinates
    are then the output positions themselves, which makes every W_a the identity. Antialiased
    axes build their filter matrix by :func:`_run_time_antialias_matrix` (an axis keeping its
    size is copied, as with scale 1).
    """
    x, dy = n.x, n.dy
    f = TensorProto.FLOAT
    if n.node.op_type == "Upsample" and n.opset < 9:
        scales, sizes, roi = np.asarray(n.attr("scales"), dtype=F32), None, None
    elif n.node.op_type == "Upsample" or n.opset < 11:
        scales, sizes, roi = _run_time_input(n, 1), None, None
    else:
        scales, sizes = _run_time_input(n, 2), _run_time_input(n, 3)
        if sizes is not None and not isinstance(scales, np.ndarray):
            scales = None  # only one of them is given: a run-time scales input is then empty
        roi = _run_time_input(n, 1) if mode.transform == "tf_crop_and_resize" else None
    if scales is None and sizes is None:
        raise GradientNotImplementedError(f"{node_label(n)}: neither scales nor sizes is given")
    axes = [a + rank if a < 0 else a for a in (n.attr("axes") or range(rank))]
    n_ins = [_scalar_dim(g, x, a) for a in axes]
    n_outs = [_scalar_dim(g, dy, a) for a in axes]
    if scales is not None:
        scale_of = [_entry(g, scales, j, f) for j in range(len(axes))]
    else:
        assert sizes is not None
        scale_of = [_entry(g, sizes, j, f) / g.Cast(d, to=f) for j, d in enumerate(n_ins)]
        policy = aspect_policy(n)
        if policy != "stretch":
            chosen = g.op("Min" if policy == "not_larger" else "Max", *scale_of)
            scale_of = [chosen] * len(axes)
    # onnxruntime copies X when no dim changes size, whatever the scales
    same_dims = g.Equal(g.shape_of(x), g.Shape(dy))
    copy = g.Cast(g.ReduceMin(g.Cast(same_dims, to=INT64), keepdims=0), to=TensorProto.BOOL)
    dx = dy
    plain = mode.mode == "nearest" or mode.transform != "tf_crop_and_resize"
    for j, a in enumerate(axes):
        scale = scales[j] if isinstance(scales, np.ndarray) else None
        if scale is not None and F32(scale) == 1 and plain:
            continue  # an axis of scale 1 maps to itself (the copy case included)
        roi_a = None
        if roi is not None:
            roi_a = (_entry(g, roi, j, f), _entry(g, roi, len(axes) + j, f))
        elif mode.transform == "tf_crop_and_resize":
            roi_a = (g.const(0.0, f), g.const(1.0, f))
        pos = g.Cast(g.Range(g.const(np.int64(0)), n_outs[j], g.const(np.int64(1))), to=f)
        if mode.antialias:  # an axis keeping its size is copied: as with scale 1
            scale_a = where(g.Equal(n_outs[j], n_ins[j]), g.const(1.0, f), scale_of[j])
            c = _run_time_coords(g, mode, pos, n_outs[j], n_ins[j], scale_a, roi_a)
            w = _run_time_antialias_matrix(g, mode, c, pos, n_ins[j], scale_a, dy.dtype)
        else:
            c = _run_time_coords(g, mode, pos, n_outs[j], n_ins[j], scale_of[j], roi_a)
            keep = copy
            if plain:  # onnxruntime maps an axis of scale 1 to itself (tf_half_pixel_for_nn included)
                keep = g.Or(copy, g.Equal(scale_of[j], g.const(1.0, f)))
            c = where(keep, pos, c)
            w = _run_time_matrix(g, mode, c, n_ins[j], scale_of[j], dy.dtype)  # (n_out, n_in)
        if a == rank - 1:
            dx = g.MatMul(dx, w)
        else:
            perm = [*range(a), *range(a + 1, rank), a]
            moved = g.MatMul(g.Transpose(dx, perm=perm), w)
            dx = g.Transpose(moved, perm=[int(i) for i in np.argsort(perm)])
    if dx is dy:
        return dy
    return g.Identity(dx, shape=n.x.shape)
