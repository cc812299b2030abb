"""Pooling and unpooling: MaxPool, AveragePool, LpPool, their global forms, the region poolings
MaxRoiPool and RoiAlign, and MaxUnpool.

Pooling reuses what the forward knows: MaxPool's own ``Indices`` output routes dY back with one
MaxUnpool (windows that do not overlap) or scatter-add; windows that tile X get their argmax from a
forward ArgMax instead, which costs less than the Indices. AveragePool and LpPool spread a per-window
factor back over their windows with a ``ConvTranspose`` of ones (:func:`spread_windows`). The
region ops sample X at positions known only at run time; their backward recomputes those positions
and bilinear weights from the saved inputs and routes dY with dense selection matrices (RoiAlign) or
an argmax (MaxRoiPool). MaxUnpool, which writes X where MaxPool's Indices say, reads dY back there.
"""

from __future__ import annotations

import math
import operator
from functools import reduce
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from ...errors import GradientNotImplementedError
from ..builder import INT64, GradBuilder, Var, where
from ..registry import NodeContext, rule
from .common import (
    Grads,
    Window,
    first_only,
    fit_spatial,
    max_grad,
    node_label,
    numel,
    pad_at_run_time,
    positions,
    run_time_same_pads,
    same_pads_at_run_time,
    spatial_dims,
    spatial_rank,
    static_dims,
    unpad_at_run_time,
    window_of,
    zeros,
)


# ---- max pooling -----------------------------------------------------------------------------
@rule("MaxPool")
def max_pool(g: GradBuilder, n: NodeContext) -> Grads:
    """dX = scatter-add of dY at the argmax of each window (a MaxUnpool when windows do not overlap).

    The forward node's ``Indices`` output (added to it when the model does not use it) holds those
    positions, flattened over the whole NCHW tensor by onnxruntime and onnx.reference alike, with
    padding not counted; ``storage_order=1`` numbers each plane column-major instead.

    Windows that tile a 2-D float32 X (kernel = strides, no padding, dilation 1, floor mode) skip
    the Indices: onnxruntime's MaxPool computes them 7-10x slower than Y alone. The forward instead
    runs an ArgMax over X viewed window by window (:func:`_window_argmax`): it picks the same element
    as the Indices, the first maximum in row-major order, ties included (docs/performance.md).
    """
    if not n.needs[0]:
        return [None]
    if n.opset < 8:
        raise GradientNotImplementedError(
            f"{node_label(n)}: MaxPool before opset 8 has no Indices output to route the gradient"
        )
    x, dy = n.x, n.dy
    nsp = spatial_rank(n, x, n.y)
    tiles = _tiling(n, x, nsp)
    if tiles is not None:
        return [_tiled_grad(g, x, dy, _window_argmax(g, x, tiles), tiles)]
    # With ceil_mode, ONNX shape inference and onnxruntime can disagree on the output size.
    shape = n.y.shape
    if shape is not None and n.attr("ceil_mode", 0):
        shape = (*shape[:2], *(None,) * (len(shape) - 2))
    idx = g.extra_output(n.node, 1, TensorProto.INT64, shape)
    if int(n.attr("storage_order", 0)) and nsp > 1:
        idx = _row_major(g, idx, x, nsp)
    if x.dtype == TensorProto.FLOAT and _disjoint_windows(n, x, nsp):
        # No element is picked twice: MaxUnpool writes dY at the indices in one pass, no sum needed
        # (measured 3x faster than zeros plus a scatter-add on the anchor CNN; onnxruntime has it
        # for float32 only). Its own geometry only bounds the shape: one-element windows, stride 1.
        ones = [1] * nsp
        return [g.MaxUnpool(dy, idx, g.shape_of(x), kernel_shape=ones, strides=ones, shape=x.shape)]
    static = x.static_shape
    size = (
        g.const(np.array([math.prod(static)], dtype=np.int64))
        if static is not None
        else g.ReduceProd(g.shape_of(x), keepdims=1)
    )
    flat = g.ScatterElements(
        zeros(g, size, x.dtype), g.Reshape(idx, [-1]), g.Reshape(dy, [-1]), axis=0, reduction="add"
    )
    return [g.Reshape(flat, g.shape_of(x), shape=x.shape)]


def _tiling(n: NodeContext, x: Var, nsp: int) -> _Tiles | None:
    """The geometry of a 2-D float32 MaxPool whose windows tile X, when the model leaves its
    Indices unused: kernel equal to strides, no padding, dilation 1, floor mode, row-major,
    static spatial sizes. None for any other MaxPool."""
    if nsp != 2 or x.dtype != TensorProto.FLOAT or n.opset < 10:  # Slice with inputs: opset 10
        return None
    if len(n.node.output) > 1 and n.node.output[1]:
        return None
    sizes = static_dims(spatial_dims(x, nsp))
    kernel = [int(k) for k in n.attr("kernel_shape")]
    if sizes is None or [int(s) for s in (n.attr("strides") or [1] * nsp)] != kernel:
        return None
    if any(int(d) != 1 for d in (n.attr("dilations") or [1] * nsp)) or any(n.attr("pads") or [0]):
        return None
    if (n.attr("auto_pad", "NOTSET") or "NOTSET") not in ("NOTSET", "VALID"):
        return None
    if n.attr("ceil_mode", 0) or n.attr("storage_order", 0):
        return None
    if any(s < k for s, k in zip(sizes, kernel)):
        return None
    return _Tiles((sizes[0], sizes[1]), (kernel[0], kernel[1]))


