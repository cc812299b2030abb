"""Neural-network layers: Conv, pooling, LayerNormalization, BatchNormalization, Dropout.

Convolution gradients are convolutions again: dX is a ``ConvTranspose`` of dY with the same
kernel, dW a ``Conv`` of X with dY as the kernel (batch and channels swapped, strides and dilations
swapped).
Pooling reuses what the forward knows: MaxPool's own ``Indices`` output routes dY back with one
MaxUnpool (windows that do not overlap) or scatter-add; AveragePool is a ``ConvTranspose`` with a
ones kernel. LayerNormalization reads the mean and inverse standard deviation its forward node
computes anyway; its backward, and that of BatchNormalization in training mode, is the one of every
normalization (``norm.py``). Dropout in training mode reads the mask its forward node draws.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import reduce
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from ...errors import GradientNotImplementedError
from ..builder import GradBuilder, Var, cast, where
from ..graph import Dim, np_dtype
from ..registry import NodeContext, rule
from .norm import mean_over, node_label, norm_axes, normalize_backward, normalized_count, standardize
from .reduce import max_grad

_END = np.iinfo(np.int64).max  # Slice end meaning "to the end"


# ---- shapes ---------------------------------------------------------------------------------
def _spatial_rank(n: NodeContext, *values: Var | None) -> int:
    """Number of spatial dims: from ``kernel_shape``, else from the rank of any known value."""
    kernel = n.attr("kernel_shape")
    if kernel:
        return len(kernel)
    for v in values:
        if v is not None and v.rank is not None:
            return v.rank - 2
    raise GradientNotImplementedError(f"{node_label(n)}: the rank of its input must be known")


def _spatial_dims(x: Var, nsp: int) -> list[Dim]:
    return list(x.shape[2:]) if x.shape is not None else [None] * nsp


def _static(dims: list[Dim]) -> list[int] | None:
    return [int(d) for d in dims] if all(isinstance(d, int) for d in dims) else None  # type: ignore[arg-type]


def _spatial_items(g: GradBuilder, x: Var, nsp: int) -> list[int | Var]:
    """X's spatial dims: ints when static, else one 1-D slice of its run-time shape."""
    static = _static(_spatial_dims(x, nsp))
    if static is not None:
        return list(static)
    return [g.Slice(g.shape_of(x), [2], [2 + nsp])]


def _zeros(g: GradBuilder, shape: Var, dtype: int) -> Var:
    value = helper.make_tensor("", dtype, [1], np.zeros(1, dtype=np_dtype(dtype)).tolist())
    return g.op("ConstantOfShape", shape, value=value, dtype=dtype)


def _perm_swap01(nsp: int) -> list[int]:
    return [1, 0, *range(2, 2 + nsp)]


# ---- sliding windows ------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """Geometry of a convolution or pooling window, with ``auto_pad`` resolved to explicit pads."""

    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]  # all begins, then all ends (ONNX order)

    @property
    def begins(self) -> tuple[int, ...]:
        return self.pads[: len(self.strides)]

    @property
    def ends(self) -> tuple[int, ...]:
        return self.pads[len(self.strides) :]

    def extent(self, i: int, k: int) -> int:
        """Span of a dilated kernel of size ``k`` along spatial dim ``i``."""
        return (k - 1) * self.dilations[i] + 1

    def attrs(self) -> dict[str, Any]:
        return {"strides": list(self.strides), "dilations": list(self.dilations), "pads": list(self.pads)}


