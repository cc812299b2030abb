"""GridSample and AffineGrid.

GridSample reads X at run-time positions: dX scatter-adds dy times the interpolation weights at the
corners each output read (2 per dim for linear, 4 for cubic; one ScatterElements), d grid is dy
times the slope of the interpolation along each coordinate, times the slopes of the padding (border
clipping, reflections) and of the unnormalization, as torch.nn.functional.grid_sample.

AffineGrid is ``grid[n, p] = theta[n] @ [base(p), 1]`` over the output positions ``p``, so
``dtheta[n] = dgrid[n]^T @ [base, 1]``; the base coordinates are AffineGrid of the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....errors import GradientNotImplementedError
from ...builder import INT64, GradBuilder, Var, cast, where
from ...registry import NodeContext, rule
from ..common import Grads, need_rank, node_label, refuse, zeros


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
    """``grid[b, p] = theta[b] @ [base(p), 1]``: ``dtheta[b] = dgrid[b]^T @ [base, 1]``.

    The grid's number of spatial dims k (2 or 3) is theta's dim 1, or the length of ``size`` less
    2, or the grid's rank less 2: whichever is known when building."""
    theta, size = n.inputs[0], n.inputs[1]
    assert theta is not None and size is not None
    ks = {
        theta.shape[1] if theta.shape is not None and len(theta.shape) == 3 else None,
        size.shape[0] - 2 if size.shape is not None and isinstance(size.shape[0], int) else None,
        n.y.rank - 2 if n.y.rank is not None else None,
    }
    known = [v for v in ks if isinstance(v, int)]
    if not known:
        raise refuse(n, "the grid's number of spatial dims (theta's dim 1) must be known")
    k = known[0]  # 2 (2-D grid) or 3 (3-D grid)
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
