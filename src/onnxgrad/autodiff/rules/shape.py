"""Shape and layout ops: reshapes, transposes, joining and splitting, slicing, broadcasting,
tiling, padding, cropping and reversing (gathers are in ``indexing.py``, casts in ``elementwise.py``).

Every rule here moves ``dy`` back to where its elements came from. Three patterns recur:

* a pure reshape or permutation is undone by its inverse (Reshape, Transpose, DepthToSpace);
* an op that picks a block of elements is transposed by putting ``dy`` back in place (Slice with
  unit steps pads it back; CenterCropPad crops or pads it back);
* ops with an awkward index pattern (Pad with reflect/edge/wrap, Slice with general steps) are
  replayed on a tensor of flat positions ``0..size(x)-1``, which tells, for every output element,
  which input element it came from; ``dy`` is then scatter-added there.

Sizes come from static shapes when known and from saved ``Shape`` tensors otherwise, so the rules
never save a data tensor just to learn its shape.
"""

from __future__ import annotations

import numpy as np

from ...errors import GradientNotImplementedError
from ..builder import INT64, GradBuilder, Var
from ..registry import NodeContext, rule
from .common import (
    Grads,
    as_int64,
    first_only,
    nonneg_axis,
    perm_inverse,
    positions,
    scatter_positions,
    sum_to_scalar,
)


# ---- reshapes and permutations ---------------------------------------------------------------
@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(g: GradBuilder, n: NodeContext) -> Grads:
    """Same elements, another shape: dx = reshape(dy, shape(x))."""
    return first_only(n, g.reshape(n.dy, n.x))


@rule("Transpose")
def transpose(g: GradBuilder, n: NodeContext) -> Grads:
    """y = transpose(x, p): dx = transpose(dy, p^-1); the default p (reversal) is self-inverse."""
    perm = n.attr("perm")
    if perm is None:
        return [g.Transpose(n.dy, shape=n.x.shape)]
    return [g.Transpose(n.dy, perm=perm_inverse(perm), shape=n.x.shape)]


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
    return first_only(n, dx)


# ---- slicing ---------------------------------------------------------------------------------
def _slice_params(n: NodeContext) -> tuple[list[np.ndarray | None], Grads]:
    """Starts, ends, axes, steps of a Slice: constant values (None if not known before running)
    and the forward inputs (None when absent or given as attributes, before opset 10)."""
    if n.opset < 10:  # attributes, no steps
        values = [n.attr("starts"), n.attr("ends"), n.attr("axes"), None]
        return [None if v is None else np.asarray(v, dtype=np.int64) for v in values], [None] * 4
    consts = [n.const_input(i) for i in range(1, 5)]
    return consts, [n.inputs[i] if i < len(n.inputs) else None for i in range(1, 5)]


def _slice_pads(n: NodeContext, consts: list[np.ndarray | None], vars_: Grads) -> list[int] | None:
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
        return first_only(n, None)
    consts, vars_ = _slice_params(n)
    pads = _slice_pads(n, consts, vars_)
    if pads is not None:
        return first_only(n, g.Pad(n.dy, pads, shape=n.x.shape))
    params = [v if c is None else g.const(c) for c, v in zip(consts, vars_)]
    pos = g.Slice(positions(g, n.x), *params, dtype=INT64)
    return first_only(n, scatter_positions(g, n.x, pos, n.dy, accumulate=False))


# ---- broadcasting and tiling -----------------------------------------------------------------
@rule("Expand")
def expand(g: GradBuilder, n: NodeContext) -> Grads:
    """y = broadcast(x, shape): dx = dy summed over the broadcast axes."""
    return first_only(n, g.unbroadcast(n.dy, n.x, n.y.shape))


@rule("Tile")
def tile(g: GradBuilder, n: NodeContext) -> Grads:
    """y = tile(x, r): view dy as (r0, d0, r1, d1, ...) and sum over the r axes.

    Repeats known at build time skip the axes repeated once; repeats computed at run time
    interleave with x's shape into the view's shape, and every r axis is summed.
    """
    if not n.needs[0]:
        return first_only(n, None)
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
            return first_only(n, n.dy)
        column = g.const(np.array([1], dtype=np.int64))
        reps = g.Unsqueeze(as_int64(g, n.inputs[1]), column)  # type: ignore[arg-type]
        dims = g.Unsqueeze(g.shape_of(x), column)
        view = g.Reshape(g.Concat(reps, dims, axis=1), g.const(np.array([-1], dtype=np.int64)))
        grouped = g.Reshape(n.dy, view)
        return first_only(n, g.reduce_sum(grouped, list(range(0, 2 * x.rank, 2)), keepdims=False))
    if np.all(repeats == 1):
        return first_only(n, n.dy)
    parts: list[int | Var] = []
    sum_axes: list[int] = []
    for i, r in enumerate(repeats.tolist()):
        if r != 1:  # axes repeated once need no reduction
            sum_axes.append(len(parts))
            parts.append(int(r))
        parts.append(g.dim(x, i))
    grouped = g.Reshape(n.dy, g.shape_vector(parts))
    return first_only(n, g.reduce_sum(grouped, sum_axes, keepdims=False))


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
            grads[2] = sum_to_scalar(g, filled, value)
        return grads
    if n.needs[0]:
        pads_v = pads if pads_c is None else g.const(pads_c)
        pos = g.Pad(positions(g, n.x), pads_v, None, axes, mode=mode, dtype=INT64)
        grads[0] = scatter_positions(g, n.x, pos, n.dy, accumulate=True)
    return grads


# ---- crops and reversals ---------------------------------------------------------------------
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
    return first_only(n, dx)


@rule("CenterCropPad", since=18)
def center_crop_pad(g: GradBuilder, n: NodeContext) -> Grads:
    """Cropping by (d - t) // 2 in front is undone by padding (d - t) // 2 in front, and the other
    way round: dx = CenterCropPad(dy, shape of x on the same axes)."""
    if not n.needs[0]:
        return first_only(n, None)
    x = n.x
    axes = n.attr("axes")
    shape = g.shape_of(x)
    if axes is not None:
        rank = x.rank if any(a < 0 for a in axes) else None
        shape = g.Gather(shape, [nonneg_axis(n, int(a), rank) for a in axes], dtype=INT64)
    return first_only(n, g.CenterCropPad(n.dy, shape, axes=axes, shape=x.shape))


@rule("Range", since=11)
def range_(g: GradBuilder, n: NodeContext) -> Grads:
    """y[i] = start + i delta for i < max(ceil((limit - start) / delta), 0): d start = sum dy,
    d delta = sum i dy; the limit only sets the length (none). Integer ranges (shapes) carry none."""
    dy = n.dy
    grads: Grads = [None, None, None]
    if n.needs[0]:
        grads[0] = sum_to_scalar(g, dy, n.inputs[0])
    if n.needs[2]:
        i = g.Cast(g.Range(g.const(np.int64(0)), g.Size(dy), g.const(np.int64(1))), to=dy.dtype)
        grads[2] = sum_to_scalar(g, dy * i, n.inputs[2])
    return grads