def window_of(n: NodeContext, nsp: int, kernel: list[int] | None, spatial: list[Dim]) -> Window:
    """Strides, dilations and pads of ``n``; SAME_* pads are computed from static sizes.

    SAME pads total ``max((ceil(H / s) - 1) s + extent - H, 0)``, split with the extra one at the
    end (SAME_UPPER) or the beginning (SAME_LOWER); with stride 1 that is ``extent - 1`` whatever H.
    """
    strides = tuple(int(s) for s in (n.attr("strides") or [1] * nsp))
    dilations = tuple(int(d) for d in (n.attr("dilations") or [1] * nsp))
    auto_pad = n.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad == "VALID":
        return Window(strides, dilations, (0,) * (2 * nsp))
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        pads = n.attr("pads") or [0] * (2 * nsp)
        return Window(strides, dilations, tuple(int(p) for p in pads))
    begins, ends = [], []
    for i in range(nsp):
        h = spatial[i]
        if kernel is None or (strides[i] != 1 and not isinstance(h, int)):
            raise GradientNotImplementedError(
                f"{node_label(n)}: auto_pad={auto_pad} needs static kernel and spatial sizes"
            )
        extent = (kernel[i] - 1) * dilations[i] + 1
        if strides[i] == 1:
            total = extent - 1
        else:
            out = -(-int(h) // strides[i])  # type: ignore[arg-type]
            total = max((out - 1) * strides[i] + extent - int(h), 0)  # type: ignore[arg-type]
        small = total // 2
        begin = small if auto_pad == "SAME_UPPER" else total - small
        begins.append(begin)
        ends.append(total - begin)
    return Window(strides, dilations, (*begins, *ends))


# ---- Conv -----------------------------------------------------------------------------------
@rule("Conv")
def conv(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """Y = X * W + B (cross-correlation, grouped).

    dX = ConvTranspose(dY, W) with the same geometry; dW = Conv(X', dY') where X' puts the
    channels of a group in the batch slot and (group, batch) in the channel slot, dY' is dY with
    batch and channels swapped, and strides and dilations trade places; dB = dY summed over all
    axes but 1.
    """
    x, w = n.inputs[0], n.inputs[1]
    b = n.inputs[2] if len(n.inputs) > 2 else None
    assert x is not None and w is not None
    nsp = _spatial_rank(n, w, x, n.y)
    kernel = n.attr("kernel_shape") or (_static(list(w.shape[2:])) if w.shape is not None else None)
    kernel = [int(k) for k in kernel] if kernel else None
    spatial = _spatial_dims(x, nsp)
    win = window_of(n, nsp, kernel, spatial)
    group = int(n.attr("group", 1))
    grads: list[Var | None] = [None] * len(n.inputs)
    if n.needs[0]:
        grads[0] = _conv_input_grad(g, n.dy, w, x, win, group, kernel, spatial)
    if n.needs[1]:
        grads[1] = _conv_weight_grad(g, n.dy, x, w, win, group, kernel, spatial)
    if b is not None and n.needs[2]:
        grads[2] = g.reduce_sum(n.dy, [0, *range(2, 2 + nsp)], keepdims=False)
    return grads


def _conv_input_grad(
    g: GradBuilder,
    dy: Var,
    w: Var,
    x: Var,
    win: Window,
    group: int,
    kernel: list[int] | None,
    spatial: list[Dim],
) -> Var:
    """ConvTranspose(dy, w) with the geometry of the forward, sized like ``x``.

    Input rows past the last window get no gradient: with static sizes ``output_padding`` adds
    them, else a ``Pad`` to the run-time size of x.
    """
    static = _static(spatial)
    attrs = win.attrs()
    if static is not None and kernel is not None:
        out_pad = []
        for i, h in enumerate(static):
            extent = win.extent(i, kernel[i])
            rows = (h + win.begins[i] + win.ends[i] - extent) // win.strides[i] + 1
            out_pad.append(h - (win.strides[i] * (rows - 1) + extent - win.begins[i] - win.ends[i]))
        return g.ConvTranspose(
            dy, w, group=group, output_padding=out_pad if any(out_pad) else None, shape=x.shape, **attrs
        )
    ct = g.ConvTranspose(dy, w, group=group, **attrs)
    nsp = len(win.strides)
    missing = g.Sub(g.Slice(g.shape_of(x), [2], [_END]), g.Slice(g.Shape(ct), [2], [_END]))
    pads = g.Concat(g.const(np.zeros(nsp, dtype=np.int64)), missing, axis=0)
    return g.Pad(ct, pads, None, list(range(2, 2 + nsp)), shape=x.shape)


def _conv_weight_grad(
    g: GradBuilder,
    dy: Var,
    x: Var,
    w: Var,
    win: Window,
    group: int,
    kernel: list[int] | None,
    spatial: list[Dim],
) -> Var:
    """dW[m, c, k] = sum_{n, o} dY[n, m, o] X[n, group(m) Cg + c, o s + k d - pad], as one Conv."""
    nsp = len(win.strides)
    swap = _perm_swap01(nsp)
    if group == 1:
        xr = g.Transpose(x, perm=swap)  # (C, N, H...)
    else:
        # (N, G Cg, H...) -> (N, G, Cg, H...) -> (Cg, G, N, H...) -> (Cg, G N, H...): a grouped
        # Conv then pairs output channel m only with the batch copies of its own group.
        sp = _spatial_items(g, x, nsp)
        x5 = g.Reshape(x, g.shape_vector([0, group, -1, *sp]))
        xt = g.Transpose(x5, perm=[2, 1, 0, *range(3, 3 + nsp)])
        xr = g.Reshape(xt, g.shape_vector([0, -1, *sp]))
    dyr = g.Transpose(dy, perm=swap)  # (M, N, Ho...): the kernel
    r = g.Conv(
        xr, dyr, strides=list(win.dilations), dilations=list(win.strides), pads=list(win.pads), group=group
    )  # (Cg, M, K'...) with K' >= kernel
    static = _static(spatial)
    exact = False
    if static is not None and kernel is not None:
        # K' = floor((H + pads - ((Ho - 1) s + 1)) / d) + 1 may exceed K by a few rows.
        exact = True
        for i, h in enumerate(static):
            padded = h + win.begins[i] + win.ends[i]
            rows = (padded - win.extent(i, kernel[i])) // win.strides[i] + 1
            span = (rows - 1) * win.strides[i] + 1
            exact = exact and (padded - span) // win.dilations[i] + 1 == kernel[i]
    if not exact:
        ends = (
            g.const(np.array(kernel, dtype=np.int64))
            if kernel is not None
            else g.Slice(g.shape_of(w), [2], [2 + nsp])
        )
        r = g.Slice(r, g.const(np.zeros(nsp, dtype=np.int64)), ends, list(range(2, 2 + nsp)))
    return g.Transpose(r, perm=swap, shape=w.shape)


# ---- pooling --------------------------------------------------------------------------------
@rule("MaxPool")
def max_pool(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """dX = scatter-add of dY at the argmax of each window (a MaxUnpool when windows do not overlap).

    The forward node's ``Indices`` output (added to it when the model does not use it) holds those
    positions, flattened over the whole NCHW tensor by onnxruntime and onnx.reference alike, with
    padding not counted; ``storage_order=1`` numbers each plane column-major instead.
    """
    if not n.needs[0]:
        return [None]
    if n.opset < 8:
        raise GradientNotImplementedError(
            f"{node_label(n)}: MaxPool before opset 8 has no Indices output to route the gradient"
        )
    x, dy = n.x, n.dy
    nsp = _spatial_rank(n, x, n.y)
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
        _zeros(g, size, x.dtype), g.Reshape(idx, [-1]), g.Reshape(dy, [-1]), axis=0, reduction="add"
    )
    return [g.Reshape(flat, g.shape_of(x), shape=x.shape)]


def _disjoint_windows(n: NodeContext, x: Var, nsp: int) -> bool:
    """Whether the windows of a MaxPool do not overlap and Y is no larger than X along any axis
    (what MaxUnpool with one-element windows requires of the shape it writes into)."""
    kernel = [int(k) for k in n.attr("kernel_shape")]
    strides = [int(s) for s in (n.attr("strides") or [1] * nsp)]
    dilations = [int(d) for d in (n.attr("dilations") or [1] * nsp)]
    if any(s < (k - 1) * d + 1 for k, s, d in zip(kernel, strides, dilations)):
        return False
    xs = _static(_spatial_dims(x, nsp))
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
    static = _static(_spatial_dims(x, nsp))
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


@rule("AveragePool")
def average_pool(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """dX = ConvTranspose(dY / count, ones kernel): a window spreads dY / count over its elements.

    count is the number of elements of a window inside X (``count_include_pad=0``) or inside the
    padded X (``=1``), per output position, from static sizes. Channels go to the batch slot so
    the ones kernel does not depend on C.
    """
    if not n.needs[0]:
        return [None]
    x, dy = n.x, n.dy
    nsp = _spatial_rank(n, x, n.y)
    kernel = [int(k) for k in n.attr("kernel_shape")]
    static = _static(_spatial_dims(x, nsp))
    if static is None:
        raise GradientNotImplementedError(f"{node_label(n)}: AveragePool needs static spatial sizes")
    win = window_of(n, nsp, kernel, list(static))
    ceil = bool(n.attr("ceil_mode", 0))
    include_pad = bool(n.attr("count_include_pad", 0))
    rows, counts, ends, out_pad = [], [], [], []
    for i, h in enumerate(static):
        k, s, d = kernel[i], win.strides[i], win.dilations[i]
        pb, pe = win.begins[i], win.ends[i]
        o = _pool_rows(h, k, s, d, pb, pe, ceil)
        lo, hi = (-pb, h + pe) if include_pad else (0, h)
        starts = np.arange(o)[:, None] * s - pb + np.arange(k)[None, :] * d
        counts.append(((starts >= lo) & (starts < hi)).sum(axis=1))
        rows.append(o)
        # ConvTranspose yields s (o - 1) + extent - pb - pe rows: pad up to h, or crop a window
        # that ceil mode let run past the padded input.
        extra = h - (s * (o - 1) + (k - 1) * d + 1 - pb - pe)
        ends.append(pe if extra >= 0 else pe - extra)
        out_pad.append(max(extra, 0))
    inv_count = 1.0 / reduce(np.multiply.outer, counts).astype(np.float64)
    scaled = g.Reshape(dy * g.const(inv_count, x.dtype), [-1, 1, *rows])
    ones = g.const(np.ones((1, 1, *kernel)), x.dtype)
    ct = g.ConvTranspose(
        scaled,
        ones,
        strides=list(win.strides),
        dilations=list(win.dilations),
        pads=[*win.begins, *ends],
        output_padding=out_pad if any(out_pad) else None,
    )
    return [g.Reshape(ct, g.shape_of(x), shape=x.shape)]


def _global_count(g: GradBuilder, x: Var, dy: Var) -> Var:
    """Number of spatial positions of x (a constant when static)."""
    static = _static(list(x.shape[2:])) if x.shape is not None else None
    if static is not None:
        return g.const(float(math.prod(static)), x.dtype)
    size_x = g.ReduceProd(g.shape_of(x), keepdims=0)
    return g.Cast(g.Div(size_x, g.Size(dy)), to=x.dtype)


@rule("GlobalAveragePool")
def global_average_pool(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """dX = dY / (H W ...), broadcast over the spatial dims."""
    if not n.needs[0]:
        return [None]
    x, dy = n.x, n.dy
    return [g.Expand(dy / _global_count(g, x, dy), g.shape_of(x), shape=x.shape)]


@rule("GlobalMaxPool")
def global_max_pool(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """dX = dY * [x == y] / #ties over each plane."""
    if not n.needs[0]:
        return [None]
    x = n.x
    if x.rank is None:
        raise GradientNotImplementedError(f"{node_label(n)}: the rank of its input must be known")
    axes = list(range(2, x.rank))
    return [max_grad(g, x, n.y, n.dy, lambda m: g.reduce_sum(m, axes, keepdims=True))]


# ---- normalization (the shared math lives in norm.py) ---------------------------------------
@rule("LayerNormalization", since=17)
def layer_norm(g: GradBuilder, n: NodeContext) -> list[Var | None]:
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
    grads: list[Var | None] = [None] * len(n.inputs)
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
def batch_norm(g: GradBuilder, n: NodeContext) -> list[Var | None]:
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
    grads: list[Var | None] = [None] * len(n.inputs)
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
    d_stats: list[Var | None],
    grads: list[Var | None],
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


# ---- Dropout --------------------------------------------------------------------------------
def _dropout_training(n: NodeContext) -> bool | Var:
    """Whether a Dropout node trains: a bool when known while building, else its run-time flag."""
    if n.opset < 7:
        return not n.attr("is_test", 0)
    if n.opset < 12 or len(n.node.input) < 3 or not n.node.input[2]:
        return False  # opset 7-11 Dropout is the identity at inference; no flag means inference
    flag = n.const_input(2)
    if flag is None:
        return n.inputs[2]  # type: ignore[return-value]
    return bool(np.asarray(flag).reshape(-1)[0])


@rule("Dropout")
def dropout(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """Inference: dx = dy. Training: y = x mask / (1 - ratio), so dx = dy mask / (1 - ratio).

    The mask is the forward node's own Mask output (added to it when the model does not use it):
    the backward drops exactly what the forward dropped. With ``training_mode`` or ``ratio`` known
    only at run time, the scale is computed from them (1 when not training: the mask is then all
    true); ``where`` keeps dropped positions exactly 0.
    """
    grads: list[Var | None] = [None] * len(n.inputs)
    if not n.needs[0]:
        return grads
    training = _dropout_training(n)
    if training is False:
        grads[0] = n.dy
        return grads
    if n.opset < 12:
        raise GradientNotImplementedError(
            f"{node_label(n)}: Dropout before opset 7 in training mode (is_test=0) is not supported; "
            "convert the model to opset 12 or later (Dropout with a training_mode input)"
        )
    x, dy = n.x, n.dy
    mask = g.extra_output(n.node, 1, TensorProto.BOOL, x.shape)
    ratio_var = n.inputs[1] if len(n.inputs) > 1 else None
    ratio = n.const_input(1)
    scale: Var | float
    if ratio_var is not None and ratio is None:  # ratio computed at run time
        scale = g.Reciprocal(1.0 - cast(ratio_var, x))
    else:
        r = 0.5 if ratio is None else float(np.asarray(ratio).reshape(-1)[0])
        scale = 1.0 / (1.0 - r) if r < 1.0 else 0.0  # ratio 1 drops everything (the mask is all false)
    if isinstance(training, Var):  # not training: y = x and the mask is all true, so no scaling
        scale = where(training, g.const(scale, x.dtype) if isinstance(scale, float) else scale, 1.0)
    scaled = dy if isinstance(scale, float) and scale == 1.0 else dy * scale
    grads[0] = where(mask, scaled, 0)
    return grads
