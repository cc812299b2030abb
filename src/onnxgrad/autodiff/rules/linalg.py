"""Matrix products: MatMul (batched, broadcast, 1-D) and Gemm (every transA/transB/alpha/beta).

Gradients are written as Gemm with transposes where the operands are matrices: onnxruntime runs
that as one kernel, where Transpose + MatMul would cost a copy.
"""

from __future__ import annotations

from ..builder import GradBuilder, Var
from ..registry import NodeContext, rule


def _swap_last(g: GradBuilder, x: Var, rank: int) -> Var:
    perm = [*range(rank - 2), rank - 1, rank - 2]
    return g.Transpose(x, perm=perm)


@rule("MatMul")
def matmul(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    a, b = n.inputs
    dy = n.dy
    if a.rank is None or b.rank is None:
        raise ValueError(f"MatMul {n.node.name!r}: the ranks of its inputs must be known")
    da = db = None
    if a.rank == 2 and b.rank == 2:
        if n.needs[0]:
            da = g.Gemm(dy, b, transB=1)
        if n.needs[1]:
            db = g.Gemm(a, dy, transA=1)
        return [da, db]
    if b.rank == 2 and a.rank > 2:
        # x @ W with x batched (a Linear layer): fold the batch into rows for the weight gradient.
        if n.needs[0]:
            da = g.MatMul(dy, g.Transpose(b, perm=[1, 0]))
        if n.needs[1]:
            k = b.shape[0] if isinstance(b.shape[0], int) else -1
            cols = b.shape[1] if isinstance(b.shape[1], int) else -1
            a2 = g.Reshape(a, [-1, k])
            dy2 = g.Reshape(dy, [-1, cols])
            db = g.Gemm(a2, dy2, transA=1)
        return [da, db]
    if a.rank == 1 and b.rank == 1:  # dot product
        return [dy * b if n.needs[0] else None, dy * a if n.needs[1] else None]
    # General case (batched, broadcast, 1-D): promote vectors to matrices, then undo it.
    nb = max(a.rank, b.rank, 2) - 2  # batch dims of the product
    a2 = g.Unsqueeze(a, [0]) if a.rank == 1 else a
    b2 = g.Unsqueeze(b, [1]) if b.rank == 1 else b
    dy2 = g.Unsqueeze(dy, [-2]) if a.rank == 1 else dy
    dy2 = g.Unsqueeze(dy2, [-1]) if b.rank == 1 else dy2
    batch = n.y.shape[:nb] if n.y.shape is not None else None
    if n.needs[0]:
        da = g.MatMul(dy2, _swap_last(g, b2, max(b.rank, 2)))
        if a.rank == 1:  # (batch..., 1, k) -> (k)
            da = g.reduce_sum(da, [*range(nb), nb], keepdims=False)
        else:
            da = g.unbroadcast(da, a, None if batch is None else batch + a.shape[-2:])
    if n.needs[1]:
        db = g.MatMul(_swap_last(g, a2, max(a.rank, 2)), dy2)
        if b.rank == 1:  # (batch..., k, 1) -> (k)
            db = g.reduce_sum(db, [*range(nb), nb + 1], keepdims=False)
        else:
            db = g.unbroadcast(db, b, None if batch is None else batch + b.shape[-2:])
    return [da, db]


@rule("Gemm")
def gemm(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """Y = alpha * A' B' + beta * C, with A' = A or A^T and B' = B or B^T."""
    a, b = n.inputs[0], n.inputs[1]
    c = n.inputs[2] if len(n.inputs) > 2 else None
    dy = n.dy
    alpha = float(n.attr("alpha", 1.0))
    beta = float(n.attr("beta", 1.0))
    ta, tb = int(n.attr("transA", 0)), int(n.attr("transB", 0))
    al = alpha if alpha != 1.0 else None
    grads: list[Var | None] = [None, None, None]
    if n.needs[0]:
        if not ta:  # dA = alpha dY B'^T
            grads[0] = g.Gemm(dy, b, alpha=al, transB=0 if tb else 1)
        else:  # dA = alpha B' dY^T
            grads[0] = g.Gemm(b, dy, alpha=al, transA=tb, transB=1)
    if n.needs[1]:
        if not tb:  # dB = alpha A'^T dY
            grads[1] = g.Gemm(a, dy, alpha=al, transA=0 if ta else 1)
        else:  # dB = alpha dY^T A'
            grads[1] = g.Gemm(dy, a, alpha=al, transA=1, transB=ta)
    if c is not None and len(n.needs) > 2 and n.needs[2]:
        dc = dy if beta == 1.0 else dy * beta
        grads[2] = g.unbroadcast(dc, c, n.y.shape)
    return grads
