"""Convolution-like and region pooling layers: ConvTranspose, DeformConv, CausalConvWithState,
LpPool, GlobalLpPool, MaxRoiPool, RoiAlign.

ConvTranspose is the adjoint of Conv, so its gradients are the Conv rule read backwards: dX is a
``Conv`` of dY with the same kernel, dW the Conv rule's weight gradient with X and dY trading
places. LpPool spreads a per-window factor back over its windows with a ``ConvTranspose`` of ones,
like AveragePool. The region ops and DeformConv sample X at positions known only at run time; their
backward recomputes those positions and bilinear weights from the saved inputs and routes dY with
dense selection matrices (RoiAlign), gathers and scatters (DeformConv), or an argmax (MaxRoiPool).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from onnx import TensorProto

from ...errors import GradientNotImplementedError
from ..builder import GradBuilder, Var, sigmoid, where
from ..graph import Dim
from ..registry import NodeContext, rule
from .nn import (
    Window,
    _conv_weight_grad,
    _pool_rows,
    _spatial_dims,
    _spatial_rank,
    _static,
    _zeros,
    window_of,
)
from .norm import node_label

INT64 = TensorProto.INT64


def _kernel(n: NodeContext, w: Var | None, nsp: int) -> list[int] | None:
    """``kernel_shape``, else the static spatial dims of the weight."""
    kernel = n.attr("kernel_shape")
    if kernel:
        return [int(k) for k in kernel][-nsp:]
    if w is not None and w.shape is not None:
        return _static(list(w.shape[2:]))
    return None


def _int(g: GradBuilder, size: Var | int) -> Var | int:
    """A size from :meth:`GradBuilder.dim` as an int or a scalar int64 Var, for arithmetic."""
    return size if isinstance(size, int) else g.Squeeze(size, [0])


def _scalar(g: GradBuilder, size: Var | int, dtype: int) -> Var:
    """A size from :meth:`GradBuilder.dim` as a scalar of ``dtype``."""
    if isinstance(size, int):
        return g.const(np.array(size), dtype)
    return g.Cast(g.Squeeze(size, [0]), to=dtype)


# ---- ConvTranspose --------------------------------------------------------------------------
def transpose_window(n: NodeContext, nsp: int, kernel: list[int] | None, spatial: list[Dim]) -> Window:
    """The Conv geometry adjoint to a ConvTranspose node: dX = Conv(dY, W, this window).

    ConvTranspose writes X[i] W[k] to Y[i s + k d - pb]; the Conv with strides s, dilations d and
    begin pad pb reads back exactly those positions. pb comes from ``pads``, or from
    ``output_shape`` / SAME ``auto_pad`` (total = s (H - 1) + output_padding + extent - out, its
    odd one at the end for SAME_UPPER and at the beginning otherwise, as onnxruntime does). The end
    pad is pe - output_padding (rows only output_padding reached carry no X), at least 0: with
    output_padding < stride, as onnxruntime requires, the Conv then has exactly X's size.
    """
    strides = [int(s) for s in (n.attr("strides") or [1] * nsp)]
    dilations = [int(d) for d in (n.attr("dilations") or [1] * nsp)]
    out_pad = [int(p) for p in (n.attr("output_padding") or [0] * nsp)][-nsp:]
    auto_pad = n.attr("auto_pad", "NOTSET") or "NOTSET"
    output_shape = n.attr("output_shape")
    if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        static = _static(spatial)
        if kernel is None or (output_shape and static is None):
            raise GradientNotImplementedError(
                f"{node_label(n)}: output_shape or auto_pad={auto_pad} needs static kernel and input sizes"
            )
        begins, ends = [], []
        for i in range(nsp):
            extent = (kernel[i] - 1) * dilations[i] + 1
            if output_shape:
                out = int(output_shape[-nsp:][i])
                total = strides[i] * (static[i] - 1) + out_pad[i] + extent - out  # type: ignore[index]
            else:  # out = H s: the total does not depend on H
                total = out_pad[i] + extent - strides[i]
            total = max(total, 0)
            begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            begins.append(begin)
            ends.append(total - begin)
    elif auto_pad == "VALID":
        begins, ends = [0] * nsp, [0] * nsp
    else:
        pads = [int(p) for p in (n.attr("pads") or [0] * (2 * nsp))]
        begins, ends = pads[:nsp], pads[nsp:]
    ends = [max(e - p, 0) for e, p in zip(ends, out_pad)]
    return Window(tuple(strides), tuple(dilations), (*begins, *ends))


@rule("ConvTranspose")
def conv_transpose(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """Y = ConvTranspose(X, W) + B, the adjoint of Conv(., W).

    dX = Conv(dY, W) with the adjoint geometry (:func:`transpose_window`); dW is the Conv rule's
    weight gradient with the roles of X and dY exchanged (dY is the Conv input, X its output
    gradient); dB = dY summed over all axes but 1.
    """
    x, w = n.inputs[0], n.inputs[1]
    b = n.inputs[2] if len(n.inputs) > 2 else None
    assert x is not None and w is not None
    dy = n.dy
    nsp = _spatial_rank(n, w, x, n.y)
    kernel = _kernel(n, w, nsp)
    spatial = _spatial_dims(x, nsp)
    win = transpose_window(n, nsp, kernel, spatial)
    group = int(n.attr("group", 1))
    grads: list[Var | None] = [None] * len(n.inputs)
    if n.needs[0]:
        grads[0] = g.Conv(dy, w, group=group, **win.attrs(), shape=x.shape)
    if n.needs[1]:
        grads[1] = _conv_weight_grad(g, x, dy, w, win, group, kernel, _spatial_dims(dy, nsp))
    if b is not None and n.needs[2]:
        grads[2] = g.reduce_sum(dy, [0, *range(2, 2 + nsp)], keepdims=False)
    return grads


# ---- Lp pooling -----------------------------------------------------------------------------
def spread_windows(
    g: GradBuilder,
    v: Var,
    x: Var,
    kernel: list[int],
    win: Window,
    spatial: list[int],
    ceil: bool,
) -> Var:
    """t[i] = sum of v[w] over the pooling windows w that contain position i of x.

    One ``ConvTranspose`` of v with a ones kernel and the pooling geometry, channels folded into
    the batch so the kernel does not depend on C. ``output_padding`` reaches positions after the
    last window; a window that ceil mode let run past the padded input is cropped by a larger end
    pad. (AveragePool's rule in nn.py is this with v = dY / count.)
    """
    rows, ends, out_pad = [], [], []
    for i, h in enumerate(spatial):
        k, s, d = kernel[i], win.strides[i], win.dilations[i]
        pb, pe = win.begins[i], win.ends[i]
        o = _pool_rows(h, k, s, d, pb, pe, ceil)
        rows.append(o)
        extra = h - (s * (o - 1) + (k - 1) * d + 1 - pb - pe)
        ends.append(pe if extra >= 0 else pe - extra)
        out_pad.append(max(extra, 0))
    ones = g.const(np.ones((1, 1, *kernel)), x.dtype)
    ct = g.ConvTranspose(
        g.Reshape(v, [-1, 1, *rows]),
        ones,
        strides=list(win.strides),
        dilations=list(win.dilations),
        pads=[*win.begins, *ends],
        output_padding=out_pad if any(out_pad) else None,
    )
    return g.Reshape(ct, g.shape_of(x), shape=x.shape)


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
def lp_pool(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = (sum over the window of |x|^p)^(1/p): dx = sign(x) |x|^(p-1) * spread(dy y^(1-p)).

    Padding adds zeros, which add nothing; ``spread`` sums over the windows holding each element
    (:func:`spread_windows`). Needs static spatial sizes.
    """
    if not n.needs[0]:
        return [None]
    x = n.x
    nsp = _spatial_rank(n, x, n.y)
    kernel = [int(k) for k in n.attr("kernel_shape")]
    static = _static(_spatial_dims(x, nsp))
    if static is None:
        raise GradientNotImplementedError(f"{node_label(n)}: LpPool needs static spatial sizes")
    win = window_of(n, nsp, kernel, list(static))
    per_window, per_element = _lp_factors(g, x, n.y, n.dy, _lp_p(n))
    spread = spread_windows(g, per_window, x, kernel, win, list(static), bool(n.attr("ceil_mode", 0)))
    return [spread * per_element]


@rule("GlobalLpPool")
def global_lp_pool(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = (sum over the spatial dims of |x|^p)^(1/p): dx = dy y^(1-p) sign(x) |x|^(p-1)."""
    if not n.needs[0]:
        return [None]
    per_window, per_element = _lp_factors(g, n.x, n.y, n.dy, _lp_p(n))
    return [per_window * per_element]


# ---- region pooling: shared pieces ----------------------------------------------------------
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
def max_roi_pool(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y[r, c, i, j] = max of X[b_r, c] over bin (i, j) of region r: dX gets dy at that argmax.

    The bins are recomputed as onnxruntime computes them (corners rounded half away from zero,
    bin edges floor / ceil of float32 multiples of the bin size, clipped to X). The argmax is found
    in two steps that keep memory at R C H W (pw + ph) rather than R C H W ph pw: the first maximum
    along each row of a bin, then the first row holding the bin's maximum. dy is scatter-added
    there; empty bins (output 0) pass nothing. Regions get no gradient: their corners are rounded.
    """
    grads: list[Var | None] = [None, None]
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
        _zeros(g, total, x.dtype), g.Reshape(index, [-1]), g.Reshape(update, [-1]), axis=0, reduction="add"
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
def roi_align(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """Y[r, c, i, j] = pooled bilinear samples of X[b_r, c] over bin (i, j) of region r.

    Sampling is separable: with S_y (R, ph, 2G, H) and S_x (R, pw, 2G', W) the weights of the
    sample corners (:func:`_roi_align_axis`), avg mode is Y = P_y X P_x^T / count per region
    (P = S summed over its samples), so dX = P_y^T (dY / count) P_x. Max mode (onnxruntime's and
    onnx.reference's: the maximum over samples and their four corners of weight * X) routes dY
    to the argmax corner, times its weight. Per-region gradients reach their images through a
    one-hot MatMul. Regions and batch indices get no gradient, as in torchvision's roi_align
    (ONNX leaves their differentiability unspecified; the grid size jumps with them anyway).
    """
    grads: list[Var | None] = [None] * len(n.inputs)
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


# ---- DeformConv -----------------------------------------------------------------------------
@rule("DeformConv", since=19)
def deform_conv(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """Y[n, m, o] = sum_{c, k} W[m, c, k] mask[n, k, o] X[n, c](p_k(o)) + B[m], X(p) bilinear.

    p_k(o) = o s - pad + k d + offset[n, k, o] (per offset group), and X(p) sums, over the 2^D
    corners q of the cell around p, X[q] times the product of (1 - |p - q|) per axis, corners
    outside X counting 0. The backward recomputes the samples (one GatherND per corner set) and
    takes the convolution as a matrix product per group: cols = mask * samples; dW = dY cols^T;
    dcols = W^T dY; dmask = sum over the channels of dcols * samples; dX scatter-adds dcols * mask
    * weight at each corner (ScatterND); doffset along axis a = sum over corners of +-1 (the
    slope of that axis' weight) * the other axes' weights * X[q] * dcols * mask.
    """
    x, w, offset = n.inputs[0], n.inputs[1], n.inputs[2]
    b = n.inputs[3] if len(n.inputs) > 3 else None
    mask = n.inputs[4] if len(n.inputs) > 4 else None
    assert x is not None and w is not None and offset is not None
    nsp = _spatial_rank(n, w, x, n.y)
    kernel = _kernel(n, w, nsp)
    size = _static(_spatial_dims(x, nsp))
    out = _static(_spatial_dims(n.y, nsp))
    if kernel is None or size is None or out is None or w.static_shape is None:
        raise GradientNotImplementedError(
            f"{node_label(n)}: DeformConv needs static spatial sizes of X and Y and a static weight shape"
        )
    group, og = int(n.attr("group", 1)), int(n.attr("offset_group", 1))
    strides = [int(s) for s in (n.attr("strides") or [1] * nsp)]
    dilations = [int(d) for d in (n.attr("dilations") or [1] * nsp)]
    pads = [int(p) for p in (n.attr("pads") or [0] * (2 * nsp))]
    m_out, c_grp = w.static_shape[0], w.static_shape[1]
    channels = c_grp * group
    kk, oo = math.prod(kernel), math.prod(out)
    dtype = x.dtype
    grads: list[Var | None] = [None] * len(n.inputs)

    off = g.Reshape(offset, [0, og, kk, nsp, oo])
    weight, index, slopes = _deform_corners(g, off, kernel, out, size, strides, dilations, pads, og)
    nc = 2**nsp
    # X as (N, og, H W..., C / og): one gather per (image, offset group) batch.
    cg = channels // og
    xt = g.Transpose(g.Reshape(x, [0, og, cg, -1]), perm=[0, 1, 3, 2])
    values = g.Reshape(g.GatherND(xt, index, batch_dims=2), [0, og, kk * oo, nc, cg])
    samples = g.Squeeze(g.MatMul(g.Unsqueeze(weight, [3]), values), [3])  # (N, og, K O, cg)
    samples = g.Transpose(samples, perm=[0, 1, 3, 2])  # (N, og, cg, K O)
    mask_r = None if mask is None else g.Reshape(mask, [0, og, 1, kk * oo])
    cols = samples if mask_r is None else samples * mask_r
    cols_g = g.Reshape(cols, [0, group, c_grp * kk, oo])
    dy_g = g.Reshape(n.dy, [0, group, m_out // group, oo])
    w_g = g.Reshape(w, [group, m_out // group, c_grp * kk])
    if n.needs[1]:
        dw = g.ReduceSum(g.MatMul(dy_g, g.Transpose(cols_g, perm=[0, 1, 3, 2])), [0], keepdims=0)
        grads[1] = g.Reshape(dw, g.shape_of(w), shape=w.shape)
    if b is not None and n.needs[3]:
        grads[3] = g.reduce_sum(n.dy, [0, *range(2, 2 + nsp)], keepdims=False)
    if not (n.needs[0] or n.needs[2] or (mask is not None and n.needs[4])):
        return grads
    dcols = g.Reshape(g.MatMul(g.Transpose(w_g, perm=[0, 2, 1]), dy_g), [0, og, cg, kk * oo])
    if mask is not None and n.needs[4]:
        dmask = g.ReduceSum(dcols * samples, [2], keepdims=0)  # (N, og, K O)
        grads[4] = g.Reshape(dmask, g.shape_of(mask), shape=mask.shape)
    dsamples = g.Transpose(dcols if mask_r is None else dcols * mask_r, perm=[0, 1, 3, 2])  # (N, og, K O, cg)
    if n.needs[0]:
        updates = g.Reshape(g.Unsqueeze(weight, [4]) * g.Unsqueeze(dsamples, [3]), [0, og, -1, cg])
        full = _batch_index(g, index, og)
        dxt = g.ScatterND(_zeros(g, g.Shape(xt), dtype), full, updates, reduction="add")
        grads[0] = g.Reshape(g.Transpose(dxt, perm=[0, 1, 3, 2]), g.shape_of(x), shape=x.shape)
    if n.needs[2]:
        # q[n, g, j, corner] = sum over channels of X[corner] * dsamples
        q = g.Squeeze(g.MatMul(values, g.Unsqueeze(dsamples, [4])), [4])  # (N, og, K O, nc)
        per_axis = [g.ReduceSum(q * slope, [3], keepdims=1) for slope in slopes]
        d_off = g.Concat(*per_axis, axis=3)  # (N, og, K O, nsp)
        d_off = g.Transpose(g.Reshape(d_off, [0, og, kk, oo, nsp]), perm=[0, 1, 2, 4, 3])
        grads[2] = g.Reshape(d_off, g.shape_of(offset), shape=offset.shape)
    return grads


def _deform_corners(
    g: GradBuilder,
    off: Var,
    kernel: list[int],
    out: list[int],
    size: list[int],
    strides: list[int],
    dilations: list[int],
    pads: list[int],
    og: int,
) -> tuple[Var, Var, list[Var]]:
    """Bilinear sampling of DeformConv at p = o s - pad + k d + offset, over the 2^D cell corners.

    ``off`` is the offset as (N, og, K, D, O). Returns the weight of each corner (N, og, K O, 2^D),
    its flat position in X's spatial plane as GatherND indices (N, og, K O 2^D, 1), clamped into X
    (a corner outside weighs 0), and per axis a the derivative of each weight along p_a.
    """
    nsp, kk, oo = len(kernel), math.prod(kernel), math.prod(out)
    dtype = off.dtype
    grid = np.meshgrid(*[np.arange(k) for k in kernel], *[np.arange(o) for o in out], indexing="ij")
    per_axis = []  # per axis, for the lower and the upper corner: (weight, inside, index)
    for a in range(nsp):
        base = (grid[a] * dilations[a] + grid[nsp + a] * strides[a] - pads[a]).reshape(kk * oo)
        pos = g.Reshape(g.Gather(off, [a], axis=3), [0, og, kk * oo]) + g.const(base, dtype)
        low = g.Floor(pos)
        frac = pos - low
        ends = []
        for c in (0, 1):
            idx = low + float(c)
            inside = g.Cast(g.And(idx >= 0.0, idx <= float(size[a] - 1)), to=dtype)
            clamped = g.Min(g.Max(idx, g.const(np.array(0.0), dtype)), float(size[a] - 1))
            ends.append(((frac if c else 1.0 - frac) * inside, inside, g.Cast(clamped, to=INT64)))
        per_axis.append(ends)
    plane = [math.prod(size[a + 1 :]) for a in range(nsp)]
    weights: list[Var] = []
    flat: list[Var] = []
    slopes: list[list[Var]] = [[] for _ in range(nsp)]
    for corner in itertools.product((0, 1), repeat=nsp):
        parts = [per_axis[a][c] for a, c in enumerate(corner)]
        weights.append(_product([p[0] for p in parts]))
        flat.append(_sum([p[2] * plane[a] if plane[a] != 1 else p[2] for a, p in enumerate(parts)]))
        for a, c in enumerate(corner):  # d weight / d p_a: +-1 inside X, times the other axes' weights
            slope = parts[a][1] if c else -parts[a][1]
            others = [parts[e][0] for e in range(nsp) if e != a]
            slopes[a].append(_product([slope, *others]))

    def stack(vs: list[Var]) -> Var:  # 2^D x (N, og, K O) -> (N, og, K O, 2^D)
        return g.Concat(*[g.Unsqueeze(v, [3]) for v in vs], axis=3)

    index = g.Unsqueeze(g.Reshape(stack(flat), [0, 0, -1]), [3])
    return stack(weights), index, [stack(s) for s in slopes]


def _sum(vs: list[Var]) -> Var:
    out = vs[0]
    for v in vs[1:]:
        out = out + v
    return out


def _product(vs: list[Var]) -> Var:
    out = vs[0]
    for v in vs[1:]:
        out = out * v
    return out


def _batch_index(g: GradBuilder, index: Var, og: int) -> Var:
    """(N, og, L, 1) positions -> (N, og, L, 3) ScatterND indices (image, offset group, position)."""
    shape = g.Shape(index)
    images = g.Range(g.const(np.array(0)), g.Gather(shape, g.const(np.array(0))), g.const(np.array(1)))
    images = g.Expand(g.Reshape(images, [-1, 1, 1, 1]), shape)
    groups = g.Expand(g.const(np.arange(og).reshape(1, og, 1, 1)), shape)
    return g.Concat(images, groups, index, axis=3)


# ---- CausalConvWithState --------------------------------------------------------------------
_END = np.iinfo(np.int64).max


@rule("CausalConvWithState", since=27)
def causal_conv_with_state(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """y = act(z), z[b, c, t] = sum_j w[c, 0, j] p[b, c, t + j] + bias[c], p = concat(past_state
    (zeros when absent), x) along time; present_state = the last k - 1 positions of p.

    With the k taps p_j = p[.., j : j + L]: dz = dy act'(z) (SiLU: s (1 + z (1 - s)), s the sigmoid
    of z, recomputed), dw[c, 0, j] = sum dz p_j, dbias = sum dz, dp = sum_j dz w_j placed at j (plus
    the gradient of present_state on the last k - 1 positions); dx and d past_state are the two
    parts of dp. The kernel size k must be static.
    """
    x, w = n.inputs[0], n.inputs[1]
    assert x is not None and w is not None
    bias = n.inputs[2] if len(n.inputs) > 2 else None
    past = n.inputs[3] if len(n.inputs) > 3 else None
    grads: list[Var | None] = [None] * len(n.inputs)
    k = w.shape[-1] if w.shape is not None and len(w.shape) == 3 else None
    if not isinstance(k, int):
        raise GradientNotImplementedError(f"{node_label(n)}: the kernel size (weight dim 2) must be static")
    act = str(n.attr("activation", "none")).lower()
    if act not in ("none", "silu", "swish"):
        raise GradientNotImplementedError(f"{node_label(n)}: unknown activation {act!r}")
    dy = n.dout[0]
    d_present = n.dout[1] if len(n.dout) > 1 else None
    if past is not None:
        padded = g.Concat(past, x, axis=2)
    else:
        lead = g.Slice(g.shape_of(x), [0], [2])
        zeros = _zeros(g, g.Concat(lead, g.const(np.array([k - 1], dtype=np.int64)), axis=0), x.dtype)
        padded = g.Concat(zeros, x, axis=2)
    taps = [g.Slice(padded, [j], [j - (k - 1) if j < k - 1 else _END], [2]) for j in range(k)]
    w_taps = [g.Squeeze(g.Slice(w, [j], [j + 1], [2]), [2]) for j in range(k)]  # (C, 1) each
    dp = None
    if dy is not None:
        dz = dy
        if act != "none":
            z = _sum([wj * pj for wj, pj in zip(w_taps, taps)])
            if bias is not None:
                z = z + g.Unsqueeze(bias, [1])
            sg = sigmoid(z)
            dz = dy * sg * (z * (1.0 - sg) + 1.0)
        if bias is not None and n.needs[2]:
            grads[2] = g.reduce_sum(dz, [0, 2], keepdims=False)
        if n.needs[1]:
            per_tap = [g.Unsqueeze(g.reduce_sum(dz * pj, [0, 2], keepdims=False), [1]) for pj in taps]
            grads[1] = g.Unsqueeze(g.Concat(*per_tap, axis=1) if k > 1 else per_tap[0], [1], shape=w.shape)
        if n.needs[0] or (past is not None and n.needs[3]):
            dp = _sum([g.Pad(dz * wj, [0, 0, j, 0, 0, k - 1 - j]) for j, wj in enumerate(w_taps)])
    if d_present is not None and (n.needs[0] or (past is not None and n.needs[3])):
        tail = g.Concat(g.zeros_like(x), d_present, axis=2)
        dp = tail if dp is None else dp + tail
    if dp is not None:
        if n.needs[0]:
            grads[0] = g.Slice(dp, [k - 1], [_END], [2], shape=x.shape)
        if past is not None and n.needs[3]:
            grads[3] = g.Slice(dp, [0], [k - 1], [2], shape=past.shape)
    return grads
