"""Shape and data-movement ops: reshapes, transposes, slicing, gathering, padding, tiling, casts.

Every rule here moves ``dy`` back to where its elements came from. Three patterns recur:

* a pure reshape or permutation is undone by its inverse (Reshape, Transpose, DepthToSpace);
* an op that picks elements by position is transposed by scattering ``dy`` back (Gather, Slice,
  GatherElements), adding up the elements picked more than once;
* ops with an awkward index pattern (Pad with reflect/edge/wrap, Slice with general steps) are
  replayed on a tensor of flat positions ``0..size(x)-1``, which tells, for every output element,
  which input element it came from; ``dy`` is then scatter-added there.

Sizes come from static shapes when known and from saved ``Shape`` tensors otherwise, so the rules
never save a data tensor just to learn its shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import helper, numpy_helper

from ...errors import GradientNotImplementedError
from ..builder import INT64, GradBuilder, Var, cast, where
from ..graph import FLOAT_TYPES, np_dtype
from ..registry import NodeContext, rule

Grads = list[Var | None]


# ---- helpers ---------------------------------------------------------------------------------
def _first_only(n: NodeContext, dx: Var | None) -> Grads:
    """``dx`` for input 0 (when needed), nothing for the other (shape, index...) inputs."""
    return [dx if n.needs[0] else None] + [None] * (len(n.inputs) - 1)


def _axis(n: NodeContext, axis: int, rank: int | None) -> int:
    """``axis`` made non-negative; needs the rank only when ``axis`` is negative."""
    if axis >= 0:
        return axis
    if rank is None:
        raise GradientNotImplementedError(
            f"{n.node.op_type} {n.node.name!r}: negative axis {axis} needs the input rank"
        )
    return axis + rank


def _need_rank(n: NodeContext, x: Var) -> int:
    if x.rank is None:
        raise GradientNotImplementedError(
            f"{n.node.op_type} {n.node.name!r}: the rank of input {x.name!r} must be known"
        )
    return x.rank


def _zeros(g: GradBuilder, shape: Var, dtype: int) -> Var:
    """Zeros of run-time ``shape`` and element type ``dtype``."""
    zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(dtype)))
    if zero.data_type != dtype:  # bfloat16 and friends
        zero = helper.make_tensor("", dtype, [1], [0.0])
    return g.ConstantOfShape(shape, value=zero, dtype=dtype)


def _numel(g: GradBuilder, x: Var) -> int | Var:
    """Number of elements of ``x``: an int when static, else a scalar int64 Var."""
    static = x.static_shape
    if static is not None:
        return int(np.prod(static, dtype=np.int64))
    return g.ReduceProd(g.shape_of(x), keepdims=0, dtype=INT64, shape=())


def _positions(g: GradBuilder, x: Var) -> Var:
    """An int64 tensor of ``x``'s shape holding each element's flat position."""
    n = _numel(g, x)
    end = g.const(np.int64(n)) if isinstance(n, int) else n
    flat = g.Range(g.const(np.int64(0)), end, g.const(np.int64(1)))
    return g.Reshape(flat, g.shape_of(x), dtype=INT64)


def _scatter_positions(g: GradBuilder, x: Var, pos: Var, dy: Var, accumulate: bool) -> Var:
    """dx with dx.flat[pos[i]] (+)= dy[i], ``pos`` being ``_positions(x)`` moved like x was."""
    n = _numel(g, x)
    flat_shape = g.const(np.array([n], dtype=np.int64)) if isinstance(n, int) else g.Reshape(n, [1])
    flat = g.ScatterElements(
        _zeros(g, flat_shape, dy.dtype),
        g.Reshape(pos, [-1]),
        g.Reshape(dy, [-1]),
        axis=0,
        reduction="add" if accumulate else None,
    )
    return g.reshape(flat, x)


def _as_int64(g: GradBuilder, idx: Var) -> Var:
    return idx if idx.dtype == INT64 else g.Cast(idx, to=INT64)


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
    idx = _as_int64(g, n.inputs[1])  # type: ignore[arg-type]
    size = g.const(np.int64(dim)) if isinstance(dim, int) else g.Squeeze(dim, [0])
    return where(idx < g.const(np.int64(0)), idx + size, idx)


def _perm_inverse(perm: Sequence[int]) -> list[int]:
    return [int(i) for i in np.argsort(perm)]


# ---- reshapes and permutations ---------------------------------------------------------------
@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(g: GradBuilder, n: NodeContext) -> Grads:
    """Same elements, another shape: dx = reshape(dy, shape(x))."""
    return _first_only(n, g.reshape(n.dy, n.x))


@rule("Transpose")
def transpose(g: GradBuilder, n: NodeContext) -> Grads:
    """y = transpose(x, p): dx = transpose(dy, p^-1); the default p (reversal) is self-inverse."""
    perm = n.attr("perm")
    if perm is None:
        return [g.Transpose(n.dy, shape=n.x.shape)]
    return [g.Transpose(n.dy, perm=_perm_inverse(perm), shape=n.x.shape)]


@rule("DepthToSpace")
def depth_to_space(g: GradBuilder, n: NodeContext) -> Grads:
    """A permutation of elements: dx is dy moved back (SpaceToDepth undoes DCR mode exactly)."""
    b = int(n.attr("blocksize"))
    if n.attr("mode", "DCR") == "DCR":
        return [g.SpaceToDepth(n.dy, blocksize=b, shape=n.x.shape)]
    # CRD: x viewed as (N, C', b, b, H, W) was transposed to (N, C', H, b, W, b); undo that.
    x = n.x
    dy6 = g.Reshape(n.dy, g.shape_vector([0, 0, g.dim(x, 2), b, g.dim(x, 3), b]))
    return [g.reshape(g.Transpose(dy6, perm=[0, 1, 3, 5, 2, 4]), x)]


@rule("SpaceToDepth")
def space_to_depth(g: GradBuilder, n: NodeContext) -> Grads:
    """The inverse permutation of DepthToSpace in the same mode: dx = DepthToSpace(dy, mode).

    ``mode`` came to SpaceToDepth at opset 28 (DCR before); its CRD order moves x viewed as
    (N, C, H', b, W', b) to (N, C, b, b, H', W'), which DepthToSpace's CRD mode undoes.
    """
    b = int(n.attr("blocksize"))
    mode = str(n.attr("mode", "DCR"))
    return [g.DepthToSpace(n.dy, blocksize=b, mode=mode, shape=n.x.shape)]


# ---- joining and splitting ---------------------------------------------------------------------
@rule("Concat")
def concat(g: GradBuilder, n: NodeContext) -> Grads:
    """y = concat(x_0, x_1, ...): dx_i is the piece of dy that x_i filled (one Split)."""
    axis = int(n.attr("axis", 1))  # optional, default 1, before opset 4
    if len(n.inputs) == 1:
        return [n.dy]
    sizes = [g.dim(x, axis) for x in n.inputs]  # type: ignore[arg-type]
    parts = g.Split(n.dy, g.shape_vector(sizes), axis=axis, outputs=len(sizes))
    return [p if need else None for p, need in zip(parts, n.needs)]


@rule("Split")
def split(g: GradBuilder, n: NodeContext) -> Grads:
    """y_0, y_1, ... = split(x): dx = concat(dy_0, dy_1, ...), zeros for outputs without grad.

    The same for every form of the sizes (attribute, input, ``num_outputs``): only the axis matters.
    """
    douts = [n.dout_or_zeros(i) for i in range(len(n.outputs))]
    dx = douts[0] if len(douts) == 1 else g.Concat(*douts, axis=int(n.attr("axis", 0)))
    return _first_only(n, dx)


# ---- picking elements by position --------------------------------------------------------------
def _slice_params(n: NodeContext) -> tuple[list[np.ndarray | None], list[Var | None]]:
    """Starts, ends, axes, steps of a Slice: constant values (None if not known before running)
    and the forward inputs (None when absent or given as attributes, before opset 10)."""
    if n.opset < 10:  # attributes, no steps
        values = [n.attr("starts"), n.attr("ends"), n.attr("axes"), None]
        return [None if v is None else np.asarray(v, dtype=np.int64) for v in values], [None] * 4
    consts = [n.const_input(i) for i in range(1, 5)]
    return consts, [n.inputs[i] if i < len(n.inputs) else None for i in range(1, 5)]


def _slice_pads(n: NodeContext, consts: list[np.ndarray | None], vars_: list[Var | None]) -> list[int] | None:
    """Pads that undo a unit-step Slice with constant bounds on static dims; None otherwise."""
    starts, ends, axes, steps = consts
    x = n.x
    if starts is None or ends is None or x.rank is None:
        return None
    if (vars_[2] is not None and axes is None) or (vars_[3] is not None and steps is None):
        return None
    if steps is not None and np.any(steps != 1):
        return None
    rank = x.rank
    axes = np.arange(len(starts)) if axes is None else axes
    pads = [0] * (2 * rank)
    for start, end, axis in zip(starts.tolist(), ends.tolist(), axes.tolist()):
        axis = axis + rank if axis < 0 else axis
        dim = x.shape[axis]  # type: ignore[index]
        if not isinstance(dim, int):
            return None
        start = min(max(start + dim if start < 0 else start, 0), dim)
        end = min(max(end + dim if end < 0 else end, 0), dim)
        pads[axis] = start
        pads[rank + axis] = dim - start - max(end - start, 0)
    return pads


@rule("Slice")
def slice_(g: GradBuilder, n: NodeContext) -> Grads:
    """y = x[starts:ends:steps] on some axes: dx is dy put back in place, zeros elsewhere.

    Unit steps with known bounds pad dy back; anything else (negative or large steps, bounds known
    only at run time) replays the Slice on the flat positions of x and scatters dy there.
    """
    if not n.needs[0]:
        return _first_only(n, None)
    consts, vars_ = _slice_params(n)
    pads = _slice_pads(n, consts, vars_)
    if pads is not None:
        return _first_only(n, g.Pad(n.dy, pads, shape=n.x.shape))
    params = [v if c is None else g.const(c) for c, v in zip(consts, vars_)]
    pos = g.Slice(_positions(g, n.x), *params, dtype=INT64)
    return _first_only(n, _scatter_positions(g, n.x, pos, n.dy, accumulate=False))


@rule("Gather")
def gather(g: GradBuilder, n: NodeContext) -> Grads:
    """y = take(x, idx, axis): dx[.., idx[j], ..] += dy[.., j, ..] (repeated indices add up).

    ScatterND adds along the leading axis, so dy's index dims move to the front and back.
    """
    if not n.needs[0]:
        return [None, None]
    x, idx = n.inputs[0], n.inputs[1]
    r = _need_rank(n, x)  # type: ignore[arg-type]
    q = _need_rank(n, idx)  # type: ignore[arg-type]
    axis = _axis(n, int(n.attr("axis", 0)), r)
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
    dx = g.ScatterND(_zeros(g, zshape, dy.dtype), indices, dy, reduction="add")
    if axis:
        dx = g.Transpose(dx, perm=_perm_inverse(front))
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


# ---- broadcasting, selection, clamping ---------------------------------------------------------
@rule("Expand")
def expand(g: GradBuilder, n: NodeContext) -> Grads:
    """y = broadcast(x, shape): dx = dy summed over the broadcast axes."""
    return _first_only(n, g.unbroadcast(n.dy, n.x, n.y.shape))


@rule("Tile")
def tile(g: GradBuilder, n: NodeContext) -> Grads:
    """y = tile(x, r): view dy as (r0, d0, r1, d1, ...) and sum over the r axes.

    Repeats known at build time skip the axes repeated once; repeats computed at run time
    interleave with x's shape into the view's shape, and every r axis is summed.
    """
    if not n.needs[0]:
        return _first_only(n, None)
    if n.opset < 6:
        raise GradientNotImplementedError(f"Tile {n.node.name!r}: no rule for Tile-1 (opset < 6)")
    repeats = n.const_input(1)
    x = n.x
    if repeats is None:
        if x.rank is None:
            raise GradientNotImplementedError(
                f"Tile {n.node.name!r}: run-time repeats need the rank of the input to be known"
            )
        if x.rank == 0:
            return _first_only(n, n.dy)
        column = g.const(np.array([1], dtype=np.int64))
        reps = g.Unsqueeze(_as_int64(g, n.inputs[1]), column)  # type: ignore[arg-type]
        dims = g.Unsqueeze(g.shape_of(x), column)
        view = g.Reshape(g.Concat(reps, dims, axis=1), g.const(np.array([-1], dtype=np.int64)))
        grouped = g.Reshape(n.dy, view)
        return _first_only(n, g.reduce_sum(grouped, list(range(0, 2 * x.rank, 2)), keepdims=False))
    if np.all(repeats == 1):
        return _first_only(n, n.dy)
    parts: list[int | Var] = []
    sum_axes: list[int] = []
    for i, r in enumerate(repeats.tolist()):
        if r != 1:  # axes repeated once need no reduction
            sum_axes.append(len(parts))
            parts.append(int(r))
        parts.append(g.dim(x, i))
    grouped = g.Reshape(n.dy, g.shape_vector(parts))
    return _first_only(n, g.reduce_sum(grouped, sum_axes, keepdims=False))


@rule("Cast", "CastLike")
def cast_(g: GradBuilder, n: NodeContext) -> Grads:
    """A change of element type: dx = dy cast back to x's type (none for integer x)."""
    if n.x.dtype not in FLOAT_TYPES:
        return _first_only(n, None)
    return _first_only(n, cast(n.dy, n.x))


