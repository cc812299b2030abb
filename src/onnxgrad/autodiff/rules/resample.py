"""Resampling ops: Resize (and the older Upsample), GridSample and AffineGrid, Col2Im.

Resize is linear in X and separable: along each resized axis, output position o reads a few input
positions i with weights w(o, i) that depend only on sizes, scales and attributes. Those taps are
computed here at build time (mirroring onnxruntime's arithmetic: float32 coordinates, its rounding
of nearest indices, its antialias filter), transposed, and applied to dy as one Gather plus a
weighted sum per axis: dX[.., i, ..] = sum_k dy[.., J[i, k], ..] * V[i, k]. Where sizes or scales
are known only at run time, the backward computes the same coordinates with ONNX ops and applies
one interpolation matrix per axis (a MatMul).

GridSample reads X at run-time positions: dX scatter-adds dy times the interpolation weights at the
corners each output read (2 per dim for linear, 4 for cubic; one ScatterElements), d grid is dy
times the slope of the interpolation along each coordinate, times the slopes of the padding (border
clipping, reflections) and of the unnormalization, as torch.nn.functional.grid_sample.

AffineGrid is ``grid[n, p] = theta[n] @ [base(p), 1]`` over the output positions ``p``, so
``dtheta[n] = dgrid[n]^T @ [base, 1]``; the base coordinates are AffineGrid of the identity.

Col2Im sums patches into an image; its adjoint cuts the patches back out (Im2Col): one Gather from
the padded dy with a patch-position table computed at build time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from ...errors import GradientNotImplementedError
from ..builder import INT64, GradBuilder, Var, cast, where
from ..registry import NodeContext, rule
from .common import Grads, first_only, need_rank, node_label, refuse, zeros

F32 = np.float32


# ---- Resize: per-axis taps ----------------------------------------------------------------------
@dataclass(frozen=True)
class _ResizeMode:
    """The attributes of a Resize (or Upsample) that shape its taps."""

    mode: str  # nearest, linear, cubic
    transform: str  # coordinate_transformation_mode
    nearest: str  # nearest_mode; "simple" before opset 11 (ceil when downsampling, else truncate)
    cubic_a: float
    exclude_outside: bool
    antialias: bool


def _source_coords(
    mode: _ResizeMode, n_out: int, n_in: int, scale: F32, roi: tuple[float, float]
) -> np.ndarray:
    """Input coordinate of each output position, in float32 as onnxruntime computes it."""
    x = np.arange(n_out, dtype=F32)
    half, t = F32(0.5), mode.transform
    if t == "asymmetric":
        c = x / scale
    elif t == "pytorch_half_pixel":
        c = (x + half) / scale - half if n_out > 1 else np.zeros(n_out, F32)
    elif t == "tf_half_pixel_for_nn":
        c = (x + half) / scale
    elif t == "align_corners":
        c = x * F32(n_in - 1) / F32(n_out - 1) if n_out != 1 else np.zeros(n_out, F32)
    elif t == "tf_crop_and_resize":
        start, end = F32(roi[0]), F32(roi[1])
        if n_out > 1:
            c = start * F32(n_in - 1) + (x * (end - start) * F32(n_in - 1)) / F32(n_out - 1)
        else:
            c = np.full(n_out, 0.5 * (float(start) + float(end)) * (n_in - 1), F32)
    elif t == "half_pixel_symmetric":
        adjustment = F32(n_out) / (scale * F32(n_in))
        offset = F32(n_in) / F32(2) * (F32(1) - adjustment)
        c = (offset + (x.astype(np.float64) + 0.5) / scale - 0.5).astype(F32)
    else:  # half_pixel (the names were checked by _resize_mode)
        c = (x + half) / scale - half
    return c.astype(F32)


def _round_half_away(c: np.ndarray) -> np.ndarray:
    c = c.astype(np.float64)
    return np.sign(c) * np.floor(np.abs(c) + 0.5)


def _nearest_index(c: np.ndarray, how: str, downsampling: bool) -> np.ndarray:
    """onnxruntime's rounding of a float32 coordinate to an input index (before clamping)."""
    if how == "simple":
        r = np.ceil(c) if downsampling else np.trunc(c)
    elif how == "round_prefer_floor":
        tie = c == (np.trunc(c) + F32(0.5)).astype(F32)
        r = np.where(tie, np.floor(c), _round_half_away(c))
    elif how == "round_prefer_ceil":
        r = _round_half_away(c)
    elif how == "floor":
        r = np.floor(c)
    else:  # ceil
        r = np.ceil(c)
    return r.astype(np.int64)


