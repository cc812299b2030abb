"""What several rule modules share: error messages, optional inputs, axes, zeros, flat positions,
the window geometry of convolutions and pooling, and the ``Scan`` loops a backward runs.

Rule modules import these and the builder, the registry and the model layer, never each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ...errors import GradientNotImplementedError
from ...model.graph import Dim
from ..builder import INT64, GradBuilder, Var, zero_tensor
from ..registry import NodeContext

Grads = list[Var | None]  # what a rule returns: one gradient (or None) per input
_INT64_MIN = int(np.iinfo(np.int64).min)  # Slice end meaning "before the first element"
_INT64_MAX = int(np.iinfo(np.int64).max)  # Slice end meaning "to the end"


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
    """The rank of ``x``, which the rule of ``n`` cannot do without.

    Unknown, the error names the node and the producer (op, domain) whose output type inference
    could not tell: an op that ONNX shape inference does not know, usually.
    """
    if x.rank is None:
        producer = n.g.producers.get(x.name)
        source = (
            f"; it is the output of node {producer.name!r} (op {producer.op_type!r}, domain "
            f"{producer.domain or 'ai.onnx'!r}), whose output rank shape inference could not tell"
            if producer is not None
            else ""
        )
        raise GradientNotImplementedError(
            f"{n.node.op_type} {n.node.name!r}: the rank of input {x.name!r} must be known{source}"
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


def window_of(
    n: NodeContext, nsp: int, kernel: list[int] | None, spatial: list[Dim], *, unpadded: bool = False
) -> Window:
    """Strides, dilations and pads of ``n``; SAME_* pads are computed from static sizes.

    SAME pads total ``max((ceil(H / s) - 1) s + extent - H, 0)``, split with the extra one at the
    end (SAME_UPPER) or the beginning (SAME_LOWER); with stride 1 that is ``extent - 1`` whatever H.
    ``unpadded``: no pads whatever the node says (for a rule that pads X itself).
    """
    strides = tuple(int(s) for s in (n.attr("strides") or [1] * nsp))
    dilations = tuple(int(d) for d in (n.attr("dilations") or [1] * nsp))
    auto_pad = n.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad == "VALID" or unpadded:
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


def same_pads_at_run_time(n: NodeContext, kernel: list[int] | None, spatial: list[Dim]) -> bool:
    """Whether ``n`` has SAME ``auto_pad`` pads that depend on sizes known only at run time: a
    strided axis whose size is not static (with the kernel known; :func:`window_of` refuses the rest)."""
    auto_pad = n.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER") or kernel is None:
        return False
    strides = [int(s) for s in (n.attr("strides") or [1] * len(spatial))]
    return any(s != 1 and not isinstance(h, int) for s, h in zip(strides, spatial))


def run_time_same_pads(g: GradBuilder, n: NodeContext, x: Var, kernel: list[int]) -> tuple[Var, Var]:
    """The SAME pads of ``n`` from X's run-time sizes H, as 1-D int64 begins and ends: in total
    ``max((ceil(H / s) - 1) s + extent - H, 0)``, the odd one at the end (SAME_UPPER) or at the
    beginning (SAME_LOWER), as :func:`window_of` computes them from static sizes."""
    nsp = len(kernel)
    strides = np.array([int(s) for s in (n.attr("strides") or [1] * nsp)], dtype=np.int64)
    dilations = np.array([int(d) for d in (n.attr("dilations") or [1] * nsp)], dtype=np.int64)
    extent = (np.array(kernel, dtype=np.int64) - 1) * dilations + 1
    size = g.Slice(g.shape_of(x), [2], [2 + nsp])
    rows = g.Div(g.Add(size, g.const(strides - 1)), g.const(strides))  # ceil(H / s)
    total = g.Max(
        g.Sub(g.Add(g.Mul(rows, g.const(strides)), g.const(extent - strides)), size),
        g.const(np.zeros(nsp, dtype=np.int64)),
    )
    small = g.Div(total, g.const(np.full(nsp, 2, dtype=np.int64)))
    begins = small if n.attr("auto_pad") == "SAME_UPPER" else g.Sub(total, small)
    return begins, g.Sub(total, begins)


def pad_at_run_time(g: GradBuilder, x: Var, begins: Var, ends: Var) -> Var:
    """X (N, C, spatial...) padded with zeros by run-time spatial ``begins`` and ``ends`` (1-D int64)."""
    edge = g.const(np.zeros(2, dtype=np.int64))
    return g.Pad(x, g.Concat(edge, begins, edge, ends, axis=0))


def unpad_at_run_time(g: GradBuilder, t: Var, begins: Var, x: Var, nsp: int) -> Var:
    """X's part of ``t``, the gradient of X padded by :func:`pad_at_run_time` with ``begins``."""
    size = g.Slice(g.shape_of(x), [2], [2 + nsp])
    return g.Slice(t, begins, g.Add(begins, size), list(range(2, 2 + nsp)), shape=x.shape)