@rule("Where")
def where_(g: GradBuilder, n: NodeContext) -> Grads:
    """y = cond ? a : b: da = dy where cond, db = dy elsewhere, both un-broadcast; none for cond."""
    cond, a, b = n.inputs
    grads: Grads = [None, None, None]
    if n.needs[1]:
        grads[1] = g.unbroadcast(where(cond, n.dy, 0), a, n.y.shape)  # type: ignore[arg-type]
    if n.needs[2]:
        grads[2] = g.unbroadcast(where(cond, 0, n.dy), b, n.y.shape)  # type: ignore[arg-type]
    return grads


def _sum_to(g: GradBuilder, t: Var, like: Var) -> Var:
    """``t`` summed over every axis, shaped like the scalar-ish ``like`` (a Clip bound)."""
    total = g.ReduceSum(t, keepdims=0, shape=())
    return total if like.shape == () else g.reshape(total, like)


@rule("Clip")
def clip(g: GradBuilder, n: NodeContext) -> Grads:
    """y = min(max(x, lo), hi): dx = dy where lo <= x <= hi (inclusive, as torch.clamp);
    dlo = sum(dy where x < lo), dhi = sum(dy where x > hi)."""
    x, dy = n.x, n.dy
    if n.opset < 11:  # bounds are attributes
        lo_a, hi_a = n.attr("min"), n.attr("max")
        lo = None if lo_a is None else g.const(lo_a, x.dtype)
        hi = None if hi_a is None else g.const(hi_a, x.dtype)
    else:
        lo = n.inputs[1] if len(n.inputs) > 1 else None
        hi = n.inputs[2] if len(n.inputs) > 2 else None
    grads: Grads = [None] * len(n.inputs)
    if n.needs[0]:
        inside = [x >= lo] if lo is not None else []
        inside += [x <= hi] if hi is not None else []
        mask = g.And(*inside) if len(inside) == 2 else inside[0] if inside else None
        grads[0] = dy if mask is None else where(mask, dy, 0)
    if lo is not None and n.opset >= 11 and n.needs[1]:
        grads[1] = _sum_to(g, where(x < lo, dy, 0), lo)
    if hi is not None and n.opset >= 11 and n.needs[2]:
        grads[2] = _sum_to(g, where(x > hi, dy, 0), hi)
    return grads