def _cubic_weights(s: np.ndarray, a: float) -> np.ndarray:
    """Keys cubic convolution weights of the 4 neighbours floor(c) - 1 .. floor(c) + 2, s = c - floor(c)."""
    d = np.stack([1 + s, s, 1 - s, 2 - s], axis=-1)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, far)


def _antialias_taps(
    mode: _ResizeMode, n_out: int, n_in: int, scale: F32, roi: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's antialiased filter (Pillow's): a triangle or cubic kernel stretched by 1 / scale
    when downsampling, taps outside the input folded onto the edge (or dropped with exclude_outside)."""
    support_size = 2.0 if mode.mode == "linear" else 4.0
    inv = F32(1) / scale
    support = support_size * 0.5 * float(inv) if inv >= 1 else support_size * 0.5
    window = math.ceil(support) * 2 + 1
    stretch = 1.0 / float(inv) if inv >= 1 else 1.0
    if inv == 1:
        centers = np.arange(n_out, dtype=np.float64) + 0.5
    else:
        centers = _source_coords(mode, n_out, n_in, scale, roi).astype(np.float64) + 0.5
    idx = np.zeros((n_out, window), dtype=np.int64)
    w = np.zeros((n_out, window))
    a = mode.cubic_a
    for o, center in enumerate(centers):
        lo = math.floor(center - support + 0.5)
        hi = lo + min(max(math.floor(center + support + 0.5) - lo, 0), window)
        if mode.exclude_outside:
            lo, hi = min(max(lo, 0), n_in), min(max(hi, 0), n_in)
        taps = np.arange(lo, hi)
        d = np.abs((taps - center + 0.5) * stretch)
        if mode.mode == "linear":
            f = np.where(d < 1, 1 - d, 0.0)
        else:
            f = np.where(
                d < 1,
                ((a + 2) * d - (a + 3)) * d * d + 1,
                np.where(d < 2, (((d - 5) * d + 8) * d - 4) * a, 0.0),
            )
        total = f.sum()
        idx[o, : len(taps)] = np.clip(taps, 0, n_in - 1)
        w[o, : len(taps)] = f / total if total != 0 else f
    return idx, w


def _resize_taps(
    mode: _ResizeMode, n_out: int, n_in: int, scale: F32, roi: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray]:
    """Input indices and weights, (n_out, K) each, of a 1-D resize from n_in to n_out positions."""
    if mode.antialias:
        idx, w = _antialias_taps(mode, n_out, n_in, scale, roi)
    else:
        c = _source_coords(mode, n_out, n_in, scale, roi)
        if mode.mode == "nearest":
            idx = _nearest_index(c, mode.nearest, scale < 1)[:, None]
            w = np.ones_like(idx, dtype=np.float64)
        elif mode.mode == "linear":
            cc = np.clip(c, F32(0), F32(n_in - 1)).astype(np.float64)
            lo = np.floor(cc).astype(np.int64)
            frac = cc - lo
            idx = np.stack([lo, lo + 1], axis=1)
            w = np.stack([1 - frac, frac], axis=1)
        else:
            lo = np.floor(c).astype(np.int64)
            idx = lo[:, None] + np.arange(-1, 3)[None, :]
            w = _cubic_weights(c.astype(np.float64) - lo, mode.cubic_a)
            if mode.exclude_outside:
                w = np.where((idx < 0) | (idx >= n_in), 0.0, w)
                total = w.sum(axis=1, keepdims=True)
                w = w / np.where(total == 0, 1.0, total)
        idx = np.clip(idx, 0, n_in - 1)
    if mode.transform == "tf_crop_and_resize":  # outside the input: the extrapolation value
        c = _source_coords(mode, n_out, n_in, scale, roi)
        w = np.where(((c < 0) | (c > n_in - 1))[:, None], 0.0, w)
    return idx, w


def _transpose_taps(idx: np.ndarray, w: np.ndarray, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """The taps of the adjoint: for each input position, the outputs that read it and their weights,
    (n_in, K') each, padded with weight 0."""
    n_out = idx.shape[0]
    keys = idx.reshape(-1) * n_out + np.repeat(np.arange(n_out), idx.shape[1])
    uniq, inverse = np.unique(keys, return_inverse=True)
    weights = np.bincount(inverse.reshape(-1), weights=w.reshape(-1))  # repeated taps add up
    keep = weights != 0
    uniq, weights = uniq[keep], weights[keep]
    rows, cols = uniq // n_out, uniq % n_out
    counts = np.bincount(rows, minlength=n_in)
    width = max(int(counts.max(initial=0)), 1)
    slot = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.zeros((n_in, width), dtype=np.int64)
    values = np.zeros((n_in, width))
    table[rows, slot] = cols
    values[rows, slot] = weights
    return table, values


def _apply_adjoint(
    g: GradBuilder, dy: Var, axis: int, rank: int, table: np.ndarray, values: np.ndarray
) -> Var:
    """dX along ``axis``: sum_k dy[.., table[i, k], ..] * values[i, k] (a Gather, a Mul, a ReduceSum)."""
    trailing = (1,) * (rank - 1 - axis)
    if table.shape[1] == 1:
        picked = g.Gather(dy, table[:, 0], axis=axis)
        if np.all(values == 1):
            return picked
        return picked * g.const(values.reshape(-1, *trailing), dy.dtype)
    picked = g.Gather(dy, table, axis=axis)
    weighted = picked * g.const(values.reshape(*values.shape, *trailing), dy.dtype)
    return g.reduce_sum(weighted, [axis + 1], keepdims=False)


# ---- Resize: reading the node -------------------------------------------------------------------
_TRANSFORMS = {
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "tf_half_pixel_for_nn",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
}
_NEAREST = {"round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "simple"}


def _resize_mode(n: NodeContext) -> _ResizeMode:
    """The attributes of a Resize or Upsample node, with the defaults of its opset."""
    resize = n.node.op_type == "Resize" and n.opset >= 11
    mode = n.attr("mode", "nearest")
    mode = {"bilinear": "linear", "trilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    found = _ResizeMode(
        mode=mode,
        transform=n.attr("coordinate_transformation_mode", "half_pixel") if resize else "asymmetric",
        nearest=n.attr("nearest_mode", "round_prefer_floor") if resize else "simple",
        cubic_a=float(n.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(n.attr("exclude_outside", 0)),
        antialias=bool(n.attr("antialias", 0)),
    )
    if (
        mode not in ("nearest", "linear", "cubic")
        or found.transform not in _TRANSFORMS
        or found.nearest not in _NEAREST
    ):
        raise GradientNotImplementedError(
            f"{node_label(n)}: unknown mode {mode!r}, coordinate_transformation_mode "
            f"{found.transform!r} or nearest_mode {found.nearest!r}"
        )
    return found


class _RunTime(Exception):
    """The taps cannot be computed when building: the backward computes them at run time."""


def _const_or_fail(n: NodeContext, i: int, what: str) -> np.ndarray | None:
    """Input ``i`` when present: it must be known when building (None when absent or empty)."""
    if i >= len(n.inputs) or n.inputs[i] is None:
        return None
    value = n.const_input(i)
    if value is None:
        raise _RunTime(f"{what} computed at run time")
    return value if value.size else None


@dataclass(frozen=True)
class _AxisResize:
    axis: int
    n_in: int
    n_out: int
    scale: F32
    roi: tuple[float, float]


def _aspect_policy(n: NodeContext) -> str:
    """The node's ``keep_aspect_ratio_policy``; refused with negative axes, which onnxruntime then
    ignores (the sizes would not be what the rule computes)."""
    policy = str(n.attr("keep_aspect_ratio_policy", "stretch"))
    if policy != "stretch" and any(a < 0 for a in n.attr("axes") or ()):
        raise GradientNotImplementedError(
            f"{node_label(n)}: onnxruntime ignores negative axes under keep_aspect_ratio_policy "
            f"{policy!r}; give them as non-negative axes"
        )
    return policy


def _resize_axes(n: NodeContext, mode: _ResizeMode) -> list[_AxisResize]:
    """The axes a Resize changes, with sizes, float32 scales and roi, as onnxruntime computes them."""
    x = n.x
    rank = need_rank(n, x)
    if n.node.op_type == "Upsample" and n.opset < 9:
        scales, sizes, roi = np.asarray(n.attr("scales"), dtype=F32), None, None
    elif n.node.op_type == "Upsample" or n.opset < 11:
        scales, sizes, roi = _const_or_fail(n, 1, "scales"), None, None
    else:
        scales = _const_or_fail(n, 2, "scales")
        sizes = _const_or_fail(n, 3, "sizes") if scales is None else None
        roi = _const_or_fail(n, 1, "roi") if mode.transform == "tf_crop_and_resize" else None
    axes = [a + rank if a < 0 else a for a in (n.attr("axes") or range(rank))]
    full_roi = [(0.0, 1.0)] * rank
    if roi is not None:
        for j, a in enumerate(axes):
            full_roi[a] = (float(roi[j]), float(roi[len(axes) + j]))
    dims = []
    for a in axes:
        d = x.shape[a]  # type: ignore[index]
        dims.append(d if isinstance(d, int) else None)
    if scales is not None:
        scale_of = [F32(s) for s in scales.astype(F32)]
        outs = [None if d is None else int(F32(s) * F32(d)) for s, d in zip(scale_of, dims)]
    elif sizes is not None:
        if any(d is None for d in dims):
            raise _RunTime("sizes given and resized dims of X not static")
        outs = [int(s) for s in sizes]
        scale_of = [F32(o) / F32(d) if d else F32(1) for o, d in zip(outs, dims)]
        policy = _aspect_policy(n)
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            chosen = pick(scale_of)
            scale_of = [chosen] * len(axes)
            outs = [int(_round_half_away(np.array([chosen * F32(d)], F32))[0]) for d in dims]  # type: ignore[operator]
    else:
        raise GradientNotImplementedError(f"{node_label(n)}: neither scales nor sizes is given")
    # onnxruntime copies X when no dim changes size, whatever the scales; an antialiased axis that
    # keeps its size is copied too, and so is a nearest or unscaled axis with scale 1.
    same = [o == d if d is not None else s == 1 for d, o, s in zip(dims, outs, scale_of)]
    if all(same):
        return []
    changed = []
    for a, d, o, s, kept in zip(axes, dims, outs, scale_of, same):
        plain = mode.mode == "nearest" or mode.transform != "tf_crop_and_resize" or full_roi[a] == (0.0, 1.0)
        if kept and (mode.antialias or (s == 1 and plain)):
            continue
        if d is None:
            raise _RunTime(f"resized dim {a} of X not static")
        y_dim = n.y.shape[a] if n.y.shape is not None else None
        if isinstance(y_dim, int) and y_dim != o:
            raise GradientNotImplementedError(
                f"{node_label(n)}: output dim {a} is {y_dim} but the resize computes {o}"
            )
        changed.append(_AxisResize(a, int(d), int(o), s, full_roi[a]))
    return changed


@rule("Resize", since=10)
def resize(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = X resized: along each axis a, Y = W_a X with W_a from sizes, scales and attributes.

    dX = W^T dy, one resized axis at a time (the order does not matter: the maps are separable).
    Every nearest mode and coordinate transformation, linear and cubic, antialias included. With
    constant sizes, scales and roi and static resized dims the taps are constants of the backward;
    otherwise (scales or sizes computed at run time, symbolic dims) the backward builds each W_a
    from the run-time sizes and scales (:func:`_resize_run_time`, antialias included).
    """
    if not n.needs[0]:
        return first_only(n, None)
    mode = _resize_mode(n)
    rank = need_rank(n, n.x)
    dx = n.dy
    try:
        axes = _resize_axes(n, mode)
    except _RunTime:  # sizes or scales known only at run time
        return first_only(n, _resize_run_time(g, n, mode, rank))
    for ax in axes:
        idx, w = _resize_taps(mode, ax.n_out, ax.n_in, ax.scale, ax.roi)
        table, values = _transpose_taps(idx, w, ax.n_in)
        dx = _apply_adjoint(g, dx, ax.axis, rank, table, values)
    if dx is n.dy:  # a resize that changes nothing
        return first_only(n, dx)
    return first_only(n, g.Identity(dx, shape=n.x.shape))


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
    mode: _ResizeMode,
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


def _run_time_matrix(g: GradBuilder, mode: _ResizeMode, c: Var, n_in: Var, scale: Var, dtype: int) -> Var:
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
    g: GradBuilder, mode: _ResizeMode, c: Var, pos: Var, n_in: Var, scale: Var, dtype: int
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


def _resize_run_time(g: GradBuilder, n: NodeContext, mode: _ResizeMode, rank: int) -> Var:
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
        policy = _aspect_policy(n)
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


@rule("Upsample", since=7)
def upsample(g: GradBuilder, n: NodeContext) -> Grads:
    """Upsample-7/9: Resize-10 before its name (asymmetric coordinates, nearest truncates)."""
    return resize(g, n)


# ---- GridSample --------------------------------------------------------------------------------
def _float_dim(g: GradBuilder, x: Var, axis: int) -> float | Var:
    """Size of ``x`` along ``axis`` as a float, or a scalar Var of x's dtype when not static."""
    d = g.dim(x, axis)
    return float(d) if isinstance(d, int) else g.Cast(g.Squeeze(d, [0]), to=x.dtype)


def _reflect(g: GradBuilder, c: Var, low: float, span: float | Var) -> tuple[Var, Var]:
    """c reflected off both ends of [low, low + span] until inside, and its slope (+-1) in c."""
    t = c - low
    a = g.Abs(t)
    flips = g.Floor(a / span)
    extra = a - flips * span
    odd = (flips - g.Floor(flips * 0.5) * 2.0) > 0.5
    out = where(odd, span - extra, extra) + low
    minus = g.const(-1.0, c.dtype)
    slope = where(t < 0.0, minus, 1.0) * where(odd, minus, 1.0)
    return out, slope


@dataclass
class _Corners:
    """Where output positions read X along one spatial dim, on a corner axis (size 2, or 1 for
    nearest): indices, weights (zero for corners outside X with zeros padding) and the slopes of the
    weights in the pixel coordinate (linear only)."""

    index: Var  # (N, corners, Q) int64
    weight: Var  # (N, corners, Q)
    slope: Var | None  # broadcastable to (N, corners, Q)


def _grid_corners(
    g: GradBuilder, n: NodeContext, coord: Var, size: float | Var
) -> tuple[_Corners, float | Var]:
    """Corners of one normalized grid coordinate (N, Q), and d(pixel coordinate)/d(coordinate)."""
    align = bool(n.attr("align_corners", 0))
    padding = n.attr("padding_mode", "zeros")
    mode = n.attr("mode", "linear" if n.opset >= 20 else "bilinear")
    if mode not in ("linear", "bilinear", "nearest"):
        raise GradientNotImplementedError(
            f"{node_label(n)}: no gradient for mode {mode!r} (linear, cubic and nearest only)"
        )

    def lit(v: float | Var) -> Var:
        return v if isinstance(v, Var) else g.const(v, coord.dtype)

    last = lit(size - 1.0)
    zero = lit(0.0)
    dc: float | Var = (size - 1.0) * 0.5 if align else size * 0.5
    c = coord * dc + (size - 1.0) * 0.5  # [-1, 1] to [0, S-1] (aligned) or [-0.5, S-0.5]
    if mode == "nearest":
        c = g.Round(c)  # half to even, before the padding, as onnxruntime
    if padding in ("border", "reflection"):
        if padding == "reflection":
            low, span = (0.0, size - 1.0) if align else (-0.5, size)
            if isinstance(span, float) and span == 0:  # one pixel, aligned corners: always pixel 0
                c, slope = c * 0.0, c * 0.0
            else:
                c, slope = _reflect(g, c, low, span)
            dc = slope * dc
        inside = g.And(c > zero, c < last)  # clipping below stops the gradient, as torch
        c = g.Max(g.Min(c, last), zero)
        dc = cast(inside, c) * dc
    if mode == "nearest":
        index_f, weight, slope_w = g.Unsqueeze(c, [1]), None, None
    else:
        lo = g.Floor(c)
        frac = c - lo
        index_f = g.Concat(g.Unsqueeze(lo, [1]), g.Unsqueeze(lo + 1.0, [1]), axis=1)
        weight = g.Concat(g.Unsqueeze(1.0 - frac, [1]), g.Unsqueeze(frac, [1]), axis=1)
        slope_w = g.const(np.array([-1.0, 1.0]).reshape(1, 2, 1), coord.dtype)
    if padding == "zeros":  # corners outside X read zeros
        valid = cast(g.And(index_f >= zero, index_f <= last), coord)
        weight = valid if weight is None else weight * valid
        slope_w = None if slope_w is None else slope_w * valid
    elif weight is None:
        weight = g.Expand(g.const(np.ones(1), coord.dtype), g.Shape(index_f))
    index = g.Cast(g.Max(g.Min(index_f, last), zero), to=INT64)
    return _Corners(index, weight, slope_w), dc


_CUBIC_A = -0.75  # onnxruntime's (and torch's) bicubic coefficient


def _grid_cubic_corners(
    g: GradBuilder, n: NodeContext, coord: Var, size: float | Var
) -> tuple[_Corners, float | Var]:
    """The 4 taps floor(c) - 1 .. floor(c) + 2 of one normalized grid coordinate (N, Q), as
    onnxruntime's (and torch's) cubic mode reads them: the coordinate is not clipped, each tap
    outside the image reads zero, the edge pixel or its reflection off [c_min, c_max], by padding
    mode. Weights are Keys' cubic with a = -0.75 of t = c - floor(c), slopes their derivatives in t;
    and d(pixel coordinate)/d(coordinate)."""
    align = bool(n.attr("align_corners", 0))
    padding = n.attr("padding_mode", "zeros")
    dt = coord.dtype

    def lit(v: float | Var) -> Var:
        return v if isinstance(v, Var) else g.const(v, dt)

    last, zero = lit(size - 1.0), lit(0.0)
    low, high = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
    dc: float | Var = (size - 1.0) * 0.5 if align else size * 0.5
    c = coord * dc + (size - 1.0) * 0.5
    lo = g.Floor(c)
    t = g.Unsqueeze(c - lo, [1])  # (N, 1, Q)
    taps = g.Unsqueeze(lo, [1]) + g.const(np.array([-1.0, 0.0, 1.0, 2.0]).reshape(1, 4, 1), dt)
    sign = g.const(np.array([1.0, 1.0, -1.0, -1.0]).reshape(1, 4, 1), dt)
    dist = g.const(np.array([1.0, 0.0, 1.0, 2.0]).reshape(1, 4, 1), dt) + t * sign  # t+1, t, 1-t, 2-t
    far = g.const(np.array([True, False, False, True]).reshape(1, 4, 1))
    a = _CUBIC_A
    weight = where(
        far,
        ((dist * a - 5 * a) * dist + 8 * a) * dist - 4 * a,
        ((dist * (a + 2) - (a + 3)) * dist) * dist + 1.0,
    )
    slope = sign * where(
        far,
        (dist * (3 * a) - 10 * a) * dist + 8 * a,
        (dist * (3 * (a + 2)) - 2 * (a + 3)) * dist,
    )
    if padding == "zeros":
        valid = cast(g.And(taps >= zero, taps <= last), coord)
        weight, slope = weight * valid, slope * valid
    elif padding == "reflection" and not (isinstance(high - low, float) and high - low == 0):
        taps, _ = _reflect(g, taps, low, high - low)
    index = g.Cast(g.Max(g.Min(taps, last), zero), to=INT64)
    return _Corners(index, weight, slope), dc


def _spread(g: GradBuilder, v: Var, j: int, k: int) -> Var:
    """(N, corners, Q) of spatial dim j to (N, 1, .., corners, .., 1, Q): corner axes 1..k."""
    others = [1 + i for i in range(k) if i != j]
    return g.Unsqueeze(v, others) if others else v


@rule("GridSample", since=16)
def grid_sample(g: GradBuilder, n: NodeContext) -> Grads:
    """Y[n, c, o] = sum over corners k of w_k(grid[n, o]) X[n, c, p_k(grid[n, o])].

    dX = scatter-add of dy * w_k at p_k; d grid = sum_c dy * sum_k (dw_k / dcoord) X[p_k], times the
    slopes of the padding and of the unnormalization, as torch.nn.functional.grid_sample (zero for
    nearest). Linear, nearest and cubic modes (4 x 4 taps: :func:`_grid_cubic_corners`), any number
    of spatial dims, every padding mode.
    """
    x, grid, dy = n.inputs[0], n.inputs[1], n.dy
    assert x is not None and grid is not None
    rank = need_rank(n, x)
    k = rank - 2
    pieces = g.Split(grid, axis=-1, num_outputs=k, outputs=k) if k > 1 else (grid,)
    dims: list[_Corners] = []
    dcs: list[float | Var] = []
    cubic = n.attr("mode", "linear") in ("cubic", "bicubic")
    corner_fn = _grid_cubic_corners if cubic else _grid_corners
    for j in range(k):  # spatial dim j of X is grid component k - 1 - j
        corners, dc = corner_fn(g, n, g.Reshape(pieces[k - 1 - j], [0, -1]), _float_dim(g, x, 2 + j))
        dims.append(corners)
        dcs.append(dc)
    # Flat index into X's spatial plane and weight of every corner: (N, 2, .., 2, Q).
    index = weight = None
    stride: int | Var = 1  # of spatial dim j in the flattened plane
    for j in reversed(range(k)):
        term = _spread(g, dims[j].index, j, k)
        term = term if isinstance(stride, int) and stride == 1 else term * stride
        index = term if index is None else index + term
        w = _spread(g, dims[j].weight, j, k)
        weight = w if weight is None else weight * w
        size = g.dim(x, 2 + j)
        if isinstance(stride, int) and isinstance(size, int):
            stride = stride * size
        else:
            stride = g.Mul(g.shape_vector([stride]), g.shape_vector([size]))
    assert index is not None and weight is not None
    dy_k = g.Unsqueeze(g.Reshape(dy, [0, 0, -1]), list(range(2, 2 + k)))  # (N, C, 1, .., 1, Q)
    index_nc = g.Expand(g.Reshape(index, [0, 1, -1]), g.shape_vector([1, g.dim(x, 1), 1]))
    grads: Grads = [None, None]
    if n.needs[0]:
        values = g.Reshape(dy_k * g.Unsqueeze(weight, [1]), [0, 0, -1])
        plane = zeros(g, g.shape_vector([g.dim(x, 0), g.dim(x, 1), stride]), x.dtype)  # (N, C, P)
        dx = g.ScatterElements(plane, index_nc, values, axis=2, reduction="add")
        grads[0] = g.reshape(dx, x)
    if n.needs[1] and dims[0].slope is None:
        grads[1] = g.zeros_like(grid)  # piecewise constant in the grid
    elif n.needs[1]:
        flat_x = g.Reshape(x, [0, 0, -1])  # (N, C, P)
        width = 4 if cubic else 2  # corners per spatial dim
        picked = g.Reshape(g.GatherElements(flat_x, index_nc, axis=2), [0, 0, *[width] * k, -1])
        per_corner = g.ReduceSum(picked * dy_k, [1], keepdims=0)  # (N, 2, .., 2, Q)
        parts = []
        for j in reversed(range(k)):  # grid components: last spatial dim first
            factor = None
            for i, ci in enumerate(dims):
                f = _spread(g, ci.slope if i == j else ci.weight, i, k)  # type: ignore[arg-type]
                factor = f if factor is None else factor * f
            d = g.reduce_sum(per_corner * factor, list(range(1, k + 1)), keepdims=False) * dcs[j]
            parts.append(g.Unsqueeze(d, [2]))
        dgrid = parts[0] if k == 1 else g.Concat(*parts, axis=2)
        grads[1] = g.reshape(dgrid, grid)
    return grads


# ---- AffineGrid ------------------------------------------------------------------------------
@rule("AffineGrid", since=20)
def affine_grid_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``grid[b, p] = theta[b] @ [base(p), 1]``: ``dtheta[b] = dgrid[b]^T @ [base, 1]``."""
    theta, size = n.inputs[0], n.inputs[1]
    if theta is None or theta.static_shape is None:
        raise refuse(n, "theta needs a static shape")
    k = theta.static_shape[1]  # 2 (2-D grid) or 3 (3-D grid)
    eye = np.eye(k, k + 1)[None]
    # base coordinates: the grid of the identity transform for one batch item, flattened to [P, k]
    one = g.Concat(g.const(np.int64([1])), g.op("Slice", size, [1], [k + 2], [0]), axis=0)
    base = g.op("AffineGrid", g.const(eye, theta.dtype), one, align_corners=n.attr("align_corners", 0))
    base = g.Reshape(base, g.const(np.int64([-1, k])))
    ones = g.op("ReduceSum", base * 0.0, g.const(np.int64([1])), keepdims=1) + 1.0  # [P, 1]
    homogeneous = g.Concat(base, ones, axis=1)  # [P, k + 1]
    batch = g.op("Slice", g.shape_of(theta), [0], [1], [0])
    dgrid = g.Reshape(n.dy, g.Concat(batch, g.const(np.int64([-1, k])), axis=0))  # [N, P, k]
    return [g.MatMul(g.Transpose(dgrid, perm=[0, 2, 1]), homogeneous), None]


# ---- Col2Im ------------------------------------------------------------------------------------
@rule("Col2Im", since=18)
def col2im(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = sum of the columns of X placed as patches of a (padded) image: dX cuts the patches of the
    padded dy back out (Im2Col), one Gather with a table of patch positions built from the constant
    image and block shapes (or, when those are computed at run time, by the backward from them)."""
    if not n.needs[0]:
        return first_only(n, None)
    image = n.const_input(1)
    block = n.const_input(2)
    if image is None or block is None:
        return first_only(n, _col2im_run_time(g, n))
    k = len(image)
    dil = list(n.attr("dilations") or [1] * k)
    pads = list(n.attr("pads") or [0] * (2 * k))
    strides = list(n.attr("strides") or [1] * k)
    padded = [int(image[i]) + pads[i] + pads[k + i] for i in range(k)]
    slides = [(padded[i] - (dil[i] * (int(block[i]) - 1) + 1)) // strides[i] + 1 for i in range(k)]
    # table[b, l] = flat position in the padded image of block offset b at sliding position l
    offsets = np.indices([int(b) for b in block]).reshape(k, -1) * np.array(dil)[:, None]
    starts = np.indices(slides).reshape(k, -1) * np.array(strides)[:, None]
    pos = offsets[:, :, None] + starts[:, None, :]  # (k, K, L)
    table = np.ravel_multi_index(tuple(pos), padded)
    dy = n.dy
    if any(pads):
        dy = g.Pad(dy, [0, 0, *pads[:k], 0, 0, *pads[k:]])
    cols = g.Gather(g.Reshape(dy, [0, 0, -1]), table.astype(np.int64), axis=2)  # (N, C, K, L)
    return first_only(n, g.Reshape(cols, [0, -1, table.shape[1]], shape=n.x.shape))


def _col2im_run_time(g: GradBuilder, n: NodeContext) -> Var:
    """Col2Im's adjoint with image_shape or block_shape known only at run time: the same table of
    patch positions, built by the backward (a Range per dim and broadcast sums)."""
    k = None
    for v in (n.inputs[1], n.inputs[2]):
        if v is not None and v.shape is not None and isinstance(v.shape[0], int):
            k = v.shape[0]
    if k is None and n.y.rank is not None:
        k = n.y.rank - 2
    if k is None:
        raise GradientNotImplementedError(f"{node_label(n)}: the number of image dims must be known")
    dil = list(n.attr("dilations") or [1] * k)
    pads = list(n.attr("pads") or [0] * (2 * k))
    strides = list(n.attr("strides") or [1] * k)
    zero, one = g.const(np.int64(0)), g.const(np.int64(1))

    def entry(i: int, j: int) -> Var:
        value = n.const_input(i)
        if value is not None:
            return g.const(np.int64(value[j]))
        return g.Gather(g.Cast(n.inputs[i], to=INT64), g.const(np.int64(j)), axis=0)

    padded = [entry(1, i) + (pads[i] + pads[k + i]) for i in range(k)]
    blocks = [entry(2, i) for i in range(k)]
    slides = [(padded[i] - (blocks[i] - 1) * dil[i] - 1) / strides[i] + 1 for i in range(k)]  # int Div

    def grid(sizes: list[Var], steps: list[int]) -> Var:
        """Flat positions in the padded image of index tuples over ``sizes``, each dim scaled by its
        step: sum_i range(sizes[i]) * steps[i] * (product of the padded dims after i), flattened."""
        total = None
        for i in range(k):
            term = g.Range(zero, sizes[i], one) * steps[i]
            for p in padded[i + 1 :]:
                term = term * p
            term = g.Unsqueeze(term, [j for j in range(k) if j != i]) if k > 1 else term
            total = term if total is None else total + term
        assert total is not None
        return g.Reshape(total, g.const(np.array([-1], dtype=np.int64)))

    table = g.Unsqueeze(grid(blocks, dil), [1]) + g.Unsqueeze(grid(slides, strides), [0])  # (K, L)
    dy = n.dy
    if any(pads):
        dy = g.Pad(dy, [0, 0, *pads[:k], 0, 0, *pads[k:]])
    cols = g.Gather(g.Reshape(dy, [0, 0, -1]), table, axis=2)  # (N, C, K, L)
    return g.reshape(cols, n.x)
