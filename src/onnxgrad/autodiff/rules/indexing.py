"""Indexing ops: gathers, scatters, TopK, Compress and Trilu.

A scatter is transposed by a gather at the same indices and the other way round (ScatterElements /
GatherElements, ScatterND / GatherND; Gather by a ScatterND adding up repeated indices). The
reductions of the scatters read the forward values they need:

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
from onnx import helper

from ...errors import GradientNotImplementedError
from ..builder import INT64, GradBuilder, Var, cast, where
from ..registry import NodeContext, rule
from .common import (
    Grads,
    as_int64,
    first_only,
    need_rank,
    node_label,
    nonneg_axis,
    perm_inverse,
    positions,
    scatter_positions,
    zeros,
)


def _full(g: GradBuilder, like: Var, value: float | int, dtype: int | None = None) -> Var:
    """A tensor of ``like``'s shape filled with ``value`` (``like``'s dtype unless told)."""
    dtype = like.dtype if dtype is None else dtype
    fill = helper.make_tensor("", dtype, [1], [value])
    return g.ConstantOfShape(g.shape_of(like), value=fill, dtype=dtype, shape=like.shape)


# ---- gathers ---------------------------------------------------------------------------------
def _nonneg_indices(g: GradBuilder, n: NodeContext, x: Var, axis: int) -> Var:
    """Input 1 (indices into ``axis`` of ``x``) as int64 with negatives wrapped around.

    Constant indices are fixed at build time; the axis size is only looked up when needed.
    """
    value = n.const_input(1)
    if value is not None and value.min(initial=0) >= 0:
        return g.const(value.astype(np.int64))
    dim = g.dim(x, axis)
    if value is not None and isinstance(dim, int):
        return g.const(np.where(value < 0, value + dim, value).astype(np.int64))
    idx = as_int64(g, n.inputs[1])  # type: ignore[arg-type]
    size = g.const(np.int64(dim)) if isinstance(dim, int) else g.Squeeze(dim, [0])
    return where(idx < g.const(np.int64(0)), idx + size, idx)


@rule("Gather")
def gather(g: GradBuilder, n: NodeContext) -> Grads:
    """y = take(x, idx, axis): dx[.., idx[j], ..] += dy[.., j, ..] (repeated indices add up).

    ScatterND adds along the leading axis, so dy's index dims move to the front and back.
    """
    if not n.needs[0]:
        return [None, None]
    x, idx = n.inputs[0], n.inputs[1]
    r = need_rank(n, x)  # type: ignore[arg-type]
    q = need_rank(n, idx)  # type: ignore[arg-type]
    axis = nonneg_axis(n, int(n.attr("axis", 0)), r)
    indices = g.Unsqueeze(_nonneg_indices(g, n, x, axis), [-1])  # type: ignore[arg-type]
    dy = n.dy
    front = [axis, *range(axis), *range(axis + 1, r)]  # x's axes with `axis` first
    if axis:
        # dy is (x dims before axis, idx dims, x dims after axis): idx dims go first
        idx_first = [*range(axis, axis + q), *range(axis), *range(axis + q, r + q - 1)]
        dy = g.Transpose(dy, perm=idx_first)
    static = x.static_shape  # type: ignore[union-attr]
    if static is not None:
        zshape = g.const(np.array([static[a] for a in front], dtype=np.int64))
    else:
        zshape = g.Gather(g.shape_of(x), front, dtype=INT64)  # type: ignore[arg-type]
    dx = g.ScatterND(zeros(g, zshape, dy.dtype), indices, dy, reduction="add")
    if axis:
        dx = g.Transpose(dx, perm=perm_inverse(front))
    return [dx, None]


@rule("GatherND")
def gather_nd(g: GradBuilder, n: NodeContext) -> Grads:
    """y[j] = x[idx[j]] (index tuples): dx = scatter-add of dy at idx. ``batch_dims`` = 0 only."""
    if not n.needs[0]:
        return [None, None]
    if int(n.attr("batch_dims", 0)):
        raise GradientNotImplementedError(
            f"GatherND {n.node.name!r}: the gradient covers batch_dims = 0 only"
        )
    dx = g.ScatterND(g.zeros_like(n.x), n.inputs[1], n.dy, reduction="add", shape=n.x.shape)
    return [dx, None]


@rule("GatherElements")
def gather_elements(g: GradBuilder, n: NodeContext) -> Grads:
    """y[i][j] = x[idx[i][j]][j] (axis 0): dx = scatter-add of dy at idx (negatives allowed)."""
    if not n.needs[0]:
        return [None, None]
    dx = g.ScatterElements(
        g.zeros_like(n.x),
        n.inputs[1],
        n.dy,
        axis=int(n.attr("axis", 0)),
        reduction="add",
        shape=n.x.shape,
    )
    return [dx, None]


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
        order = positions(self.g, upd)
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
        raise GradientNotImplementedError(f"{node_label(n)}: unknown reduction {reduction!r}")
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
        axis = nonneg_axis(n, axis, value.ndim)
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
    axis = nonneg_axis(n, int(n.attr("axis", -2)), need_rank(n, past))
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
    rank = need_rank(n, past)
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
        return first_only(n, None)
    x = n.x
    idx = g.extra_output(n.node, 1, INT64, n.y.shape)
    dx = g.ScatterElements(
        g.zeros_like(x), idx, n.dout_or_zeros(0), axis=int(n.attr("axis", -1)), shape=x.shape
    )
    return first_only(n, dx)


@rule("Compress")
def compress(g: GradBuilder, n: NodeContext) -> Grads:
    """y = the slices of x (of flattened x without ``axis``) where ``condition`` holds: the same
    Compress of x's flat positions says where dy goes back."""
    if not n.needs[0]:
        return first_only(n, None)
    x = n.x
    pos = g.Compress(positions(g, x), n.inputs[1], axis=n.attr("axis"), dtype=INT64)
    return first_only(n, scatter_positions(g, x, pos, n.dy, accumulate=False))