# ---- padding -----------------------------------------------------------------------------------
@rule("Pad")
def pad(g: GradBuilder, n: NodeContext) -> Grads:
    """Constant mode: y = pad(x, p), so dx = pad(dy, -p) (negative pads crop, positive ones
    restore what the forward cropped) and d(value) = sum(dy) - sum(dx).
    Reflect, edge and wrap: replay the Pad on x's flat positions and scatter-add dy there."""
    mode = n.attr("mode", "constant")
    axes: Var | None = None
    if n.opset < 11:  # pads as attribute ("paddings" in Pad-1)
        pads_c = np.asarray(n.attr("pads", n.attr("paddings")), dtype=np.int64)
        pads, value = None, None
    else:
        pads_c, pads = n.const_input(1), n.inputs[1]
        value = n.inputs[2] if len(n.inputs) > 2 else None
        axes = n.inputs[3] if len(n.inputs) > 3 else None
    grads: Grads = [None] * len(n.inputs)
    if mode == "constant":
        neg = g.const(-pads_c) if pads_c is not None else -pads  # type: ignore[operator]
        dx = g.Pad(n.dy, neg, None, axes, shape=n.x.shape)
        grads[0] = dx if n.needs[0] else None
        if value is not None and n.needs[2]:  # the padding value fills what x did not
            filled = g.ReduceSum(n.dy, keepdims=0) - g.ReduceSum(dx, keepdims=0)
            grads[2] = _sum_to(g, filled, value)
        return grads
    if n.needs[0]:
        pads_v = pads if pads_c is None else g.const(pads_c)
        pos = g.Pad(_positions(g, n.x), pads_v, None, axes, mode=mode, dtype=INT64)
        grads[0] = _scatter_positions(g, n.x, pos, n.dy, accumulate=True)
    return grads
