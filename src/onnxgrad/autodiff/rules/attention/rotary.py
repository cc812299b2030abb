"""RotaryEmbedding, the ONNX op (opset 23) and onnxruntime's (com.microsoft, inputs in another order).

A rotary embedding is a rotation, so its input gradient is the opposite rotation: the same op with
the sine negated. The caches' gradients (:func:`rotary_cache_grads`) are shared by both ops.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from ....errors import GradientNotImplementedError
from ....model.contrib_schemas import MS_DOMAIN
from ...builder import GradBuilder, Var
from ...registry import NodeContext, rule
from ..common import (
    Grads,
    as_int64,
    dim_of,
    node_label,
    unsupported,
)


@rule("RotaryEmbedding", since=23)
def rotary_embedding(g: GradBuilder, n: NodeContext) -> Grads:
    """Each pair (x1, x2) of the rotated part turns by its angle: y1 = c x1 - s x2, y2 = s x1 + c x2.

    dX is the opposite rotation: RotaryEmbedding(dY, cos, -sin) with the same attributes (the
    unrotated tail passes through). dcos = sum over heads of dy1 x1 + dy2 x2 and dsin = sum over
    heads of dy2 x1 - dy1 x2, per (batch, position); with position_ids they are scatter-added into
    the rows of the caches they were gathered from.
    """
    x, cos, sin = n.inputs[0], n.inputs[1], n.inputs[2]
    pos = n.inputs[3] if len(n.inputs) > 3 else None
    assert x is not None and cos is not None and sin is not None
    dy = n.dy
    grads: Grads = [None] * len(n.inputs)
    attrs = {
        a: n.attr(a) for a in ("interleaved", "rotary_embedding_dim", "num_heads") if n.attr(a) is not None
    }
    if n.needs[0]:
        grads[0] = g.RotaryEmbedding(dy, cos, g.Neg(sin), pos, shape=x.shape, **attrs)
    rotary_cache_grads(g, n, x, dy, pos, {1: cos, 2: sin}, grads)
    return grads


def rotary_cache_grads(
    g: GradBuilder, n: NodeContext, x: Var, dy: Var, rows: Var | None, caches: dict[int, Var], grads: Grads
) -> None:
    """The gradients of the cos and sin caches of a rotary embedding (input slots: the keys of
    ``caches``, cos first), into ``grads``: dcos = sum over heads of dy1 x1 + dy2 x2, dsin = sum over
    heads of dy2 x1 - dy1 x2, per (batch, position), scatter-added at ``rows`` (B, S) when the caches
    were gathered by position (else they are (B, S, rot / 2) themselves). Shared with the contrib
    RotaryEmbedding below."""
    if not any(n.needs[slot] for slot in caches):
        return
    if x.rank not in (3, 4):
        raise GradientNotImplementedError(f"{node_label(n)}: the rank of X (3 or 4) must be known")
    x1, x2 = rotated_pairs(g, n, x)
    dy1, dy2 = rotated_pairs(g, n, dy)
    for (slot, cache), value in zip(caches.items(), (dy1 * x1 + dy2 * x2, dy2 * x1 - dy1 * x2)):
        if not n.needs[slot]:
            continue
        per_position = g.ReduceSum(value, [2], keepdims=0)  # (B, S, rot / 2): summed over heads
        if rows is None:
            grads[slot] = per_position
        else:
            zero = helper.make_tensor("", cache.dtype, [1], [0.0])
            zeros = g.op("ConstantOfShape", g.shape_of(cache), value=zero, dtype=cache.dtype)
            index = g.Unsqueeze(rows, [-1])
            grads[slot] = g.ScatterND(zeros, index, per_position, reduction="add", shape=cache.shape)


def rotated_pairs(g: GradBuilder, n: NodeContext, x: Var) -> tuple[Var, Var]:
    """(x1, x2), each (B, S, H, rot / 2): the two members of every rotated pair of x."""
    if x.rank == 4:  # (B, H, S, D)
        x = g.Transpose(x, perm=[0, 2, 1, 3])
    else:  # (B, S, H D)
        x = g.Reshape(x, [0, 0, int(n.attr("num_heads")), -1])
    rot = int(n.attr("rotary_embedding_dim", 0) or 0)  # 0: the whole head turns
    if rot:
        x = g.Slice(x, [0], [rot], [3])
    if n.attr("interleaved", 0):
        pairs = g.Reshape(x, [0, 0, 0, -1, 2])
        first, second = (g.Squeeze(g.Slice(pairs, [i], [i + 1], [4]), [4]) for i in (0, 1))
        return first, second
    first, second = g.Split(x, axis=3, num_outputs=2, outputs=2)
    return first, second


@rule("RotaryEmbedding", domain=MS_DOMAIN)
def contrib_rotary_embedding(g: GradBuilder, n: NodeContext) -> Grads:
    """The rotation of :func:`rotary_embedding` with the contrib input order (input,
    position_ids, cos_cache, sin_cache): dX is the same contrib op with the sine negated; the
    caches' gradients are scatter-added at the rows position_ids gathered ((B, S), or (1,): an
    offset, rows offset..offset + S - 1), with :func:`rotary_cache_grads`."""
    x, pos, cos, sin = n.inputs[0], n.inputs[1], n.inputs[2], n.inputs[3]
    assert x is not None and pos is not None and cos is not None and sin is not None
    grads: Grads = [None] * len(n.inputs)
    attrs = {
        a: n.attr(a)
        for a in ("interleaved", "num_heads", "rotary_embedding_dim", "scale", "is_packed_batching")
        if n.attr(a) is not None
    }
    if n.needs[0]:
        grads[0] = g.op(
            "RotaryEmbedding", n.dy, pos, cos, g.Neg(sin), domain=MS_DOMAIN, shape=x.shape, **attrs
        )
    if not (n.needs[2] or n.needs[3]):
        return grads
    for name, plain in (("scale", 1.0), ("is_packed_batching", 0)):
        if n.attr(name, plain) != plain:
            raise unsupported(n, 2 if n.needs[2] else 3, f"{name}={n.attr(name)!r} with a cache gradient")
    rows = as_int64(g, pos)
    if pos.rank != 2:  # an offset: positions offset .. offset + S - 1 for every sequence
        seq_axis = 2 if x.rank == 4 else 1
        steps = g.Range(g.const(np.int64(0)), dim_of(g, x, seq_axis), g.const(np.int64(1)))
        batch = g.Slice(g.shape_of(x), g.const([0]), g.const([1]))
        rows = g.Expand(
            g.Reshape(rows, g.const([1, 1])) + g.Unsqueeze(steps, [0]), g.Concat(batch, g.const([1]), axis=0)
        )
    rotary_cache_grads(g, n, x, n.dy, rows, {2: cos, 3: sin}, grads)
    return grads
