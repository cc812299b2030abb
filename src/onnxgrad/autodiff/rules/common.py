"""What several rule modules share: error messages, optional inputs, axes, zeros, flat positions,
and the window geometry of convolutions and pooling.

Rule modules import these and the builder, the registry and the model layer, never each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import GradientNotImplementedError
from ...model.graph import Dim
from ..builder import INT64, GradBuilder, Var, zero_tensor
from ..registry import NodeContext

Grads = list[Var | None]  # what a rule returns: one gradient (or None) per input


# ---- messages and inputs ---------------------------------------------------------------------
def node_label(n: NodeContext) -> str:
    """``"Op node 'name'"``, to start error messages with."""
    return f"{n.node.op_type} node {n.node.name!r}"


def refuse(n: NodeContext, reason: str) -> GradientNotImplementedError:
    """The error a rule raises for a node it cannot differentiate, saying why."""
    return GradientNotImplementedError(
        f"no gradient for node {n.node.name!r} (op {n.node.op_type!r}): {reason}"
    )


def optional_input(n: NodeContext, i: int) -> Var | None:
    """Input ``i`` of the node, None when absent (past the end or empty)."""
    return n.inputs[i] if i < len(n.inputs) else None


def first_only(n: NodeContext, dx: Var | None) -> Grads:
    """``dx`` for input 0 (when needed), nothing for the other (shape, index...) inputs."""
    return [dx if n.needs[0] else None] + [None] * (len(n.inputs) - 1)


# ---- axes and shapes ---------------------------------------------------------------------------
def nonneg_axis(n: NodeContext, axis: int, rank: int | None) -> int:
    """``axis`` made non-negative; needs the rank only when ``axis`` is negative."""
    if axis >= 0:
        return axis
    if rank is None:
        raise GradientNotImplementedError(
            f"{n.node.op_type} {n.node.name!r}: negative axis {axis} needs the input rank"
        )
    return axis + rank


def need_rank(n: NodeContext, x: Var) -> int:
    """The rank of ``x``, which the rule of ``n`` cannot do without."""
    if x.rank is None:
        raise GradientNotImplementedError(
            f"{n.node.op_type} {n.node.name!r}: the rank of input {x.name!r} must be known"
        )
    return x.rank


def perm_inverse(perm: Sequence[int]) -> list[int]:
    """The permutation that undoes the Transpose by ``perm``."""
    return [int(i) for i in np.argsort(perm)]


def as_int64(g: GradBuilder, idx: Var) -> Var:
    """``idx`` cast to int64 where it is not already."""
    return idx if idx.dtype == INT64 else g.Cast(idx, to=INT64)


# ---- zeros, sums and flat positions ----------------------------------------------------------
def zeros(g: GradBuilder, shape: Var, dtype: int) -> Var:
    """Zeros of run-time ``shape`` and element type ``dtype``."""
    return g.ConstantOfShape(shape, value=zero_tensor(dtype), dtype=dtype)


def sum_to_scalar(g: GradBuilder, t: Var, like: Var) -> Var:
    """``t`` summed over every axis, shaped like the scalar-ish ``like`` (a Clip bound, a Pad value)."""
    total = g.ReduceSum(t, keepdims=0, shape=())
    return total if like.shape == () else g.reshape(total, like)


def numel(g: GradBuilder, x: Var) -> int | Var:
    """Number of elements of ``x``: an int when static, else a scalar int64 Var."""
    static = x.static_shape
    if static is not None:
        return int(np.prod(static, dtype=np.int64))
    return g.ReduceProd(g.shape_of(x), keepdims=0, dtype=INT64, shape=())


def positions(g: GradBuilder, x: Var) -> Var:
    """An int64 tensor of ``x``'s shape holding each element's flat position."""
    n = numel(g, x)
    end = g.const(np.int64(n)) if isinstance(n, int) else n
    flat = g.Range(g.const(np.int64(0)), end, g.const(np.int64(1)))
    return g.Reshape(flat, g.shape_of(x), dtype=INT64)


def scatter_positions(g: GradBuilder, x: Var, pos: Var, dy: Var, accumulate: bool) -> Var:
    """dx with dx.flat[pos[i]] (+)= dy[i], ``pos`` being :func:`positions` of x moved like x was."""
    n = numel(g, x)
    flat_shape = g.const(np.array([n], dtype=np.int64)) if isinstance(n, int) else g.Reshape(n, [1])
    flat = g.ScatterElements(
        zeros(g, flat_shape, dy.dtype),
        g.Reshape(pos, [-1]),
        g.Reshape(dy, [-1]),
        axis=0,
        reduction="add" if accumulate else None,
    )
    return g.reshape(flat, x)


def max_grad(g: GradBuilder, x: Var, y_kept: Var, dy_kept: Var, count: Callable[[Var], Var]) -> Var:
    """Gradient of a max/min, split evenly among tied extrema (as ``torch.amax``).

    ``y_kept`` and ``dy_kept`` are aligned with ``x``; ``count`` sums a mask over the reduced axes.
    """
    mask = g.Cast(g.Equal(x, y_kept), to=x.dtype)
    return mask * (dy_kept / count(mask))


# ---- sliding windows (convolution and pooling) -------------------------------------------------
def spatial_rank(n: NodeContext, *values: Var | None) -> int:
    """Number of spatial dims: from ``kernel_shape``, else from the rank of any known value."""
    kernel = n.attr("kernel_shape")
    if kernel:
        return len(kernel)
    for v in values:
        if v is not None and v.rank is not None:
            return v.rank - 2
    raise GradientNotImplementedError(f"{node_label(n)}: the rank of its input must be known")


def spatial_dims(x: Var, nsp: int) -> list[Dim]:
    """The ``nsp`` spatial dims of an (N, C, spatial...) value (None where unknown)."""
    return list(x.shape[2:]) if x.shape is not None else [None] * nsp


def static_dims(dims: list[Dim]) -> list[int] | None:
    """``dims`` as ints when every one is static, else None."""
    return [int(d) for d in dims] if all(isinstance(d, int) for d in dims) else None  # type: ignore[arg-type]


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
        """The geometry as Conv / ConvTranspose attributes."""
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