class _Tiles:
    """kh x kw windows tiling an H x W plane (the last rows and columns no window reaches left out)."""

    def __init__(self, sizes: tuple[int, int], kernel: tuple[int, int]) -> None:
        self.sizes, self.kernel = sizes, kernel
        self.rows = (sizes[0] // kernel[0], sizes[1] // kernel[1])


def _window_argmax(g: GradBuilder, x: Var, t: _Tiles) -> Var:
    """In the forward: the position of each window's first maximum, row-major within the window,
    int64 (N, C, Ho, Wo). ArgMax keeps the first of equal values, as MaxPool's Indices do; it reads
    X viewed as (N, C, Ho, Wo, kh kw), one Transpose away."""
    (h, w), (kh, kw), (ho, wo) = t.sizes, t.kernel, t.rows
    f32 = TensorProto.FLOAT
    tiled = x
    if (ho * kh, wo * kw) != (h, w):
        ends = g.fwd_const([ho * kh, wo * kw])
        tiled = g.fwd_op("Slice", x, g.fwd_const([0, 0]), ends, g.fwd_const([2, 3]), dtype=f32)
    x6 = g.fwd_op("Reshape", tiled, g.fwd_const([0, 0, ho, kh, wo, kw]), dtype=f32)
    xt = g.fwd_op("Transpose", x6, dtype=f32, perm=[0, 1, 2, 4, 3, 5])
    x5 = g.fwd_op("Reshape", xt, g.fwd_const([0, 0, ho, wo, kh * kw]), dtype=f32)
    shape = None if x.shape is None else (*x.shape[:2], ho, wo)
    return g.fwd_op("ArgMax", x5, dtype=INT64, shape=shape, axis=4, keepdims=0)


def _tiled_grad(g: GradBuilder, x: Var, dy: Var, arg: Var, t: _Tiles) -> Var:
    """dX: dY written by one MaxUnpool at each window's argmax (``arg``, :func:`_window_argmax`),
    made a position in the whole X: plane start + window corner + (arg // kw) W + arg % kw."""
    (h, w), (kh, kw), (ho, wo) = t.sizes, t.kernel, t.rows
    if kh == 1:
        offset = arg
    elif kh == 2:  # a compare and a Cast cost less than an int64 Div (measured)
        second_row = g.Cast(g.GreaterOrEqual(arg, g.const(np.int64(kw))), to=INT64)
        offset = arg + second_row * g.const(np.int64(w - kw))
    else:
        offset = arg + g.Div(arg, g.const(np.int64(kw))) * g.const(np.int64(w - kw))
    corners = np.arange(ho)[:, None] * (kh * w) + np.arange(wo)[None, :] * kw
    planes = g.ReduceProd(g.Slice(g.shape_of(dy), [0], [2]), keepdims=0, dtype=INT64, shape=())
    step = g.const(np.int64(h * w))
    starts = g.Range(g.const(np.int64(0)), planes * step, step)
    starts = g.Reshape(starts, g.shape_vector([g.dim(dy, 0), g.dim(dy, 1), 1, 1]))
    ones = [1, 1]
    idx = offset + (starts + g.const(corners.astype(np.int64)))
    return g.MaxUnpool(dy, idx, g.shape_of(x), kernel_shape=ones, strides=ones, shape=x.shape)


def _disjoint_windows(n: NodeContext, x: Var, nsp: int) -> bool:
    """Whether the windows of a MaxPool do not overlap and Y is no larger than X along any axis
    (what MaxUnpool with one-element windows requires of the shape it writes into)."""
    kernel = [int(k) for k in n.attr("kernel_shape")]
    strides = [int(s) for s in (n.attr("strides") or [1] * nsp)]
    dilations = [int(d) for d in (n.attr("dilations") or [1] * nsp)]
    if any(s < (k - 1) * d + 1 for k, s, d in zip(kernel, strides, dilations)):
        return False
    xs = static_dims(spatial_dims(x, nsp))
    if xs is not None:  # Y's size as onnxruntime computes it (ONNX inference can differ in ceil mode)
        win, ceil = window_of(n, nsp, kernel, list(xs)), bool(n.attr("ceil_mode", 0))
        return all(
            _pool_rows(h, k, s, d, b, e, ceil) <= h
            for h, k, s, d, b, e in zip(xs, kernel, strides, dilations, win.begins, win.ends)
        )
    # Unknown sizes: with no padding and no ceil mode, Y = floor((H - extent) / s) + 1 <= H.
    pads = n.attr("pads") or [0] * (2 * nsp)
    auto_pad = n.attr("auto_pad", "NOTSET") or "NOTSET"
    return auto_pad in ("NOTSET", "VALID") and not any(pads) and not n.attr("ceil_mode", 0)


def _row_major(g: GradBuilder, idx: Var, x: Var, nsp: int) -> Var:
    """Turn indices numbered column-major within each (n, c) plane into row-major ones."""
    static = static_dims(spatial_dims(x, nsp))
    dims: list[Any] = (
        list(static)
        if static is not None
        else [g.Gather(g.shape_of(x), g.const(np.int64(2 + i))) for i in range(nsp)]
    )
    plane = g.Mod(idx, reduce(operator.mul, dims, 1))
    rest, row = plane, None
    for i, d in enumerate(dims):  # column-major: the first spatial dim varies fastest
        coord = g.Mod(rest, d)
        rest = g.Div(rest, d)
        stride = reduce(operator.mul, dims[i + 1 :], 1)
        term = coord if isinstance(stride, int) and stride == 1 else coord * stride
        row = term if row is None else row + term
    return idx - plane + row


def _pool_rows(h: int, k: int, s: int, d: int, pb: int, pe: int, ceil: bool) -> int:
    """Output size along one dim, as onnxruntime computes it (ceil mode drops a window that would
    start in the end padding)."""
    span = h + pb + pe - ((k - 1) * d + 1)
    if not ceil:
        return span // s + 1
    rows = -(-span // s) + 1
    return rows - 1 if (rows - 1) * s >= h + pb else rows


@rule("GlobalMaxPool")
def global_max_pool(g: GradBuilder, n: NodeContext) -> Grads:
    """dX = dY * [x == y] / #ties over each plane."""
    if not n.needs[0]:
        return [None]
    x = n.x
    if x.rank is None:
        raise GradientNotImplementedError(f"{node_label(n)}: the rank of its input must be known")
    axes = list(range(2, x.rank))
    return [max_grad(g, x, n.y, n.dy, lambda m: g.reduce_sum(m, axes, keepdims=True))]


# ---- average and Lp pooling: a factor spread over the windows --------------------------------
def spread_windows(
    g: GradBuilder,
    v: Var,
    x: Var,
    kernel: list[int],
    win: Window,
    spatial: list[int] | None,
    ceil: bool,
) -> Var:
    """t[i] = sum of v[w] over the pooling windows w that contain position i of x.

    One ``ConvTranspose`` of v with a ones kernel and the pooling geometry, channels folded into
    the batch so the kernel does not depend on C. ``output_padding`` reaches positions after the
    last window; a window that ceil mode let run past the padded input is cropped by a larger end
    pad. (AveragePool's rule is this with v = dY / count.) With ``spatial`` sizes unknown
    (None) the ConvTranspose keeps the begin pads only and its result is cut or zero-filled to
    X's run-time size (:func:`fit_spatial`).
    """
    ones = g.const(np.ones((1, 1, *kernel)), x.dtype)
    geometry = {"strides": list(win.strides), "dilations": list(win.dilations)}
    if spatial is None:
        nsp = len(kernel)
        folded = g.Reshape(
            v, g.Concat(g.const(np.array([-1, 1])), g.Slice(g.Shape(v), [2], [2 + nsp]), axis=0)
        )
        ct = g.ConvTranspose(folded, ones, pads=[*win.begins, *[0] * nsp], **geometry)
        fitted = fit_spatial(g, ct, g.Slice(g.shape_of(x), [2], [2 + nsp]), nsp)
        return g.Reshape(fitted, g.shape_of(x), shape=x.shape)
    rows, ends, out_pad = [], [], []
    for i, h in enumerate(spatial):
        k, s, d = kernel[i], win.strides[i], win.dilations[i]
        pb, pe = win.begins[i], win.ends[i]
        o = _pool_rows(h, k, s, d, pb, pe, ceil)
        rows.append(o)
        extra = h - (s * (o - 1) + (k - 1) * d + 1 - pb - pe)
        ends.append(pe if extra >= 0 else pe - extra)
        out_pad.append(max(extra, 0))
    ct = g.ConvTranspose(
        g.Reshape(v, [-1, 1, *rows]),
        ones,
        pads=[*win.begins, *ends],
        output_padding=out_pad if any(out_pad) else None,
        **geometry,
    )
    return g.Reshape(ct, g.shape_of(x), shape=x.shape)


class _PoolWindow:
    """Kernel, spatial sizes of X (None unless all static) and window of an average or Lp pool;
    ``pads``: the (begins, ends) of SAME pads that depend on run-time sizes (1-D int64 Vars), the
    window then unpadded: the rule pools X padded by them (:func:`pad_at_run_time`)."""

    def __init__(self, g: GradBuilder, n: NodeContext) -> None:
        nsp = spatial_rank(n, n.x, n.y)
        self.kernel = [int(k) for k in n.attr("kernel_shape")]
        spatial = spatial_dims(n.x, nsp)
        self.static = static_dims(spatial)
        self.pads = None
        if same_pads_at_run_time(n, self.kernel, spatial):
            self.pads = run_time_same_pads(g, n, n.x, self.kernel)
        self.win = window_of(n, nsp, self.kernel, spatial, unpadded=self.pads is not None)


def _run_time_inverse_count(
    g: GradBuilder, n: NodeContext, kernel: list[int], win: Window, include_pad: bool, pads: Any
) -> Var:
    """1 / count of each AveragePool window, from the run-time sizes of X and Y: along axis i,
    window o reads positions o s - pb + j d (j < k), counted when inside X, or inside the padded X
    with ``count_include_pad``; the count of a window is the product of its axes' counts. With
    run-time ``pads`` (begins, ends) the window is unpadded over X padded by them."""
    x, nsp = n.x, len(kernel)
    inverse: Var | None = None
    for i, k in enumerate(kernel):
        s, d, pb, pe = win.strides[i], win.dilations[i], win.begins[i], win.ends[i]
        rows = _arange(g, g.dim(n.y, 2 + i))
        starts = g.Unsqueeze(rows * s - pb, [1]) + g.const(np.arange(k)[None, :] * d)  # (O, k)
        h = g.dim(x, 2 + i)
        lo: Any
        hi: Any
        if pads is not None:  # X lies at [b, b + H) of the padded X, which ends at b + H + e
            b, e = (g.Slice(p, [i], [i + 1]) for p in pads)
            lo, hi = (0, g.Add(g.Add(b, h), e)) if include_pad else (b, g.Add(b, h))
        else:
            lo, hi = (-pb, h + pe) if include_pad else (0, h)
        lo_v = g.const(np.int64(lo)) if isinstance(lo, int) else lo
        hi_v = g.const(np.int64(hi)) if isinstance(hi, int) else hi
        inside = g.And(starts >= lo_v, starts < hi_v)
        count = g.ReduceSum(g.Cast(inside, to=x.dtype), [1], keepdims=0)  # (O,)
        others = [a for a in range(2 + nsp) if a != 2 + i]
        inv = g.Unsqueeze(g.Reciprocal(count), others)
        inverse = inv if inverse is None else inverse * inv
    assert inverse is not None
    return inverse


@rule("AveragePool")
def average_pool(g: GradBuilder, n: NodeContext) -> Grads:
    """dX = ConvTranspose(dY / count, ones kernel): a window spreads dY / count over its elements.

    count is the number of elements of a window inside X (``count_include_pad=0``) or inside the
    padded X (``=1``), per output position: constants from static sizes, else computed from the
    run-time sizes of X and Y; :func:`spread_windows` does the rest.
    """
    if not n.needs[0]:
        return [None]
    x, dy = n.x, n.dy
    pool = _PoolWindow(g, n)
    kernel, static, win = pool.kernel, pool.static, pool.win
    ceil = bool(n.attr("ceil_mode", 0))
    include_pad = bool(n.attr("count_include_pad", 0))
    if static is None:
        inverse = _run_time_inverse_count(g, n, kernel, win, include_pad, pool.pads)
        return [_spread_at_run_time(g, dy * inverse, x, pool, ceil)]
    counts = []
    for i, h in enumerate(static):
        k, s, d = kernel[i], win.strides[i], win.dilations[i]
        pb, pe = win.begins[i], win.ends[i]
        o = _pool_rows(h, k, s, d, pb, pe, ceil)
        lo, hi = (-pb, h + pe) if include_pad else (0, h)
        starts = np.arange(o)[:, None] * s - pb + np.arange(k)[None, :] * d
        counts.append(((starts >= lo) & (starts < hi)).sum(axis=1))
    inv_count = 1.0 / reduce(np.multiply.outer, counts).astype(np.float64)
    return [spread_windows(g, dy * g.const(inv_count, x.dtype), x, kernel, win, static, ceil)]


def _global_count(g: GradBuilder, x: Var, dy: Var) -> Var:
    """Number of spatial positions of x (a constant when static)."""
    static = static_dims(list(x.shape[2:])) if x.shape is not None else None
    if static is not None:
        return g.const(float(math.prod(static)), x.dtype)
    size_x = g.ReduceProd(g.shape_of(x), keepdims=0)
    return g.Cast(g.Div(size_x, g.Size(dy)), to=x.dtype)


@rule("GlobalAveragePool")
def global_average_pool(g: GradBuilder, n: NodeContext) -> Grads:
    """dX = dY / (H W ...), broadcast over the spatial dims."""
    if not n.needs[0]:
        return [None]
    x, dy = n.x, n.dy
    return [g.Expand(dy / _global_count(g, x, dy), g.shape_of(x), shape=x.shape)]


def _lp_factors(g: GradBuilder, x: Var, y: Var, dy: Var, p: float) -> tuple[Var, Var]:
    """For y = (sum |x|^p)^(1/p): dy dy/dx = (dy y^(1-p)) * (sign(x) |x|^(p-1)), as (per-window
    factor, per-element factor). A window of zeros (y = 0) gets 0, torch's choice for norms."""
    if p == 1:
        return dy, g.Sign(x)
    per_window = dy / y if p == 2 else dy * g.Pow(y, g.const(np.array(1 - p), y.dtype))
    per_window = where(g.Equal(y, g.const(np.array(0.0), y.dtype)), 0.0, per_window)
    per_element = x if p == 2 else g.Sign(x) * g.Pow(g.Abs(x), g.const(np.array(p - 1), x.dtype))
    return per_window, per_element


def _lp_p(n: NodeContext) -> float:
    p = float(n.attr("p", 2))
    if p < 1:
        raise GradientNotImplementedError(f"{node_label(n)}: p = {p} < 1 is not a norm")
    return p


@rule("LpPool")
def lp_pool(g: GradBuilder, n: NodeContext) -> Grads:
    """y = (sum over the window of |x|^p)^(1/p): dx = sign(x) |x|^(p-1) * spread(dy y^(1-p)).

    Padding adds zeros, which add nothing; ``spread`` sums over the windows holding each element
    (:func:`spread_windows`).
    """
    if not n.needs[0]:
        return [None]
    x = n.x
    pool = _PoolWindow(g, n)
    per_window, per_element = _lp_factors(g, x, n.y, n.dy, _lp_p(n))
    ceil = bool(n.attr("ceil_mode", 0))
    if pool.static is None:
        return [_spread_at_run_time(g, per_window, x, pool, ceil) * per_element]
    spread = spread_windows(g, per_window, x, pool.kernel, pool.win, pool.static, ceil)
    return [spread * per_element]


def _spread_at_run_time(g: GradBuilder, v: Var, x: Var, pool: _PoolWindow, ceil: bool) -> Var:
    """:func:`spread_windows` over X of run-time sizes; with run-time pads, over X padded by them,
    X's part then cut out."""
    if pool.pads is None:
        return spread_windows(g, v, x, pool.kernel, pool.win, None, ceil)
    begins, ends = pool.pads
    padded = pad_at_run_time(g, x, begins, ends)
    spread = spread_windows(g, v, padded, pool.kernel, pool.win, None, ceil)
    return unpad_at_run_time(g, spread, begins, x, len(pool.kernel))


@rule("GlobalLpPool")
def global_lp_pool(g: GradBuilder, n: NodeContext) -> Grads:
    """y = (sum over the spatial dims of |x|^p)^(1/p): dx = dy y^(1-p) sign(x) |x|^(p-1)."""
    if not n.needs[0]:
        return [None]
    per_window, per_element = _lp_factors(g, n.x, n.y, n.dy, _lp_p(n))
    return [per_window * per_element]


# ---- region pooling: shared pieces ----------------------------------------------------------
def _int(g: GradBuilder, size: Var | int) -> Var | int:
    """A size from :meth:`GradBuilder.dim` as an int or a scalar int64 Var, for arithmetic."""
    return size if isinstance(size, int) else g.Squeeze(size, [0])


def _scalar(g: GradBuilder, size: Var | int, dtype: int) -> Var:
    """A size from :meth:`GradBuilder.dim` as a scalar of ``dtype``."""
    if isinstance(size, int):
        return g.const(np.array(size), dtype)
    return g.Cast(g.Squeeze(size, [0]), to=dtype)


def _arange(g: GradBuilder, n: Var | int, dtype: int = INT64) -> Var:
    """0, 1, ..., n - 1 in ``dtype`` (a constant when n is an int; else n is a 1-D int64 Var)."""
    if isinstance(n, int):
        return g.const(np.arange(n), dtype)
    count = g.Squeeze(n, [0])
    r = g.Range(g.const(np.array(0)), count, g.const(np.array(1)))
    return r if dtype == INT64 else g.Cast(r, to=dtype)


def _round_half_away(g: GradBuilder, v: Var) -> Var:
    """C's ``round`` (halves away from zero); ONNX ``Round`` rounds halves to even."""
    return g.Sign(v) * g.Floor(g.Abs(v) + 0.5)


def _column(g: GradBuilder, rois: Var, col: int) -> Var:
    """Column ``col`` of a (R, k) region table, as (R, 1)."""
    return g.Slice(rois, [col], [col + 1], [1])


# ---- MaxRoiPool -----------------------------------------------------------------------------
@rule("MaxRoiPool")
def max_roi_pool(g: GradBuilder, n: NodeContext) -> Grads:
    """y[r, c, i, j] = max of X[b_r, c] over bin (i, j) of region r: dX gets dy at that argmax.

    The bins are recomputed as onnxruntime computes them (corners rounded half away from zero,
    bin edges floor / ceil of float32 multiples of the bin size, clipped to X). The argmax is found
    in two steps that keep memory at R C H W (pw + ph) rather than R C H W ph pw: the first maximum
    along each row of a bin, then the first row holding the bin's maximum. dy is scatter-added
    there; empty bins (output 0) pass nothing. Regions get no gradient: their corners are rounded.
    """
    grads: Grads = [None, None]
    if not n.needs[0]:
        return grads
    x, rois, dy = n.inputs[0], n.inputs[1], n.dy
    assert x is not None and rois is not None
    ph, pw = (int(v) for v in n.attr("pooled_shape"))
    scale = float(n.attr("spatial_scale", 1.0))
    corners = g.Cast(g.Slice(rois, [1], [5], [1]), to=TensorProto.FLOAT) * np.float32(scale)
    corners = _round_half_away(g, corners)  # (R, 4): x1, y1, x2, y2
    batch = g.Cast(_column(g, rois, 0), to=INT64)  # (R, 1)
    h, w = g.dim(x, 2), g.dim(x, 3)
    rows = _roi_bins(g, corners, 1, 3, ph, h)  # (R, ph, H)
    cols = _roi_bins(g, corners, 0, 2, pw, w)  # (R, pw, W)
    xb = g.Gather(x, g.Squeeze(batch, [1]), axis=0)  # (R, C, H, W)
    lowest = g.const(np.array(-np.inf), x.dtype)
    # Step 1: for each row h and column bin j, the first maximum along w.
    masked = where(g.Unsqueeze(cols, [1, 2]), g.Unsqueeze(xb, [3]), lowest)  # (R, C, H, pw, W)
    w_arg = g.ArgMax(masked, axis=4, keepdims=0)  # (R, C, H, pw)
    row_max = g.ReduceMax(masked, [4], keepdims=0)
    # Step 2: for each row bin i, the first row holding the maximum; then that row's column.
    over_rows = where(g.Unsqueeze(rows, [1, 4]), g.Unsqueeze(row_max, [2]), lowest)  # (R, C, ph, H, pw)
    h_arg = g.ArgMax(over_rows, axis=3, keepdims=0)  # (R, C, ph, pw)
    w_sel = g.GatherElements(w_arg, h_arg, axis=2)
    nonempty = g.And(g.Unsqueeze(_any(g, rows), [2]), g.Unsqueeze(_any(g, cols), [1]))  # (R, ph, pw)
    c_dim = g.dim(x, 1)
    channels = g.Unsqueeze(_arange(g, c_dim), [0, 2, 3])  # (1, C, 1, 1)
    image = g.Unsqueeze(batch, [2, 3]) * _int(g, c_dim) + channels  # (R, C, 1, 1)
    index = image * _int(g, h) * _int(g, w) + h_arg * _int(g, w) + w_sel  # into X flattened
    update = dy * g.Cast(g.Unsqueeze(nonempty, [1]), to=x.dtype)
    total = g.ReduceProd(g.shape_of(x), keepdims=1)
    flat = g.ScatterElements(
        zeros(g, total, x.dtype), g.Reshape(index, [-1]), g.Reshape(update, [-1]), axis=0, reduction="add"
    )
    grads[0] = g.Reshape(flat, g.shape_of(x), shape=x.shape)
    return grads


def _any(g: GradBuilder, mask: Var) -> Var:
    """(R, bins, size) bool -> (R, bins): whether each bin covers anything."""
    return g.ReduceMax(g.Cast(mask, to=INT64), [2], keepdims=0) > 0


def _roi_bins(g: GradBuilder, corners: Var, lo: int, hi: int, bins: int, size: Var | int) -> Var:
    """(R, bins, size) bool: the positions along one axis that each bin of each region covers.

    Bin i spans [floor(i b), ceil((i + 1) b)) + start, clipped to [0, size], with the region length
    max(end - start + 1, 1) and b = length / bins, in float32 as onnxruntime computes it.
    """
    f32 = TensorProto.FLOAT
    start, end = _column(g, corners, lo), _column(g, corners, hi)  # (R, 1)
    step = g.Max(end - start + 1.0, g.const(np.array(1.0), f32)) / float(bins)
    idx = g.const(np.arange(bins, dtype=np.float32)[None, :])
    limit = _scalar(g, size, f32)
    zero = g.const(np.array(0.0), f32)
    first = g.Min(g.Max(g.Floor(idx * step) + start, zero), limit)  # (R, bins)
    last = g.Min(g.Max(g.Ceil((idx + 1.0) * step) + start, zero), limit)
    pos = _arange(g, size, f32)  # (size,)
    return g.And(pos >= g.Unsqueeze(first, [2]), pos < g.Unsqueeze(last, [2]))


def _batch_scatter(g: GradBuilder, per_roi: Var, batch: Var, x: Var) -> Var:
    """dX[n] = sum of per_roi[r] over the regions r of image n: one MatMul with an (N, R) one-hot."""
    images = _arange(g, g.dim(x, 0))
    onehot = g.Cast(g.Equal(g.Unsqueeze(images, [1]), g.Unsqueeze(batch, [0])), to=x.dtype)
    flat = g.MatMul(onehot, g.Reshape(per_roi, [0, -1]))
    return g.Reshape(flat, g.shape_of(x), shape=x.shape)


# ---- RoiAlign -------------------------------------------------------------------------------
class _Samples:
    """Bilinear sampling along one axis of every region (see :func:`_roi_align_axis`)."""

    def __init__(self, weights: Var, real: Var, grid: Var, slots: Var | int) -> None:
        self.weights = weights  # (R, bins, slots, size): weight of each sample corner at each position
        self.real = real  # (R, slots) bool: the slot is a sample of that region (grids vary by region)
        self.grid = grid  # (R, 1): samples per bin along this axis
        self.slots = slots  # 2 G: two corners for each of G sample slots


def _roi_align_axis(
    g: GradBuilder,
    rois: Var,
    lo: int,
    hi: int,
    bins: int,
    size: Var | int,
    ratio: int,
    scale: float,
    half: bool,
) -> _Samples:
    """Bilinear sampling along one axis, as onnxruntime and onnx.reference compute it.

    Region start = x1 scale - 1/2 (half_pixel) or x1 scale, length = end - start (at least 1
    unless half_pixel), bin b = length / bins, grid = sampling_ratio or ceil(b) samples per bin
    (G = the largest grid of all regions slots are made; slots past a region's grid are not real).
    Sample k of bin i is at y = start + i b + (k + 1/2) b / grid; it counts for nothing when
    y < -1 or y > size; else y is clamped to [0, size - 1] and weighs 1 - frac at floor(y) and frac
    at the next position (both the last one when floor(y) >= size - 1).
    """
    dtype = rois.dtype
    offset = 0.5 if half else 0.0
    start = _column(g, rois, lo) * scale - offset  # (R, 1)
    length = _column(g, rois, hi) * scale - offset - start
    if not half:
        length = g.Max(length, g.const(np.array(1.0), dtype))
    step = length / float(bins)
    if ratio > 0:
        grid = g.const(np.full((1, 1), float(ratio)), dtype)
        n_grid: Var | int = ratio
    else:
        grid = g.Ceil(step)
        largest = g.Max(g.ReduceMax(grid, keepdims=0), g.const(np.array(1.0), dtype))
        n_grid = g.Reshape(g.Cast(largest, to=INT64), [1])
    k = _arange(g, n_grid, dtype)  # (G,)
    i = g.const(np.arange(bins, dtype=np.float64).reshape(1, bins, 1), dtype)
    start3, step3, grid3 = (g.Unsqueeze(v, [2]) for v in (start, step, grid))
    y = start3 + i * step3 + g.Unsqueeze(k + 0.5, [0, 1]) * step3 / grid3  # (R, bins, G)
    limit = _scalar(g, size, dtype)
    real = g.Less(g.Unsqueeze(k, [0]), grid)  # (R, G)
    keep = g.Cast(g.And(g.And(y >= -1.0, y <= limit), g.Unsqueeze(real, [1])), to=dtype)
    yc = g.Max(y, g.const(np.array(0.0), dtype))
    last = limit - 1.0
    low = g.Min(g.Floor(yc), last)
    frac = where(g.Floor(yc) >= last, 0.0, yc - low)
    high = g.Min(low + 1.0, last)

    def pair(a: Var, b: Var) -> Var:  # (R, bins, G) twice -> (R, bins, G, 2)
        return g.Concat(g.Unsqueeze(a, [3]), g.Unsqueeze(b, [3]), axis=3)

    weights = pair((1.0 - frac) * keep, frac * keep)
    onehot = g.Cast(g.Equal(g.Unsqueeze(pair(low, high), [4]), _arange(g, size, dtype)), to=dtype)
    s = g.Reshape(onehot * g.Unsqueeze(weights, [4]), g.shape_vector([0, bins, -1, size]))
    real2 = g.Reshape(g.Expand(g.Unsqueeze(real, [2]), [1, 1, 2]), [0, -1])  # (R, 2G)
    slots = 2 * n_grid if isinstance(n_grid, int) else n_grid * 2
    return _Samples(s, real2, grid, slots)


@rule("RoiAlign", since=10)
def roi_align(g: GradBuilder, n: NodeContext) -> Grads:
    """Y[r, c, i, j] = pooled bilinear samples of X[b_r, c] over bin (i, j) of region r.

    Sampling is separable: with S_y (R, ph, 2G, H) and S_x (R, pw, 2G', W) the weights of the
    sample corners (:func:`_roi_align_axis`), avg mode is Y = P_y X P_x^T / count per region
    (P = S summed over its samples), so dX = P_y^T (dY / count) P_x. Max mode (onnxruntime's and
    onnx.reference's: the maximum over samples and their four corners of weight * X) routes dY
    to the argmax corner, times its weight. Per-region gradients reach their images through a
    one-hot MatMul. Regions and batch indices get no gradient, as in torchvision's roi_align
    (ONNX leaves their differentiability unspecified; the grid size jumps with them anyway).
    """
    grads: Grads = [None] * len(n.inputs)
    if not n.needs[0]:
        return grads
    x, rois, batch, dy = n.inputs[0], n.inputs[1], n.inputs[2], n.dy
    assert x is not None and rois is not None and batch is not None
    ph, pw = int(n.attr("output_height", 1)), int(n.attr("output_width", 1))
    ratio = int(n.attr("sampling_ratio", 0))
    scale = float(n.attr("spatial_scale", 1.0))
    half = n.opset >= 16 and str(n.attr("coordinate_transformation_mode", "half_pixel")) == "half_pixel"
    rois = g.Cast(rois, to=x.dtype) if rois.dtype != x.dtype else rois
    ys = _roi_align_axis(g, rois, 1, 3, ph, g.dim(x, 2), ratio, scale, half)
    xs = _roi_align_axis(g, rois, 0, 2, pw, g.dim(x, 3), ratio, scale, half)
    batch = g.Cast(batch, to=INT64) if batch.dtype != INT64 else batch
    if str(n.attr("mode", "avg")).lower() == "avg":
        count = g.Max(ys.grid * xs.grid, g.const(np.array(1.0), x.dtype))  # (R, 1)
        py = g.ReduceSum(ys.weights, [2], keepdims=0)  # (R, ph, H)
        px = g.ReduceSum(xs.weights, [2], keepdims=0)  # (R, pw, W)
        t = g.MatMul(dy / g.Unsqueeze(count, [2, 3]), g.Unsqueeze(px, [1]))  # (R, C, ph, W)
        per_roi = g.MatMul(g.Unsqueeze(g.Transpose(py, perm=[0, 2, 1]), [1]), t)  # (R, C, H, W)
    else:
        per_roi = _roi_align_max(g, x, batch, dy, ys, xs, ph, pw)
    grads[0] = _batch_scatter(g, per_roi, batch, x)
    return grads


def _roi_align_max(
    g: GradBuilder, x: Var, batch: Var, dy: Var, ys: _Samples, xs: _Samples, ph: int, pw: int
) -> Var:
    """Per-region dX of max mode. V = S_y X S_x^T holds every candidate weight * X; a one-hot of
    each bin's argmax candidate, times dY, goes back through the same matrices."""
    xb = g.Gather(x, batch, axis=0)  # (R, C, H, W)
    sy = g.Unsqueeze(g.Reshape(ys.weights, g.shape_vector([0, -1, g.dim(x, 2)])), [1])  # (R, 1, ph 2G, H)
    sx = g.Unsqueeze(g.Reshape(xs.weights, g.shape_vector([0, -1, g.dim(x, 3)])), [1])  # (R, 1, pw 2G', W)
    values = g.MatMul(sy, g.MatMul(xb, g.Transpose(sx, perm=[0, 1, 3, 2])))  # (R, C, ph 2G, pw 2G')
    split = g.shape_vector([0, 0, ph, -1, pw, xs.slots])
    values = g.Transpose(g.Reshape(values, split), perm=[0, 1, 2, 4, 3, 5])  # (R, C, ph, pw, 2G, 2G')
    real = g.Unsqueeze(g.And(g.Unsqueeze(ys.real, [2]), g.Unsqueeze(xs.real, [1])), [1, 2, 3])
    values = where(real, values, g.const(np.array(-np.inf), x.dtype))
    candidates = g.Reshape(values, [0, 0, 0, 0, -1])
    best = g.ArgMax(candidates, axis=4, keepdims=1)
    n_cand = g.Slice(g.Shape(candidates), [4], [5])
    chosen = g.Cast(g.Equal(best, _arange(g, n_cand)), to=x.dtype)
    # A region whose grid is empty (half_pixel and a degenerate box) outputs 0: no gradient.
    sampled = g.Cast(g.And(ys.grid > 0.0, xs.grid > 0.0), to=x.dtype)  # (R, 1)
    hot = chosen * g.Unsqueeze(dy * g.Unsqueeze(sampled, [2, 3]), [4])
    hot = g.Transpose(g.Reshape(hot, g.Shape(values)), perm=[0, 1, 2, 4, 3, 5])  # (R, C, ph, 2G, pw, 2G')
    hot = g.Reshape(
        hot, g.shape_vector([0, 0, -1, pw * xs.slots if isinstance(xs.slots, int) else xs.slots * pw])
    )
    return g.MatMul(g.MatMul(g.Transpose(sy, perm=[0, 1, 3, 2]), hot), sx)  # (R, C, H, W)


# ---- unpooling ---------------------------------------------------------------------------------
@rule("MaxUnpool")
def max_unpool(g: GradBuilder, n: NodeContext) -> Grads:
    """y = zeros with y.flat[I] = X (I flattened over the whole output, as MaxPool's Indices):
    dX = dy.flat[I]. An index repeated in I keeps the last write, so only that X element gets it."""
    if not n.needs[0]:
        return first_only(n, None)
    x, ind = n.inputs[0], n.inputs[1]
    assert x is not None and ind is not None
    flat_dy = g.Reshape(n.dy, [-1])
    dx = g.Gather(flat_dy, ind, shape=x.shape)
    value = n.const_input(1)
    if value is None or len(np.unique(value)) != value.size:
        order = positions(g, x)
        size = numel(g, n.y)
        size_v = g.const(np.array([size], dtype=np.int64)) if isinstance(size, int) else g.Reshape(size, [1])
        fill = helper.make_tensor("", TensorProto.INT64, [1], [-1])
        last = g.ScatterElements(
            g.ConstantOfShape(size_v, value=fill, dtype=INT64),
            g.Reshape(ind, [-1]),
            g.Reshape(order, [-1]),
            axis=0,
            reduction="max",
        )
        dx = where(g.Equal(g.Gather(last, ind, dtype=INT64), order), dx, 0.0)
    return first_only(n, dx)
