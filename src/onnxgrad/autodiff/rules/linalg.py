"""Matrix products: MatMul (batched, broadcast, 1-D), Gemm (every transA/transB/alpha/beta), Einsum
(any equation) and Det, and onnxruntime's FusedMatMul (``com.microsoft``: transposes and a scale
folded in); MatMulInteger and MatMulNBits are in :mod:`.quant`, QLinearMatMul carries no gradient
(:mod:`.nondiff`).

Gradients are written as Gemm with transposes where the operands are matrices: onnxruntime runs
that as one kernel, where Transpose + MatMul would cost a copy.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from ...errors import GradientNotImplementedError
from ...model.contrib_schemas import MS_DOMAIN
from ..builder import GradBuilder, Var
from ..registry import NodeContext, rule
from .common import Grads, need_rank, node_label, swap_last, unsupported


def _rows_of(g: GradBuilder, b: Var, axis: int) -> Var:
    """The shape (-1, size of b along axis): a constant when that size is static, else read at run
    time (two -1s would make the Reshape ambiguous)."""
    size = b.shape[axis] if b.shape is not None else None
    if isinstance(size, int):
        return g.const(np.array([-1, size], dtype=np.int64))
    return g.Concat(g.const(np.array([-1], dtype=np.int64)), _dims_at(g, b, [axis]), axis=0)


@rule("MatMul")
def matmul(g: GradBuilder, n: NodeContext) -> Grads:
    a, b = n.inputs
    dy = n.dy
    need_rank(n, a)
    need_rank(n, b)
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
            a2 = g.Reshape(a, _rows_of(g, b, 0))
            dy2 = g.Reshape(dy, _rows_of(g, b, 1))
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
        da = g.MatMul(dy2, swap_last(g, b2, max(b.rank, 2)))
        if a.rank == 1:  # (batch..., 1, k) -> (k)
            da = g.reduce_sum(da, [*range(nb), nb], keepdims=False)
        else:
            da = g.unbroadcast(da, a, None if batch is None else batch + a.shape[-2:])
    if n.needs[1]:
        db = g.MatMul(swap_last(g, a2, max(a.rank, 2)), dy2)
        if b.rank == 1:  # (batch..., k, 1) -> (k)
            db = g.reduce_sum(db, [*range(nb), nb + 1], keepdims=False)
        else:
            db = g.unbroadcast(db, b, None if batch is None else batch + b.shape[-2:])
    return [da, db]


@rule("Gemm")
def gemm(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = alpha * A' B' + beta * C, with A' = A or A^T and B' = B or B^T."""
    a, b = n.inputs[0], n.inputs[1]
    c = n.inputs[2] if len(n.inputs) > 2 else None
    dy = n.dy
    alpha = float(n.attr("alpha", 1.0))
    beta = float(n.attr("beta", 1.0))
    ta, tb = int(n.attr("transA", 0)), int(n.attr("transB", 0))
    al = alpha if alpha != 1.0 else None
    grads: Grads = [None, None, None]
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


# ---- Einsum ---------------------------------------------------------------------------------
_ELL = "..."


@dataclass(frozen=True)
class _Equation:
    """A parsed einsum equation: token lists per operand and for the output ('...' is one token),
    and the number of dims each ellipsis stands for."""

    terms: list[list[str]]
    out: list[str]
    ells: list[int]  # per operand
    out_ell: int  # broadcast of all of them


def _tokens(term: str) -> list[str]:
    out, i = [], 0
    while i < len(term):
        step = 3 if term.startswith(_ELL, i) else 1
        out.append(term[i : i + step])
        i += step
    return out


def _parse_einsum(n: NodeContext) -> _Equation:
    """Parse the node's equation; without ``->`` the output is every letter used exactly once, in
    ASCII order, after the ellipsis when an operand has one."""
    lhs, arrow, rhs = str(n.attr("equation")).replace(" ", "").partition("->")
    terms = [_tokens(t) for t in lhs.split(",")]
    if arrow:
        out = _tokens(rhs)
    else:
        letters = [c for t in terms for c in t if c != _ELL]
        once = sorted((c for c in set(letters) if letters.count(c) == 1), key=ord)
        out = ([_ELL] if any(_ELL in t for t in terms) else []) + once
    ells = []
    for i, (t, x) in enumerate(zip(terms, n.inputs)):
        if _ELL not in t:
            ells.append(0)
        elif x is None or x.rank is None:
            raise GradientNotImplementedError(
                f"{node_label(n)}: the rank of input {i} must be known (its term has '...')"
            )
        else:
            ells.append(x.rank - len(t) + 1)
    return _Equation(terms, out, ells, max(ells, default=0))