@rule("Trilu")
def trilu(g: GradBuilder, n: NodeContext) -> Grads:
    """y = x masked to a triangle: dx = dy with the same mask (the same Trilu)."""
    k = n.inputs[1] if len(n.inputs) > 1 else None
    dx = g.Trilu(n.dy, k, upper=int(n.attr("upper", 1)), shape=n.x.shape)
    return first_only(n, dx)


@rule("OneHot", since=9)
def one_hot(g: GradBuilder, n: NodeContext) -> Grads:
    """y = values[1] at the hot positions, values[0] elsewhere: d values = [sum of dy off the hot
    positions, sum of dy on them]; the indices and the depth only choose positions (none)."""
    grads: Grads = [None] * len(n.inputs)
    if n.needs[2]:
        dy = n.dy
        hot = g.OneHot(n.inputs[0], n.inputs[1], g.const(np.array([0, 1]), dy.dtype), axis=n.attr("axis", -1))
        total, on = g.ReduceSum(dy, keepdims=0), g.ReduceSum(dy * hot, keepdims=0)
        grads[2] = cast(g.Concat(g.Reshape(total - on, [1]), g.Reshape(on, [1]), axis=0), n.inputs[2])
    return grads


@rule("Unique", since=11)
def unique(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = the distinct elements (slices along ``axis``) of x, each a copy of its first occurrence
    (output ``indices``), which takes its gradient; later copies of a repeated value get none."""
    if not n.needs[0]:
        return first_only(n, None)
    x, dy = n.x, n.dy
    first = g.extra_output(n.node, 1, INT64, None)
    axis = n.attr("axis")
    if axis is None:  # flattened x: indices are flat positions
        return first_only(n, scatter_positions(g, x, first, dy, accumulate=False))
    rank = need_rank(n, x)
    axis = nonneg_axis(n, int(axis), rank)
    along = g.Reshape(first, [1] * axis + [-1] + [1] * (rank - axis - 1))
    index = g.Expand(along, g.Shape(dy))
    return first_only(n, g.ScatterElements(g.zeros_like(x), index, dy, axis=axis, shape=x.shape))
