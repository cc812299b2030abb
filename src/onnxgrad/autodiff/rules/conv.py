"""Convolutions: Conv, ConvTranspose, DeformConv and CausalConvWithState.

Convolution gradients are convolutions again: dX is a ``ConvTranspose`` of dY with the same
kernel, dW a ``Conv`` of X with dY as the kernel (batch and channels swapped, strides and dilations
swapped). ConvTranspose is the adjoint of Conv, so its gradients are the Conv rule read backwards:
dX is a ``Conv`` of dY with the same kernel, dW the Conv rule's weight gradient with X and dY
trading places. DeformConv samples X at positions known only at run time: its backward recomputes
those positions and bilinear weights from the saved inputs and routes dY with gathers and scatters.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from onnx import TensorProto

from ...errors import GradientNotImplementedError
from ...model.graph import Dim
from ..builder import INT64, GradBuilder, Var, sigmoid
from ..registry import NodeContext, rule
from .common import (
    Grads,
    Window,
    fit_spatial,
    node_label,
    pad_at_run_time,
    run_time_same_pads,
    same_pads_at_run_time,
    spatial_dims,
    spatial_rank,
    static_dims,
    unpad_at_run_time,
    window_of,
    zeros,
)

_END = np.iinfo(np.int64).max  # Slice end meaning "to the end"


# ---- shapes ---------------------------------------------------------------------------------
def _spatial_items(g: GradBuilder, x: Var, nsp: int) -> list[int | Var]:
    """X's spatial dims: ints when static, else one 1-D slice of its run-time shape."""
    static = static_dims(spatial_dims(x, nsp))
    if static is not None:
        return list(static)
    return [g.Slice(g.shape_of(x), [2], [2 + nsp])]


def _perm_swap01(nsp: int) -> list[int]:
    return [1, 0, *range(2, 2 + nsp)]


def _kernel(n: NodeContext, w: Var | None, nsp: int) -> list[int] | None:
    """``kernel_shape``, else the static spatial dims of the weight."""
    kernel = n.attr("kernel_shape")
    if kernel:
        return [int(k) for k in kernel][-nsp:]
    if w is not None and w.shape is not None:
        return static_dims(list(w.shape[2:]))
    return None


