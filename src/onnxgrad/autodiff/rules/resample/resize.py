"""Resize (and the older Upsample) with taps computed when building.

Resize is linear in X and separable: along each resized axis, output position o reads a few input
positions i with weights w(o, i) that depend only on sizes, scales and attributes. Those taps are
computed here at build time (mirroring onnxruntime's arithmetic: float32 coordinates, its rounding
of nearest indices, its antialias filter), transposed, and applied to dy as one Gather plus a
weighted sum per axis: dX[.., i, ..] = sum_k dy[.., J[i, k], ..] * V[i, k]. Where sizes or scales
are known only at run time, :mod:`.resize_run_time` builds the same maps with ONNX ops."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ....errors import GradientNotImplementedError
from ...builder import GradBuilder, Var
from ...registry import NodeContext, rule
from ..common import Grads, first_only, need_rank, node_label
from .resize_mode import F32, ResizeMode, aspect_policy, resize_mode_of
from .resize_run_time import resize_run_time


def _source_coords(
    mode: ResizeMode, n_out: int, n_in: int, scale: F32, roi: tuple[float, float]
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
    else:  # half_pixel (the names were checked by resize_mode_of)
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
    mode: ResizeMode, n_out: int, n_in: int, scale: F32, roi: tuple[float, float]
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
    mode: ResizeMode, n_out: int, n_in: int, scale: F32, roi: tuple[float, float]
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


def _resize_axes(n: NodeContext, mode: ResizeMode) -> list[_AxisResize]:
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
        policy = aspect_policy(n)
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
    from the run-time sizes and scales (:func:`resize_run_time`, antialias included).
    """
    if not n.needs[0]:
        return first_only(n, None)
    mode = resize_mode_of(n)
    rank = need_rank(n, n.x)
    dx = n.dy
    try:
        axes = _resize_axes(n, mode)
    except _RunTime:  # sizes or scales known only at run time
        return first_only(n, resize_run_time(g, n, mode, rank))
    for ax in axes:
        idx, w = _resize_taps(mode, ax.n_out, ax.n_in, ax.scale, ax.roi)
        table, values = _transpose_taps(idx, w, ax.n_in)
        dx = _apply_adjoint(g, dx, ax.axis, rank, table, values)
    if dx is n.dy:  # a resize that changes nothing
        return first_only(n, dx)
    return first_only(n, g.Identity(dx, shape=n.x.shape))


@rule("Upsample", since=7)
def upsample(g: GradBuilder, n: NodeContext) -> Grads:
    """Upsample-7/9: Resize-10 before its name (asymmetric coordinates, nearest truncates)."""
    return resize(g, n)