def fit_spatial(
    g: GradBuilder, t: Var, size: Var, nsp: int, crop: bool = True, shape: tuple[Dim, ...] | None = None
) -> Var:
    """``t`` (N, C, ``nsp`` spatial axes) made the run-time spatial ``size`` (1-D int64): its rows
    past ``size`` cut (``crop``; False when the caller knows of none), its missing last rows filled
    with zeros; ``shape``: the result's, when known.

    The backward of a strided window op made with ConvTranspose starts at X's first row and ends
    at the last row a window reaches, which may lie before X's end (rows no window read) or past
    it (in the end padding, or a window ceil mode let run over).
    """
    axes = list(range(2, 2 + nsp))
    zero = g.const(np.zeros(nsp, dtype=np.int64))
    if crop:
        t = g.Slice(t, zero, size, axes)
    missing = g.Sub(size, g.Slice(g.Shape(t), [2], [_INT64_MAX]))
    return g.Pad(t, g.Concat(zero, missing, axis=0), None, axes, shape=shape)


# ---- Scan loops of the backward ----------------------------------------------------------------
def flip(g: GradBuilder, x: Var) -> Var:
    """``x`` reversed along axis 0."""
    return g.Slice(x, [-1], [_INT64_MIN], [0], [-1], shape=x.shape)


def _body_input(body: GradBuilder, like: Var, hint: str, rank: int | None) -> Var:
    """A new input of the Scan body ``body``, of the dtype of ``like`` and (when known) rank ``rank``."""
    return Var(body, body.fresh(hint), like.dtype, None if rank is None else (None,) * rank)


StepFn = Callable[[GradBuilder, list[Var], list[Var]], tuple[list[Var], list[Var]]]


def scan(
    g: GradBuilder,
    init: Sequence[Var],
    seqs: Sequence[Var],
    step: StepFn,
    *,
    backward: bool = False,
    rank: int | None = None,
    out_ranks: Sequence[int] | None = None,
    portable: bool = True,
) -> tuple[list[Var], list[Var]]:
    """One ``Scan`` of the backward over axis 0 of ``seqs`` (last step first when ``backward``),
    carrying states that start as ``init``.

    ``step(body, states, slices) -> (new states, per-step outputs)`` builds the body in ``body``, a
    child scope of ``g`` (it reads the values of g by name; its constants are its own initializers),
    from Vars of the states and of one step's slices of ``seqs``. Returns the final states and the
    stacked per-step outputs (in time order either way). Backwards, the sequences and the stacked
    outputs are flipped explicitly, as onnx.reference does not implement Scan's directions; with
    ``portable=False`` the Scan runs them backwards itself (``scan_input_directions``), which
    saves onnxruntime a copy of each.

    onnxruntime wants the rank of every body value declared: a state's is that of its ``init``, a
    slice's one less than its sequence's, a per-step output's that of ``out_ranks`` (when given) or
    of its Var; ``rank`` stands for any of these that is not known. The Vars returned carry the
    ranks declared (one more for the stacked outputs).
    """

    def known(r: int | None) -> int | None:
        return r if r is not None else rank

    flips = backward and portable
    if flips:
        seqs = [flip(g, s) for s in seqs]
    body = g.child()
    state_ranks = [known(s.rank) for s in init]
    slice_ranks = [known(None if s.rank is None else s.rank - 1) for s in seqs]
    states = [_body_input(body, s, "state", r) for s, r in zip(init, state_ranks)]
    slices = [_body_input(body, s, "step", r) for s, r in zip(seqs, slice_ranks)]
    new_states, outs = step(body, states, slices)
    assert len(new_states) == len(init) and (out_ranks is None or len(out_ranks) == len(outs))
    assert not body.saved and not body.fwd_nodes  # the forward values it reads are g's to save
    step_ranks = list(out_ranks) if out_ranks is not None else [known(v.rank) for v in outs]
    results: list[Var] = []
    body_inputs = {v.name for v in [*states, *slices]}
    for v in [*new_states, *outs]:  # a body output must be a fresh name of its own
        if v.name in body_inputs or v.name in {r.name for r in results}:
            v = body.Identity(v)
        results.append(v)

    def info(v: Var, r: int | None) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(v.name, v.dtype, None if r is None else [None] * r)

    graph = helper.make_graph(
        body.nodes,
        g.fresh("scan_body"),
        [info(v, r) for v, r in zip([*states, *slices], [*state_ranks, *slice_ranks])],
        [info(v, r) for v, r in zip(results, [*state_ranks, *step_ranks])],
        initializer=list(body.initializers.values()),
    )
    directions: dict[str, list[int]] = {}
    if backward and not portable:
        directions = {"scan_input_directions": [1] * len(seqs), "scan_output_directions": [1] * len(outs)}
    produced = g.op(
        "Scan", *init, *seqs, outputs=len(results), body=graph, num_scan_inputs=len(seqs), **directions
    )
    produced = list(produced) if isinstance(produced, tuple) else [produced]
    out_ranks_all = [*state_ranks, *(None if r is None else r + 1 for r in step_ranks)]
    produced = [
        v if r is None else Var(g, v.name, v.dtype, (None,) * r) for v, r in zip(produced, out_ranks_all)
    ]
    finals, stacked = produced[: len(init)], produced[len(init) :]
    if flips:
        stacked = [flip(g, s) for s in stacked]
    return finals, stacked


