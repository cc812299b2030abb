"""Col2Im: it sums patches into an image; its adjoint cuts the patches back out (Im2Col): one
Gather from the padded dy with a patch-position table computed at build time (or by the backward
when the shapes are known only at run time)."""

from __future__ import annotations

import numpy as np

from ....errors import GradientNotImplementedError
from ...builder import INT64, GradBuilder, Var
from ...registry import NodeContext, rule
from ..common import Grads, first_only, node_label


# ---- Col2Im ------------------------------------------------------------------------------------
@rule("Col2Im", since=18)
def col2im(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = sum of the columns of X placed as patches of a (padded) image: dX cuts the patches of the
    padded dy back out (Im2Col), one Gather with a table of patch positions built from the constant
    image and block shapes (or, when those are computed at run time, by the backward from them)."""
    if not n.needs[0]:
        return first_only(n, None)
    image = n.const_input(1)
    block = n.const_input(2)
    if image is None or block is None:
        return first_only(n, _col2im_run_time(g, n))
    k = len(image)
    dil = list(n.attr("dilations") or [1] * k)
    pads = list(n.attr("pads") or [0] * (2 * k))
    strides = list(n.attr("strides") or [1] * k)
    padded = [int(image[i]) + pads[i] + pads[k + i] for i in range(k)]
    slides = [(padded[i] - (dil[i] * (int(block[i]) - 1) + 1)) // strides[i] + 1 for i in range(k)]
    # table[b, l] = flat position in the padded image of block offset b at sliding position l
    offsets = np.indices([int(b) for b in block]).reshape(k, -1) * np.array(dil)[:, None]
    starts = np.indices(slides).reshape(k, -1) * np.array(strides)[:, None]
    pos = offsets[:, :, None] + starts[:, None, :]  # (k, K, L)
    table = np.ravel_multi_index(tuple(pos), padded)
    dy = n.dy
    if any(pads):
        dy = g.Pad(dy, [0, 0, *pads[:k], 0, 0, *pads[k:]])
    cols = g.Gather(g.Reshape(dy, [0, 0, -1]), table.astype(np.int64), axis=2)  # (N, C, K, L)
    return first_only(n, g.Reshape(cols, [0, -1, table.shape[1]], shape=n.x.shape))


def _col2im_run_time(g: GradBuilder, n: NodeContext) -> Var:
    """Col2Im's adjoint with image_shape or block_shape known only at run time: the same table of
    patch positions, built by the backward (a Range per dim and broadcast sums)."""
    k = None
    for v in (n.inputs[1], n.inputs[2]):
        if v is not None and v.shape is not None and isinstance(v.shape[0], int):
            k = v.shape[0]
    if k is None and n.y.rank is not None:
        k = n.y.rank - 2
    if k is None:
        raise GradientNotImplementedError(f"{node_label(n)}: the number of image dims must be known")
    dil = list(n.attr("dilations") or [1] * k)
    pads = list(n.attr("pads") or [0] * (2 * k))
    strides = list(n.attr("strides") or [1] * k)
    zero, one = g.const(np.int64(0)), g.const(np.int64(1))

    def entry(i: int, j: int) -> Var:
        value = n.const_input(i)
        if value is not None:
            return g.const(np.int64(value[j]))
        return g.Gather(g.Cast(n.inputs[i], to=INT64), g.const(np.int64(j)), axis=0)

    padded = [entry(1, i) + (pads[i] + pads[k + i]) for i in range(k)]
    blocks = [entry(2, i) for i in range(k)]
    slides = [(padded[i] - (blocks[i] - 1) * dil[i] - 1) / strides[i] + 1 for i in range(k)]  # int Div

    def grid(sizes: list[Var], steps: list[int]) -> Var:
        """Flat positions in the padded image of index tuples over ``sizes``, each dim scaled by its
        step: sum_i range(sizes[i]) * steps[i] * (product of the padded dims after i), flattened."""
        total = None
        for i in range(k):
            term = g.Range(zero, sizes[i], one) * steps[i]
            for p in padded[i + 1 :]:
                term = term * p
            term = g.Unsqueeze(term, [j for j in range(k) if j != i]) if k > 1 else term
            total = term if total is None else total + term
        assert total is not None
        return g.Reshape(total, g.const(np.array([-1], dtype=np.int64)))

    table = g.Unsqueeze(grid(blocks, dil), [1]) + g.Unsqueeze(grid(slides, strides), [0])  # (K, L)
    dy = n.dy
    if any(pads):
        dy = g.Pad(dy, [0, 0, *pads[:k], 0, 0, *pads[k:]])
    cols = g.Gather(g.Reshape(dy, [0, 0, -1]), table, axis=2)  # (N, C, K, L)
    return g.reshape(cols, n.x)