@rule("Einsum", since=12)
def einsum(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = einsum(X_1, ..., X_k): dX_i = einsum(dY, X_j for j != i) onto the term of X_i.

    That einsum yields one axis per distinct letter of X_i's term (a repeated letter is a diagonal);
    letters found only in X_i (summed away by the forward) come back by ``Expand``; ellipsis dims
    are summed where X_i was broadcast; a diagonal is rebuilt by one more einsum with an identity.
    """
    eq = _parse_einsum(n)
    return [_einsum_grad(g, n, eq, i) if n.needs[i] else None for i in range(len(n.inputs))]


def _einsum_grad(g: GradBuilder, n: NodeContext, eq: _Equation, i: int) -> Var:
    x, term, ell_x = n.inputs[i], eq.terms[i], eq.ells[i]
    assert x is not None
    others = [(eq.out, n.dy, eq.out_ell if _ELL in eq.out else 0)]
    others += [(t, v, e) for j, (t, v, e) in enumerate(zip(eq.terms, n.inputs, eq.ells)) if j != i]
    ell_g = max((e for t, _, e in others if _ELL in t), default=0)
    available = {c for t, _, _ in others for c in t}
    unique = list(dict.fromkeys(term))  # distinct letters in order, the ellipsis in place
    kept = [c for c in unique if c in available]
    if _ELL in available and _ELL not in kept:  # onnxruntime wants '...' in the output: sum it below
        kept.insert(0, _ELL)
    equation = ",".join("".join(t) for t, _, _ in others) + "->" + "".join(kept)
    grad = g.Einsum(*(v for _, v, _ in others), equation=equation)

    # Axis of the ellipsis block in `grad`; extra leading ellipsis dims came from broadcasting.
    at = kept.index(_ELL) if _ELL in kept else 0
    if ell_g > ell_x:
        grad = g.reduce_sum(grad, list(range(at, at + ell_g - ell_x)), keepdims=False)
    # Unsqueeze what `grad` lacks of the distinct-letter layout of x: letters only x has, and
    # leading ellipsis dims the other operands do not have; Expand fills them.
    missing, axis = [], 0
    for c in unique:
        if c == _ELL:
            missing += list(range(axis, axis + ell_x - min(ell_g, ell_x)))
            axis += ell_x
        else:
            if c not in available:
                missing.append(axis)
            axis += 1
    first = _first_axes(term, ell_x)
    if missing:
        grad = g.Expand(g.Unsqueeze(grad, missing), _dims_at(g, x, first))
    grad = _einsum_diagonals(g, grad, term, unique, x, ell_x)
    ell_dims = _ell_dims(x, term, ell_x)
    if ell_x and not all(isinstance(d, int) and d != 1 for d in ell_dims):
        grad = g.unbroadcast(grad, x, None)  # x has size-1 (or unknown) ellipsis dims
    return grad


def _first_axes(term: list[str], ell: int) -> list[int]:
    """For each axis of the distinct-letter layout of ``term``, the axis of the operand it is."""
    seen: set[str] = set()
    axes: list[int] = []
    axis = 0
    for c in term:
        width = ell if c == _ELL else 1
        if c not in seen:
            seen.add(c)
            axes += list(range(axis, axis + width))
        axis += width
    return axes


def _ell_dims(x: Var, term: list[str], ell: int) -> list[Any]:
    if _ELL not in term or x.shape is None:
        return [None] * ell
    start = term.index(_ELL)
    return list(x.shape[start : start + ell])


def _dims_at(g: GradBuilder, x: Var, axes: list[int]) -> Var:
    """The sizes of ``x`` along ``axes`` as a 1-D int64 Var (a constant when static)."""
    if x.shape is not None and all(isinstance(x.shape[a], int) for a in axes):
        return g.const(np.array([x.shape[a] for a in axes], dtype=np.int64))
    return g.Gather(g.shape_of(x), g.const(np.array(axes, dtype=np.int64)))


def _einsum_diagonals(g: GradBuilder, grad: Var, term: list[str], unique: list[str], x: Var, ell: int) -> Var:
    """Put a gradient laid out by distinct letters onto the diagonals of a term that repeats some:
    ``einsum('ij,iA->iAj', G, I)`` for the term ``iij``."""
    if len(unique) == len(term):
        return grad
    fresh = iter(c for c in string.ascii_letters if c not in term and c not in unique)
    renamed: list[str] = []
    eyes: list[tuple[str, Var]] = []
    first_axis: dict[str, int] = {}
    axis = 0
    for c in term:
        if c == _ELL or c not in first_axis:
            first_axis[c] = axis
            renamed.append(c)
        else:
            new = next(fresh)
            renamed.append(new)
            eyes.append((c + new, _eye(g, x, first_axis[c])))
        axis += ell if c == _ELL else 1

    def s(tokens: list[str]) -> str:
        return "".join(c for c in tokens if c != _ELL or ell)

    equation = ",".join([s(unique)] + [t for t, _ in eyes]) + "->" + s(renamed)
    return g.Einsum(grad, *(e for _, e in eyes), equation=equation)


def _eye(g: GradBuilder, x: Var, axis: int) -> Var:
    """The identity matrix of the size of ``x`` along ``axis``, in x's dtype."""
    size = x.shape[axis] if x.shape is not None else None
    if isinstance(size, int):
        return g.const(np.eye(size), x.dtype)
    dim = _dims_at(g, x, [axis])
    zero = helper.make_tensor("", x.dtype, [1], [0.0])
    return g.EyeLike(g.op("ConstantOfShape", g.Concat(dim, dim, axis=0), value=zero, dtype=x.dtype))


# ---- Det ------------------------------------------------------------------------------------
@rule("Det", since=11)
def det(g: GradBuilder, n: NodeContext) -> Grads:
    """y = det(X) over the last two axes: dX = dy * cofactor(X), cofactor_ij = (-1)^(i+j) det(minor_ij).

    That is dy * det(X) * inv(X)^T where X is invertible, and stays exact where it is not (the
    cofactor matrix is a polynomial in X): a singular X gets its true, finite gradient. ONNX has no
    matrix inverse, so the M^2 minors are gathered and their determinants taken in one ``Det`` --
    O(M^5) work, fine for the small matrices Det is used on.
    """
    x = n.x
    if not n.needs[0]:
        return [None]
    if x.rank is None:
        raise GradientNotImplementedError(f"{node_label(n)}: the rank of its input must be known")
    dy = g.Unsqueeze(n.dy, [-2, -1])
    m = x.shape[-1] if x.shape is not None else None
    if m == 1:  # det of a 1x1 matrix is its element
        return [g.Expand(dy, g.shape_of(x), shape=x.shape)]
    return [dy * _cofactors(g, x, m if isinstance(m, int) else None)]


def _cofactors(g: GradBuilder, x: Var, m: int | None) -> Var:
    """The cofactor matrix of each (M, M) matrix of x."""
    if m is not None:
        idx = np.arange(m - 1)[None, :] + (np.arange(m - 1)[None, :] >= np.arange(m)[:, None])
        keep = g.const(idx.astype(np.int64))  # keep[i] = the M - 1 indices other than i
        signs = g.const((-1.0) ** np.add.outer(np.arange(m), np.arange(m)), x.dtype)
    else:
        size = g.Gather(g.shape_of(x), g.const(np.array(-1, dtype=np.int64)))
        rows = g.Unsqueeze(g.Range(g.const(np.array(0, dtype=np.int64)), size, g.const(np.array(1))), [1])
        cols = g.Unsqueeze(g.Range(g.const(np.array(0, dtype=np.int64)), size - 1, g.const(np.array(1))), [0])
        keep = cols + g.Cast(cols >= rows, to=TensorProto.INT64)
        parity = g.Mod(rows + g.Transpose(rows, perm=[1, 0]), g.const(np.array(2)))
        signs = 1.0 - 2.0 * g.Cast(parity, to=x.dtype)  # type: ignore[operator]
    r = x.rank
    assert r is not None
    minors = g.Gather(g.Gather(x, keep, axis=r - 2), keep, axis=r)  # (..., i, M-1, j, M-1)
    minors = g.Transpose(minors, perm=[*range(r - 2), r - 2, r, r - 1, r + 1])
    return g.Det(minors) * signs


# ---- FusedMatMul (com.microsoft) ------------------------------------------------------------------
@rule("FusedMatMul", domain=MS_DOMAIN)
def fused_matmul(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = alpha op(A) op(B), op a transpose of the last two axes where transA / transB say.

    With A' = op(A), B' = op(B): dA' = alpha dY B'^T, dB' = alpha A'^T dY (summed where the batch
    broadcast), then transposed back where op transposed. transBatchA / transBatchB are refused.
    """
    a, b = n.inputs[0], n.inputs[1]
    assert a is not None and b is not None
    for k, flag in enumerate(("transBatchA", "transBatchB")):
        if int(n.attr(flag, 0)) and n.needs[k]:
            raise unsupported(n, k, f"{flag}=1")
    need_rank(n, a)
    need_rank(n, b)
    if a.rank < 2 or b.rank < 2:  # type: ignore[operator]
        raise unsupported(n, 0 if a.rank < 2 else 1, "A and B must have 2 dimensions or more")  # type: ignore[operator]
    ra, rb = a.rank, b.rank
    ry = max(ra, rb)  # type: ignore[type-var]
    ta, tb = int(n.attr("transA", 0)), int(n.attr("transB", 0))
    alpha = float(n.attr("alpha", 1.0))
    dy = n.dy * alpha if alpha != 1.0 else n.dy
    a1 = swap_last(g, a, ra) if ta else a  # type: ignore[arg-type]
    b1 = swap_last(g, b, rb) if tb else b  # type: ignore[arg-type]
    grads: Grads = [None, None]
    if n.needs[0]:
        da = g.MatMul(dy, swap_last(g, b1, rb))  # type: ignore[arg-type]
        da = swap_last(g, da, ry) if ta else da  # type: ignore[arg-type]
        grads[0] = g.unbroadcast(da, a, _batched(n, a))
    if n.needs[1]:
        db = g.MatMul(swap_last(g, a1, ra), dy)  # type: ignore[arg-type]
        db = swap_last(g, db, ry) if tb else db  # type: ignore[arg-type]
        grads[1] = g.unbroadcast(db, b, _batched(n, b))
    return grads


def _batched(n: NodeContext, x: Var) -> tuple | None:
    """The shape of a gradient before it is summed to ``x``: the output's batch dims, x's matrix dims."""
    if n.y.shape is None or x.shape is None:
        return None
    return (*n.y.shape[:-2], *x.shape[-2:])