# ---- refusals of optional inputs, attributes and outputs ----------------------------------------
def unsupported(n: NodeContext, i: int, why: str) -> GradientNotImplementedError:
    """The error for float input ``i`` of a contrib node whose gradient the rule does not give."""
    name = n.node.input[i] if i < len(n.node.input) else f"#{i}"
    return GradientNotImplementedError(
        f"no gradient for input {i} ({name!r}) of node {n.node.name!r}: op {n.node.op_type!r}, "
        f"domain {n.node.domain or 'ai.onnx'!r}: {why}. Mark it as not trainable."
    )


def refuse_output_grads(n: NodeContext, slots: tuple[int, ...], what: str) -> None:
    for k in slots:
        if k < len(n.dout) and n.dout[k] is not None:
            raise GradientNotImplementedError(
                f"no gradient through output {k} ({n.node.output[k]!r}, {what}) of node {n.node.name!r}: "
                f"op {n.node.op_type!r}, domain {n.node.domain or 'ai.onnx'!r}"
            )


def refuse_inputs(n: NodeContext, slots: dict[int, str]) -> None:
    """Refuse a node that has any of these optional inputs (slot -> what the rule does not cover)."""
    for slot, what in slots.items():
        if slot < len(n.node.input) and n.node.input[slot]:
            raise GradientNotImplementedError(
                f"no gradient for node {n.node.name!r}: op {n.node.op_type!r}, domain "
                f"{n.node.domain or 'ai.onnx'!r}: input {slot} ({what}) is not supported"
            )


def refuse_attrs(n: NodeContext, attrs: dict[str, object]) -> None:
    """Refuse a node whose attribute differs from the value the rule covers."""
    for name, default in attrs.items():
        if n.attr(name, default) != default:
            raise GradientNotImplementedError(
                f"no gradient for node {n.node.name!r}: op {n.node.op_type!r}, domain "
                f"{n.node.domain or 'ai.onnx'!r}: {name}={n.attr(name)!r} is not supported"
            )


# ---- matrices --------------------------------------------------------------------------------------
def swap_last(g: GradBuilder, x: Var, rank: int) -> Var:
    """x (of rank ``rank``) with its last two axes swapped."""
    return g.Transpose(x, perm=[*range(rank - 2), rank - 1, rank - 2])


def dim_of(g: GradBuilder, x: Var, axis: int) -> Var:
    """Dimension ``axis`` of x as an int64 scalar."""
    return g.Gather(g.shape_of(x), g.const(np.int64(axis)))