# ---- Conv -----------------------------------------------------------------------------------
@rule("Conv")
def conv(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = X * W + B (cross-correlation, grouped).

    dX = ConvTranspose(dY, W) with the same geometry; dW = Conv(X', dY') where X' puts the
    channels of a group in the batch slot and (group, batch) in the channel slot, dY' is dY with
    batch and channels swapped, and strides and dilations trade places; dB = dY summed over all
    axes but 1.
    """
    x, w = n.inputs[0], n.inputs[1]
    b = n.inputs[2] if len(n.inputs) > 2 else None
    assert x is not None and w is not None
    nsp = spatial_rank(n, w, x, n.y)
    kernel = n.attr("kernel_shape") or (static_dims(list(w.shape[2:])) if w.shape is not None else None)
    kernel = [int(k) for k in kernel] if kernel else None
    spatial = spatial_dims(x, nsp)
    group = int(n.attr("group", 1))
    grads: Grads = [None] * len(n.inputs)
    source, begins = x, None
    if same_pads_at_run_time(n, kernel, spatial):
        # SAME pads that depend on run-time sizes: the gradients of Conv(Pad(X), W) without pads,
        # dX then X's part of the padded input's
        assert kernel is not None
        begins, ends = run_time_same_pads(g, n, x, kernel)
        source = pad_at_run_time(g, x, begins, ends)
        win = window_of(n, nsp, kernel, spatial, unpadded=True)
        spatial = [None] * nsp
    else:
        win = window_of(n, nsp, kernel, spatial)
    if n.needs[0]:
        dx = _conv_input_grad(g, n.dy, w, source, win, group, kernel, spatial)
        grads[0] = dx if begins is None else unpad_at_run_time(g, dx, begins, x, nsp)
    if n.needs[1]:
        dw = _unfolded_weight_grad(g, n.dy, n.y.shape, source, w, win, kernel) if group == 1 else None
        grads[1] = (
            dw if dw is not None else _conv_weight_grad(g, n.dy, source, w, win, group, kernel, spatial)
        )
    if b is not None and n.needs[2]:
        grads[2] = g.reduce_sum(n.dy, [0, *range(2, 2 + nsp)], keepdims=False)
    return grads


# The unfolded patches of one sample, in values, up to which the weight gradient is computed by
# im2col (4 MiB of float32 per sample: the backward holds them for one product).
UNFOLD_MAX_VALUES = 1 << 20


def _unfolded_weight_grad(
    g: GradBuilder,
    dy: Var,
    y_shape: tuple[Dim, ...] | None,
    x: Var,
    w: Var,
    win: Window,
    kernel: list[int] | None,
) -> Var | None:
    """dW of an ungrouped float32 Conv as im2col: the patches P (N, C K, L) of X are unfolded by a
    Conv of X with a one-hot kernel (one output channel per input channel and kernel position,
    ``group=C``, the forward's strides, dilations and pads, so that L = the positions of Y), then
    dW = sum_n dY[n] P[n]^T, one batched MatMul (dY as (N, M, L)) and the sum over N as a product
    by ones(N) (``sum_leading``; ``bench/conv_weight_grad.py``:
    the fastest calls 0.85-0.99x those of a ``ReduceSum`` over N on vgg-style 3x3 layers, batch 32).

    ``y_shape``: the forward output's shape, which dY shares; the shape to go by when dY's own is
    unknown (a gradient summed from a ReLU mask and a ConvTranspose declares none), without which
    the first Conv of every VGG block took the slower form below (3.5 -> 1.0 ms and 9.9 -> 4.2 ms
    for the vgg bench model's 3 -> 32 and 32 -> 64 layers).

    onnxruntime's Conv with dY as the kernel (:func:`_conv_weight_grad`) im2cols X for a kernel as
    large as Y: on 2 cores this form measured 2-4x faster for 3x3 kernels (e.g. batch 64, 16 -> 32
    channels of 16x16: 2.2 ms against 8.5 ms) and 2x for a 5x5 kernel on one channel (the
    anchor CNN's first layer), but up to 30 % slower for larger kernels over several channels,
    whose one-hot Conv does K multiply-adds per patch value. Used for kernels of at most 9 positions,
    or 25 over one channel, when the patches of one sample hold at most ``UNFOLD_MAX_VALUES``;
    None elsewhere.
    """
    dy_shape = dy.shape if dy.shape is not None else y_shape
    if x.dtype != TensorProto.FLOAT or kernel is None or x.shape is None or dy_shape is None:
        return None
    c, k = x.shape[1], math.prod(kernel)
    positions = static_dims(list(dy_shape[2:]))
    if not isinstance(c, int) or positions is None or not (k <= 9 or (c == 1 and k <= 25)):
        return None
    length = math.prod(positions)
    if c * k * length > UNFOLD_MAX_VALUES:
        return None
    m = w.shape[0] if w.shape is not None else None
    plain = k == 1 and not any(win.pads) and all(s == 1 for s in win.strides)
    if plain:  # a 1x1 kernel at stride 1 without padding: the patches are X itself
        patches = x
    else:
        onehot = np.zeros((c * k, 1, *kernel), dtype=np.float32)
        for ch in range(c):  # output channel ch K + j picks kernel position j of channel ch
            for j, pos in enumerate(itertools.product(*(range(d) for d in kernel))):
                onehot[(ch * k + j, 0, *pos)] = 1.0
        attrs, source = win.attrs(), x
        if c == 1 and len(kernel) == 2:
            # as a 3-D Conv over (N, 1, 1, H, W): onnxruntime turns a 2-D Conv of one group into its
            # NCHWc layout and reorders the patches back, which took longer than the Conv itself
            # (anchor CNN: 0.76 + 0.89 ms against 0.85 ms)
            onehot, source, kernel = onehot[:, :, None], g.Unsqueeze(x, [2]), [1, *kernel]
            attrs = {
                "strides": [1, *win.strides],
                "dilations": [1, *win.dilations],
                "pads": [0, *win.begins, 0, *win.ends],
            }
        patches = g.Conv(source, g.const(onehot), group=c, kernel_shape=list(kernel), **attrs)
    p3 = g.Reshape(patches, [0, c * k, length], shape=(x.shape[0], c * k, length))
    d3 = g.Reshape(dy, [0, -1, length], shape=(dy_shape[0], m, length))
    # P[n] dY[n]^T (C K, M): the product's second operand, which MLAS repacks at every call, is
    # the smaller dY rather than the K-fold patches
    per_sample = g.MatMul(p3, g.Transpose(d3, perm=[0, 2, 1]), shape=(x.shape[0], c * k, m))
    summed = g.sum_leading(per_sample, 1, (c * k, m), (dy_shape[0],))
    return g.Reshape(g.Transpose(summed, perm=[1, 0]), g.shape_of(w), shape=w.shape)


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
    them. With run-time sizes the ConvTranspose keeps the forward's begin pads only: its output
    then runs from x's first row to the end of the last window, which may lie before x's end
    (rows no window reached, padded with zeros) or past it, in the end pad (cropped). Cropping
    the end pad inside the ConvTranspose would also cut the last real rows whenever the stride
    leaves rows of the padded input unread.
    """
    static = static_dims(spatial)
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
    nsp = len(win.strides)
    ct = g.ConvTranspose(dy, w, group=group, **{**attrs, "pads": [*win.begins, *[0] * nsp]})
    size = g.Slice(g.shape_of(x), [2], [_END])
    return fit_spatial(g, ct, size, nsp, crop=any(win.ends), shape=x.shape)


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
    static = static_dims(spatial)
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
        static = static_dims(spatial)
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


def unpadded_transpose_window(n: NodeContext, nsp: int) -> Window:
    """The strides and dilations of a ConvTranspose node's adjoint Conv, without pads."""
    strides = tuple(int(s) for s in (n.attr("strides") or [1] * nsp))
    dilations = tuple(int(d) for d in (n.attr("dilations") or [1] * nsp))
    return Window(strides, dilations, (0,) * (2 * nsp))


def _transpose_pads_at_run_time(n: NodeContext, kernel: list[int] | None, spatial: list[Dim]) -> bool:
    """Whether the pads of a ConvTranspose's adjoint Conv depend on sizes known only at run time:
    ``output_shape`` with X's spatial sizes or the kernel not static, SAME with the kernel not."""
    auto_pad = n.attr("auto_pad", "NOTSET") or "NOTSET"
    if n.attr("output_shape"):
        return kernel is None or static_dims(spatial) is None
    return auto_pad in ("SAME_UPPER", "SAME_LOWER") and kernel is None


def _run_time_transpose_pads(g: GradBuilder, n: NodeContext, x: Var, w: Var, nsp: int) -> tuple[Var, Var]:
    """:func:`transpose_window`'s begin and end pads from the run-time sizes of X and W (1-D int64)."""
    strides = np.array([int(s) for s in (n.attr("strides") or [1] * nsp)], dtype=np.int64)
    dilations = np.array([int(d) for d in (n.attr("dilations") or [1] * nsp)], dtype=np.int64)
    out_pad = np.array([int(p) for p in (n.attr("output_padding") or [0] * nsp)][-nsp:], dtype=np.int64)
    kernel = n.attr("kernel_shape")
    k = g.const(np.array(kernel[-nsp:], dtype=np.int64)) if kernel else g.Slice(g.shape_of(w), [2], [2 + nsp])
    extent = g.Add(
        g.Mul(g.Sub(k, g.const(np.ones(nsp, dtype=np.int64))), g.const(dilations)),
        g.const(np.ones(nsp, dtype=np.int64)),
    )
    output_shape = n.attr("output_shape")
    if output_shape:  # s (H - 1) + output_padding + extent - out
        size = g.Slice(g.shape_of(x), [2], [2 + nsp])
        natural = g.Add(g.Mul(g.Sub(size, g.const(np.ones(nsp, dtype=np.int64))), g.const(strides)), extent)
        out = np.array([int(o) for o in output_shape][-nsp:], dtype=np.int64)
        total = g.Add(natural, g.const(out_pad - out))
    else:  # SAME: out = H s, whatever H
        total = g.Add(extent, g.const(out_pad - strides))
    zero = g.const(np.zeros(nsp, dtype=np.int64))
    total = g.Max(total, zero)
    half = g.Div(total, g.const(np.full(nsp, 2, dtype=np.int64)))
    begins = half if n.attr("auto_pad") == "SAME_UPPER" else g.Sub(total, half)
    ends = g.Max(g.Sub(g.Sub(total, begins), g.const(out_pad)), zero)
    return begins, ends


@rule("ConvTranspose")
def conv_transpose(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = ConvTranspose(X, W) + B, the adjoint of Conv(., W).

    dX = Conv(dY, W) with the adjoint geometry (:func:`transpose_window`); dW is the Conv rule's
    weight gradient with the roles of X and dY exchanged (dY is the Conv input, X its output
    gradient); dB = dY summed over all axes but 1.
    """
    x, w = n.inputs[0], n.inputs[1]
    b = n.inputs[2] if len(n.inputs) > 2 else None
    assert x is not None and w is not None
    dy = n.dy
    nsp = spatial_rank(n, w, x, n.y)
    kernel = _kernel(n, w, nsp)
    spatial = spatial_dims(x, nsp)
    source, dy_spatial = dy, spatial_dims(dy, nsp)
    if _transpose_pads_at_run_time(n, kernel, spatial):
        # the adjoint Conv's pads depend on run-time sizes: that Conv unpadded, of dY padded
        source = pad_at_run_time(g, dy, *_run_time_transpose_pads(g, n, x, w, nsp))
        win, dy_spatial = unpadded_transpose_window(n, nsp), [None] * nsp
    else:
        win = transpose_window(n, nsp, kernel, spatial)
    group = int(n.attr("group", 1))
    grads: Grads = [None] * len(n.inputs)
    if n.needs[0]:
        grads[0] = g.Conv(source, w, group=group, **win.attrs(), shape=x.shape)
    if n.needs[1]:
        grads[1] = _conv_weight_grad(g, x, source, w, win, group, kernel, dy_spatial)
    if b is not None and n.needs[2]:
        grads[2] = g.reduce_sum(dy, [0, *range(2, 2 + nsp)], keepdims=False)
    return grads


# ---- DeformConv -----------------------------------------------------------------------------
@rule("DeformConv", since=19)
def deform_conv(g: GradBuilder, n: NodeContext) -> Grads:
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
    nsp = spatial_rank(n, w, x, n.y)
    kernel = _kernel(n, w, nsp)
    if kernel is None or w.static_shape is None:
        raise GradientNotImplementedError(f"{node_label(n)}: DeformConv needs a static weight shape")
    # spatial sizes of X and Y: ints when static, else (1,) int64 Vars read at run time
    size = [g.dim(x, 2 + a) for a in range(nsp)]
    out = [g.dim(n.y, 2 + a) for a in range(nsp)]
    group, og = int(n.attr("group", 1)), int(n.attr("offset_group", 1))
    strides = [int(s) for s in (n.attr("strides") or [1] * nsp)]
    dilations = [int(d) for d in (n.attr("dilations") or [1] * nsp)]
    pads = [int(p) for p in (n.attr("pads") or [0] * (2 * nsp))]
    m_out, c_grp = w.static_shape[0], w.static_shape[1]
    channels = c_grp * group
    kk = math.prod(kernel)
    oo = math.prod(out) if all(isinstance(o, int) for o in out) else -1  # type: ignore[arg-type]
    ko = kk * oo if oo != -1 else -1  # kernel times output positions, in reshapes
    dtype = x.dtype
    grads: Grads = [None] * len(n.inputs)

    off = g.Reshape(offset, [0, og, kk, nsp, oo])
    weight, index, slopes = _deform_corners(g, off, kernel, out, size, strides, dilations, pads, og)
    nc = 2**nsp
    # X as (N, og, H W..., C / og): one gather per (image, offset group) batch.
    cg = channels // og
    xt = g.Transpose(g.Reshape(x, [0, og, cg, -1]), perm=[0, 1, 3, 2])
    values = g.Reshape(g.GatherND(xt, index, batch_dims=2), [0, og, ko, nc, cg])
    samples = g.Squeeze(g.MatMul(g.Unsqueeze(weight, [3]), values), [3])  # (N, og, K O, cg)
    samples = g.Transpose(samples, perm=[0, 1, 3, 2])  # (N, og, cg, K O)
    mask_r = None if mask is None else g.Reshape(mask, [0, og, 1, ko])
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
    dcols = g.Reshape(g.MatMul(g.Transpose(w_g, perm=[0, 2, 1]), dy_g), [0, og, cg, ko])
    if mask is not None and n.needs[4]:
        dmask = g.ReduceSum(dcols * samples, [2], keepdims=0)  # (N, og, K O)
        grads[4] = g.Reshape(dmask, g.shape_of(mask), shape=mask.shape)
    dsamples = g.Transpose(dcols if mask_r is None else dcols * mask_r, perm=[0, 1, 3, 2])  # (N, og, K O, cg)
    if n.needs[0]:
        updates = g.Reshape(g.Unsqueeze(weight, [4]) * g.Unsqueeze(dsamples, [3]), [0, og, -1, cg])
        full = _batch_index(g, index, og)
        dxt = g.ScatterND(zeros(g, g.Shape(xt), dtype), full, updates, reduction="add")
        grads[0] = g.Reshape(g.Transpose(dxt, perm=[0, 1, 3, 2]), g.shape_of(x), shape=x.shape)
    if n.needs[2]:
        # q[n, g, j, corner] = sum over channels of X[corner] * dsamples
        q = g.Squeeze(g.MatMul(values, g.Unsqueeze(dsamples, [4])), [4])  # (N, og, K O, nc)
        per_axis = [g.ReduceSum(q * slope, [3], keepdims=1) for slope in slopes]
        d_off = g.Concat(*per_axis, axis=3)  # (N, og, K O, nsp)
        d_off = g.Transpose(g.Reshape(d_off, [0, og, kk, oo, nsp]), perm=[0, 1, 2, 4, 3])
        grads[2] = g.Reshape(d_off, g.shape_of(offset), shape=offset.shape)
    return grads


def _deform_base(
    g: GradBuilder,
    kernel: list[int],
    out: list[int | Var],
    strides: list[int],
    dilations: list[int],
    pads: list[int],
    a: int,
    dtype: int,
) -> Var:
    """k d - pad + o s along axis a for every (kernel position, output position), flattened
    (K O,): a constant when the output sizes are static, else built from them at run time."""
    nsp, kk = len(kernel), math.prod(kernel)
    k_grid = np.meshgrid(*[np.arange(k) for k in kernel], indexing="ij")[a].reshape(kk, 1)
    if all(isinstance(o, int) for o in out):
        o_grid = np.meshgrid(*[np.arange(o) for o in out], indexing="ij")[a].reshape(1, -1)  # type: ignore[arg-type]
        return g.const((k_grid * dilations[a] - pads[a] + o_grid * strides[a]).reshape(-1), dtype)
    sizes = g.Concat(*[g.const(np.array([o])) if isinstance(o, int) else o for o in out], axis=0)
    rows = g.Range(g.const(np.int64(0)), g.Gather(sizes, g.const(np.int64(a))), g.const(np.int64(1)))
    along = g.Reshape(rows, [1] * a + [-1] + [1] * (nsp - a - 1))
    o_flat = g.Reshape(g.Expand(along, sizes), [1, -1])  # (1, O): this axis' coordinate of each position
    o_part = g.Cast(o_flat, to=dtype) * float(strides[a])
    return g.Reshape(o_part + g.const(k_grid * dilations[a] - pads[a], dtype), [-1])


def _deform_corners(
    g: GradBuilder,
    off: Var,
    kernel: list[int],
    out: list[int | Var],
    size: list[int | Var],
    strides: list[int],
    dilations: list[int],
    pads: list[int],
    og: int,
) -> tuple[Var, Var, list[Var]]:
    """Bilinear sampling of DeformConv at p = o s - pad + k d + offset, over the 2^D cell corners.

    ``off`` is the offset as (N, og, K, D, O); ``out`` and ``size``: the spatial sizes of Y and X,
    ints or (1,) int64 Vars of run-time sizes. Returns the weight of each corner (N, og, K O, 2^D),
    its flat position in X's spatial plane as GatherND indices (N, og, K O 2^D, 1), clamped into X
    (a corner outside weighs 0), and per axis a the derivative of each weight along p_a.
    """
    nsp = len(kernel)
    dtype = off.dtype
    per_axis = []  # per axis, for the lower and the upper corner: (weight, inside, index)
    for a in range(nsp):
        base = _deform_base(g, kernel, out, strides, dilations, pads, a, dtype)
        pos = g.Reshape(g.Gather(off, [a], axis=3), [0, og, -1]) + base
        low = g.Floor(pos)
        frac = pos - low
        h = size[a]
        last: float | Var = float(h - 1) if isinstance(h, int) else g.Cast(g.Squeeze(h, [0]), to=dtype) - 1.0
        ends = []
        for c in (0, 1):
            idx = low + float(c)
            inside = g.Cast(g.And(idx >= 0.0, idx <= last), to=dtype)
            clamped = g.Min(g.Max(idx, g.const(np.array(0.0), dtype)), last)
            ends.append(((frac if c else 1.0 - frac) * inside, inside, g.Cast(clamped, to=INT64)))
        per_axis.append(ends)
    plane = [_product_of(g, size[a + 1 :]) for a in range(nsp)]
    weights: list[Var] = []
    flat: list[Var] = []
    slopes: list[list[Var]] = [[] for _ in range(nsp)]
    for corner in itertools.product((0, 1), repeat=nsp):
        parts = [per_axis[a][c] for a, c in enumerate(corner)]
        weights.append(_product([p[0] for p in parts]))
        flat.append(
            _sum(
                [
                    p[2] if isinstance(plane[a], int) and plane[a] == 1 else p[2] * plane[a]
                    for a, p in enumerate(parts)
                ]
            )
        )
        for a, c in enumerate(corner):  # d weight / d p_a: +-1 inside X, times the other axes' weights
            slope = parts[a][1] if c else -parts[a][1]
            others = [parts[e][0] for e in range(nsp) if e != a]
            slopes[a].append(_product([slope, *others]))

    def stack(vs: list[Var]) -> Var:  # 2^D x (N, og, K O) -> (N, og, K O, 2^D)
        return g.Concat(*[g.Unsqueeze(v, [3]) for v in vs], axis=3)

    index = g.Unsqueeze(g.Reshape(stack(flat), [0, 0, -1]), [3])
    return stack(weights), index, [stack(s) for s in slopes]


def _product_of(g: GradBuilder, sizes: list[int | Var]) -> int | Var:
    """The product of sizes, ints or (1,) int64 Vars: an int when every one is."""
    static = math.prod(s for s in sizes if isinstance(s, int))
    product: int | Var = static
    for s in sizes:
        if not isinstance(s, int):
            product = s if isinstance(product, int) and product == 1 else product * s
    if not isinstance(product, int) and static != 1:
        product = product * static
    return product


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
class _StaticTaps:
    """The k taps p_j = p[.., j : j + L] of CausalConvWithState as slices (k static)."""

    def __init__(self, g: GradBuilder, padded: Var, w: Var, k: int) -> None:
        self.g, self.k = g, k
        self.taps = [g.Slice(padded, [j], [j - (k - 1) if j < k - 1 else _END], [2]) for j in range(k)]
        self.w_taps = [g.Squeeze(g.Slice(w, [j], [j + 1], [2]), [2]) for j in range(k)]  # (C, 1) each

    def conv(self) -> Var:
        """sum_j w_j p_j (B, C, L)."""
        return _sum([wj * pj for wj, pj in zip(self.w_taps, self.taps)])

    def weight_grad(self, dz: Var) -> Var:
        """(C, k): sum over batch and time of dz p_j."""
        g = self.g
        per_tap = [g.Unsqueeze(g.reduce_sum(dz * pj, [0, 2], keepdims=False), [1]) for pj in self.taps]
        return g.Concat(*per_tap, axis=1) if self.k > 1 else per_tap[0]

    def input_grad(self, dz: Var) -> Var:
        """dp (B, C, L + k - 1): dz w_j placed at j."""
        k, g = self.k, self.g
        return _sum([g.Pad(dz * wj, [0, 0, j, 0, 0, k - 1 - j]) for j, wj in enumerate(self.w_taps)])


class _RunTimeTaps:
    """The taps of CausalConvWithState for a kernel size k known only at run time: p gathered
    at t + j into (B, C, L, k), the gradient of p scatter-added back from there."""

    def __init__(self, g: GradBuilder, padded: Var, w: Var, length: Var, k: Var) -> None:
        self.g, self.padded = g, padded
        steps = g.Range(g.const(np.int64(0)), g.Squeeze(length, [0]), g.const(np.int64(1)))
        taps = g.Range(g.const(np.int64(0)), g.Squeeze(k, [0]), g.const(np.int64(1)))
        self.index = g.Unsqueeze(steps, [1]) + g.Unsqueeze(taps, [0])  # (L, k): t + j
        self.p = g.Gather(padded, self.index, axis=2)  # (B, C, L, k)
        self.w = g.Unsqueeze(g.Squeeze(w, [1]), [0, 2])  # (1, C, 1, k)

    def conv(self) -> Var:
        return self.g.ReduceSum(self.p * self.w, [3], keepdims=0)

    def weight_grad(self, dz: Var) -> Var:
        return self.g.ReduceSum(self.g.Unsqueeze(dz, [3]) * self.p, [0, 2], keepdims=0)

    def input_grad(self, dz: Var) -> Var:
        g = self.g
        spread = g.Reshape(g.Unsqueeze(dz, [3]) * self.w, [0, 0, -1])  # (B, C, L k)
        where_to = g.Expand(g.Reshape(self.index, [1, 1, -1]), g.Shape(spread))
        return g.ScatterElements(g.zeros_like(self.padded), where_to, spread, axis=2, reduction="add")


@rule("CausalConvWithState", since=27)
def causal_conv_with_state(g: GradBuilder, n: NodeContext) -> Grads:
    """y = act(z), z[b, c, t] = sum_j w[c, 0, j] p[b, c, t + j] + bias[c], p = concat(past_state
    (zeros when absent), x) along time; present_state = the last k - 1 positions of p.

    With the k taps p_j = p[.., j : j + L]: dz = dy act'(z) (SiLU: s (1 + z (1 - s)), s the sigmoid
    of z, recomputed), dw[c, 0, j] = sum dz p_j, dbias = sum dz, dp = sum_j dz w_j placed at j (plus
    the gradient of present_state on the last k - 1 positions); dx and d past_state are the two
    parts of dp. The taps are slices when the kernel size k is static, else gathered at run time.
    """
    x, w = n.inputs[0], n.inputs[1]
    assert x is not None and w is not None
    bias = n.inputs[2] if len(n.inputs) > 2 else None
    past = n.inputs[3] if len(n.inputs) > 3 else None
    grads: Grads = [None] * len(n.inputs)
    act = str(n.attr("activation", "none")).lower()
    if act not in ("none", "silu", "swish"):
        raise GradientNotImplementedError(f"{node_label(n)}: unknown activation {act!r}")
    k_static = w.shape[-1] if w.shape is not None and len(w.shape) == 3 else None
    k = k_static if isinstance(k_static, int) else g.Slice(g.shape_of(w), [2], [3])
    history = k - 1 if isinstance(k, int) else g.Sub(k, g.const(np.ones(1, dtype=np.int64)))
    history_v = g.const(np.array([history], dtype=np.int64)) if isinstance(history, int) else history
    dy = n.dout[0]
    d_present = n.dout[1] if len(n.dout) > 1 else None
    if past is not None:
        padded = g.Concat(past, x, axis=2)
    else:
        lead = g.Slice(g.shape_of(x), [0], [2])
        before = zeros(g, g.Concat(lead, history_v, axis=0), x.dtype)
        padded = g.Concat(before, x, axis=2)
    taps: _StaticTaps | _RunTimeTaps
    if isinstance(k, int):
        taps = _StaticTaps(g, padded, w, k)
    else:
        taps = _RunTimeTaps(g, padded, w, g.Slice(g.shape_of(x), [2], [3]), k)
    dp = None
    if dy is not None:
        dz = dy
        if act != "none":
            z = taps.conv()
            if bias is not None:
                z = z + g.Unsqueeze(bias, [1])
            sg = sigmoid(z)
            dz = dy * sg * (z * (1.0 - sg) + 1.0)
        if bias is not None and n.needs[2]:
            grads[2] = g.reduce_sum(dz, [0, 2], keepdims=False)
        if n.needs[1]:
            grads[1] = g.Unsqueeze(taps.weight_grad(dz), [1], shape=w.shape)
        if n.needs[0] or (past is not None and n.needs[3]):
            dp = taps.input_grad(dz)
    if d_present is not None and (n.needs[0] or (past is not None and n.needs[3])):
        tail = g.Concat(g.zeros_like(x), d_present, axis=2)
        dp = tail if dp is None else dp + tail
    if dp is not None:
        if n.needs[0]:
            grads[0] = g.Slice(dp, history_v, [_END], [2], shape=x.shape)
        if past is not None and n.needs[3]:
            grads[3] = g.Slice(dp, [0], history_v, [2], shape=past.shape)
    return grads
