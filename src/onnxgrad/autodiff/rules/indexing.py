"""Indexing ops: scatters, TopK, Compress, Trilu, cumulative sums and products, ReverseSequence,
CenterCropPad and MaxUnpool.

A scatter is transposed by a gather at the same indices and the other way round (ScatterElements /
GatherElements, ScatterND / GatherND, MaxUnpool / Gather). The reductions of the scatters read the
forward values they need:

* ``none``: the data keeps ``dy`` where no update landed; an update gets ``dy`` at its index, unless
  a later update (row-major order of the indices) overwrote it. That is the true derivative of what
  onnxruntime computes (the last write wins). torch.scatter differs here: its backward gives every
  duplicate ``dy.gather(index)``, which is not the derivative of its own forward;
* ``add``: the data gets ``dy``, each update ``dy`` at its index;
* ``mul``: each factor gets ``dy`` times the product of the others, computed without dividing by
  zero (as torch.scatter_reduce "prod");
* ``max`` / ``min``: ``dy`` is shared evenly among the data element and updates equal to the result
  (as torch.scatter_reduce "amax" / "amin" with include_self).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from ...errors import GradientNotImplementedError
from ..builder import INT64, GradBuilder, Var, cast, where
from ..registry import NodeContext, rule
from .shape import Grads, _axis, _first_only, _need_rank, _numel, _positions, _scatter_positions


def _where(n: NodeContext) -> str:
    return f"{n.node.op_type} node {n.node.name!r}"


def _full(g: GradBuilder, like: Var, value: float | int, dtype: int | None = None) -> Var:
    """A tensor of ``like``'s shape filled with ``value`` (``like``'s dtype unless told)."""
    dtype = like.dtype if dtype is None else dtype
    fill = helper.make_tensor("", dtype, [1], [value])
    return g.ConstantOfShape(g.shape_of(like), value=fill, dtype=dtype, shape=like.shape)


# ---- scatters ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Scatter:
    """The index pattern of one scatter node: ``put`` scatters there, ``take`` gathers from there.

    ``axis`` is the ScatterElements axis, ``None`` for ScatterND.
    """

    g: GradBuilder
    idx: Var
    axis: int | None

    def put(self, base: Var, values: Var, reduction: str | None = None) -> Var:
        if self.axis is None:
            return self.g.ScatterND(base, self.idx, values, reduction=reduction, shape=base.shape)
        return self.g.ScatterElements(
            base, self.idx, values, axis=self.axis, reduction=reduction, shape=base.shape
        )

    def take(self, t: Var, like: Var) -> Var:
        if self.axis is None:
            return self.g.GatherND(t, self.idx, shape=like.shape)
        return self.g.GatherElements(t, self.idx, axis=self.axis, shape=like.shape)

    def kept(self, data: Var, upd: Var) -> Var:
        """Bool mask over the updates: true for those no later update overwrites.

        Each update's row-major ordinal is scatter-maxed into the data's shape: the position keeps
        the ordinal of its last write, which only that update reads back.
        """
        order = _positions(self.g, upd)
        last = self.put(_full(self.g, data, -1, INT64), order, "max")
        return self.g.Equal(self.take(last, upd), order)


def _unique_elements(idx: np.ndarray, axis: int, dim: int | None) -> bool:
    """Whether constant ScatterElements indices write every position at most once."""
    if idx.size and idx.min() < 0:
        if dim is None:
            return False
        idx = np.where(idx < 0, idx + dim, idx)
    coords = np.indices(idx.shape)
    coords[axis] = idx
    keys = coords.reshape(idx.ndim, -1).T
    return len(np.unique(keys, axis=0)) == len(keys)


def _unique_rows(idx: np.ndarray, dims: tuple | None) -> bool:
    """Whether constant ScatterND indices (rows of the last axis) are distinct."""
    rows = idx.reshape(-1, idx.shape[-1])
    if rows.size and rows.min() < 0:
        if dims is None or not all(isinstance(d, int) for d in dims[: rows.shape[1]]):
            return False
        rows = np.where(rows < 0, rows + np.array(dims[: rows.shape[1]]), rows)
    return len(np.unique(rows, axis=0)) == len(rows)


def _scatter_grads(g: GradBuilder, n: NodeContext, sc: _Scatter, unique: bool) -> Grads:
    """Gradients of data and updates of a scatter with any reduction (see the module docstring)."""
    data, upd, dy = n.inputs[0], n.inputs[2], n.dy
    assert data is not None and upd is not None
    reduction = n.attr("reduction", "none")
    d_data = d_upd = None
    if reduction == "none":
        if n.needs[0]:
            d_data = sc.put(dy, g.zeros_like(upd))
        if n.needs[2]:
            d_upd = sc.take(dy, upd)
            if not unique:
                d_upd = where(sc.kept(data, upd), d_upd, 0)
    elif reduction == "add":
        d_data = dy
        d_upd = sc.take(dy, upd) if n.needs[2] else None
    elif reduction == "mul":
        if n.needs[0]:
            d_data = sc.put(dy, upd, "mul")
        if n.needs[2]:
            d_upd = _mul_update_grad(g, sc, data, upd, dy)
    elif reduction in ("max", "min"):
        y = n.y
        hit_data = cast(g.Equal(data, y), data)
        hit_upd = cast(g.Equal(upd, sc.take(y, upd)), upd)
        share = dy / sc.put(hit_data, hit_upd, "add")  # dy split among the ties
        d_data = share * hit_data
        d_upd = sc.take(share, upd) * hit_upd
    else:
        raise GradientNotImplementedError(f"{_where(n)}: unknown reduction {reduction!r}")
    return [d_data if n.needs[0] else None, None, d_upd if n.needs[2] else None]


def _mul_update_grad(g: GradBuilder, sc: _Scatter, data: Var, upd: Var, dy: Var) -> Var:
    """d upd_j = dy * data * (product of the other updates at j's position), without dividing by 0.

    Zero updates are replaced by 1 in the product and counted apart: the product of the others is
    ``prod / upd_j`` when none of the others is zero, else 0.
    """
    is_zero = g.Equal(upd, g.const(0.0, upd.dtype))
    safe = where(is_zero, 1.0, upd)
    prod = sc.put(_full(g, data, 1.0), safe, "mul")
    zeros_here = sc.put(g.zeros_like(data), cast(is_zero, upd), "add")
    zeros_others = sc.take(zeros_here, upd) - cast(is_zero, upd)
    others = where(zeros_others < 0.5, sc.take(prod, upd) / safe, 0.0)
    return sc.take(dy * data, upd) * others


@rule("ScatterElements", "Scatter")
def scatter_elements(g: GradBuilder, n: NodeContext) -> Grads:
    """y = data with updates written (or reduced) at ``idx`` along ``axis``; the inverse pattern is
    GatherElements. ``Scatter`` (opsets 9-10) is ScatterElements without reduction."""
    data, idx = n.inputs[0], n.inputs[1]
    assert data is not None and idx is not None
    axis = int(n.attr("axis", 0))
    value = n.const_input(1)
    unique = False
    if value is not None:
        axis = _axis(n, axis, value.ndim)
        unique = _unique_elements(value, axis, _static_dim(data, axis))
    return _scatter_grads(g, n, _Scatter(g, idx, axis), unique)


@rule("ScatterND")
def scatter_nd(g: GradBuilder, n: NodeContext) -> Grads:
    """y = data with update slices written (or reduced) at the index tuples; the inverse pattern is
    GatherND."""
    data, idx = n.inputs[0], n.inputs[1]
    assert data is not None and idx is not None
    value = n.const_input(1)
    unique = value is not None and _unique_rows(value, data.shape)
    return _scatter_grads(g, n, _Scatter(g, idx, None), unique)


def _static_dim(x: Var, axis: int) -> int | None:
    d = x.shape[axis] if x.shape is not None and axis < len(x.shape) else None
    return d if isinstance(d, int) else None


@rule("TensorScatter", since=24)
def tensor_scatter(g: GradBuilder, n: NodeContext) -> Grads:
    """present = past with ``update`` written along ``axis`` from ``write_indices[b]`` (modulo the
    length in circular mode). d past = dy with the written slots zeroed (TensorScatter of zeros);
    d update = dy read back from those slots (a Slice, or GatherElements when indices are given)."""
    past, upd = n.inputs[0], n.inputs[1]
    assert past is not None and upd is not None
    w = n.inputs[2] if len(n.inputs) > 2 else None
    mode = n.attr("mode", "linear")
    axis = _axis(n, int(n.attr("axis", -2)), _need_rank(n, past))
    grads: Grads = [None] * len(n.inputs)
    if n.needs[0]:
        grads[0] = g.TensorScatter(n.dy, g.zeros_like(upd), w, axis=axis, mode=mode, shape=past.shape)
    if not n.needs[1]:
        return grads
    seq = g.dim(upd, axis)
    if w is None:
        grads[1] = g.Slice(n.dy, [0], [seq] if isinstance(seq, int) else seq, [axis], shape=upd.shape)
        return grads
    seq_v = g.const(np.int64(seq)) if isinstance(seq, int) else g.Squeeze(seq, [0])
    steps = g.Range(g.const(np.int64(0)), seq_v, g.const(np.int64(1)))
    slots = g.Unsqueeze(w, [1]) + g.Unsqueeze(steps, [0])  # (batch, sequence)
    if mode == "circular":
        length = g.dim(past, axis)
        slots = g.Mod(slots, g.const(np.int64(length)) if isinstance(length, int) else length)
    rank = _need_rank(n, past)
    slots = g.Unsqueeze(slots, [i for i in range(1, rank) if i != axis])
    slots = g.Expand(slots, g.shape_of(upd), dtype=INT64)
    grads[1] = g.GatherElements(n.dy, slots, axis=axis, shape=upd.shape)
    return grads


# ---- selections and masks ----------------------------------------------------------------------
@rule("TopK")
def top_k(g: GradBuilder, n: NodeContext) -> Grads:
    """Values = x at the top-k indices along ``axis``: dx = dValues scattered back to those indices.

    The forward node's Indices output is used (added to the node when the model does not use it).
    """
    if not n.needs[0]:
        return _first_only(n, None)
    x = n.x
    idx = g.extra_output(n.node, 1, INT64, n.y.shape)
    dx = g.ScatterElements(
        g.zeros_like(x), idx, n.dout_or_zeros(0), axis=int(n.attr("axis", -1)), shape=x.shape
    )
    return _first_only(n, dx)


@rule("Compress")
def compress(g: GradBuilder, n: NodeContext) -> Grads:
    """y = the slices of x (of flattened x without ``axis``) where ``condition`` holds: the same
    Compress of x's flat positions says where dy goes back."""
    if not n.needs[0]:
        return _first_only(n, None)
    x = n.x
    pos = g.Compress(_positions(g, x), n.inputs[1], axis=n.attr("axis"), dtype=INT64)
    return _first_only(n, _scatter_positions(g, x, pos, n.dy, accumulate=False))


@rule("Trilu")
def trilu(g: GradBuilder, n: NodeContext) -> Grads:
    """y = x masked to a triangle: dx = dy with the same mask (the same Trilu)."""
    k = n.inputs[1] if len(n.inputs) > 1 else None
    dx = g.Trilu(n.dy, k, upper=int(n.attr("upper", 1)), shape=n.x.shape)
    return _first_only(n, dx)


@rule("ReverseSequence")
def reverse_sequence(g: GradBuilder, n: NodeContext) -> Grads:
    """A permutation that is its own inverse: dx = ReverseSequence(dy) with the same lengths."""
    dx = g.ReverseSequence(
        n.dy,
        n.inputs[1],
        batch_axis=int(n.attr("batch_axis", 1)),
        time_axis=int(n.attr("time_axis", 0)),
        shape=n.x.shape,
    )
    return _first_only(n, dx)


@rule("CenterCropPad", since=18)
def center_crop_pad(g: GradBuilder, n: NodeContext) -> Grads:
    """Cropping by (d - t) // 2 in front is undone by padding (d - t) // 2 in front, and the other
    way round: dx = CenterCropPad(dy, shape of x on the same axes)."""
    if not n.needs[0]:
        return _first_only(n, None)
    x = n.x
    axes = n.attr("axes")
    shape = g.shape_of(x)
    if axes is not None:
        rank = x.rank if any(a < 0 for a in axes) else None
        shape = g.Gather(shape, [_axis(n, int(a), rank) for a in axes], dtype=INT64)
    return _first_only(n, g.CenterCropPad(n.dy, shape, axes=axes, shape=x.shape))


# ---- cumulative ops ----------------------------------------------------------------------------
@rule("CumSum")
def cum_sum(g: GradBuilder, n: NodeContext) -> Grads:
    """y_i = sum of x_j for j before i (inclusive or not): dx_j = the sum of dy_i over the same i,
    which is CumSum(dy) in the opposite direction with the same ``exclusive``."""
    dx = g.CumSum(
        n.dy,
        n.inputs[1],
        exclusive=int(n.attr("exclusive", 0)),
        reverse=1 - int(n.attr("reverse", 0)),
        shape=n.x.shape,
    )
    return _first_only(n, dx)


@rule("CumProd", since=26)
def cum_prod(g: GradBuilder, n: NodeContext) -> Grads:
    """y_i = product of x_j for j before i: dx_k = sum over i after k of dy_i * prod_{j before i, j != k} x_j.

    Exact with zeros (as torch.cumprod), per line along the axis, with z the first zero:
    before z, dx_k = rcumsum(dy * y)_k / x_k (no zero divides); at z, dx_z = rcumsum(dy * y')_z
    where y' is the CumProd of x with that zero replaced by 1; after z, dx = 0.
    """
    if not n.needs[0]:
        return _first_only(n, None)
    x, y, dy, axis = n.x, n.y, n.dy, n.inputs[1]
    excl, rev = int(n.attr("exclusive", 0)), int(n.attr("reverse", 0))

    def rcumsum(t: Var) -> Var:
        return g.CumSum(t, axis, exclusive=excl, reverse=1 - rev, shape=x.shape)

    is_zero = g.Equal(x, g.const(0.0, x.dtype))
    zeros_so_far = g.CumSum(cast(is_zero, x), axis, reverse=rev)  # inclusive count, forward order
    before = zeros_so_far < 0.5
    first = g.And(is_zero, zeros_so_far < 1.5)
    safe = where(is_zero, 1.0, x)
    dx_before = rcumsum(dy * y) / safe
    y_skip = g.CumProd(where(first, 1.0, x), axis, exclusive=excl, reverse=rev, shape=x.shape)
    dx_first = rcumsum(dy * y_skip)
    return _first_only(n, where(before, dx_before, where(first, dx_first, 0.0)))


# ---- unpooling ---------------------------------------------------------------------------------
@rule("MaxUnpool")
def max_unpool(g: GradBuilder, n: NodeContext) -> Grads:
    """y = zeros with y.flat[I] = X (I flattened over the whole output, as MaxPool's Indices):
    dX = dy.flat[I]. An index repeated in I keeps the last write, so only that X element gets it."""
    if not n.needs[0]:
        return _first_only(n, None)
    x, ind = n.inputs[0], n.inputs[1]
    assert x is not None and ind is not None
    flat_dy = g.Reshape(n.dy, [-1])
    dx = g.Gather(flat_dy, ind, shape=x.shape)
    value = n.const_input(1)
    if value is None or len(np.unique(value)) != value.size:
        order = _positions(g, x)
        size = _numel(g, n.y)
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
    return _first_only(n, dx)
