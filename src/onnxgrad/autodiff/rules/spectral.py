"""Spectral ops: DFT, linear in its float input.

The gradient of a linear map is its adjoint. For the DFT of length ``n`` (``z = F x`` with
``F_kj = exp(-2 pi i kj / n)``, or ``exp(+2 pi i kj / n) / n`` for the inverse), the adjoint is
``F^H``: ``n * IDFT`` of the gradient for a forward DFT, ``DFT / n`` for an inverse one, taking
the gradient ``(d re, d im)`` of the output as the complex number ``d re + i d im``. Around it the
adjoints of the padding and slicing the op does: a one-sided output is zero-padded back to ``n``
frequencies, a ``dft_length`` that padded the signal slices its gradient (and zero-pads it where the
signal was truncated), and a real input keeps the real part. Sizes not static are read at run time.

Not covered: STFT, and the opset-27 CausalConvWithState and LinearAttention (onnxruntime 1.31 runs
opsets up to 26 only).
"""

from __future__ import annotations

import numpy as np

from ..builder import GradBuilder, Var
from ..registry import NodeContext, rule
from .common import Grads, need_rank, optional_input, refuse


def _const_int(n: NodeContext, i: int, what: str) -> int | None:
    """Integer value of optional input ``i``; refuses a value only known at run time."""
    if optional_input(n, i) is None:
        return None
    value = n.const_input(i)
    if value is None:
        raise refuse(n, f"{what} must be a constant (initializer or Constant) to differentiate")
    return int(np.asarray(value).reshape(()))


def _dft_axis(n: NodeContext, rank: int) -> int:
    """The signal axis, non-negative: attribute (default 1) before opset 20, input (default -2) after."""
    axis = n.attr("axis", 1) if n.opset < 20 else _const_int(n, 2, "axis")
    if axis is None:
        axis = -2
    return axis + rank if axis < 0 else axis


def _dft(g: GradBuilder, x: Var, axis: int, inverse: bool, shape: tuple) -> Var:
    """A complex-to-complex DFT of ``x`` along ``axis`` (its own length), in the backward's opset."""
    if g.opset >= 20:
        return g.op("DFT", x, None, g.const(np.int64(axis)), inverse=int(inverse), shape=shape)
    return g.op("DFT", x, axis=axis, inverse=int(inverse), shape=shape)


def _pad(g: GradBuilder, x: Var, rank: int, axis: int, after: int) -> Var:
    """``x`` (of rank ``rank``) zero-padded by ``after`` at the end of ``axis``."""
    pads = [0] * (2 * rank)
    pads[rank + axis] = after
    return g.op("Pad", x, g.const(np.int64(pads)), g.const(0.0, x.dtype))


def _slice(g: GradBuilder, x: Var, axis: int, start: int, end: int) -> Var:
    return g.op("Slice", x, g.const(np.int64([start])), g.const(np.int64([end])), g.const(np.int64([axis])))


@rule("DFT", since=17)
def dft_grad(g: GradBuilder, n: NodeContext) -> Grads:
    """``z = DFT_n(x)``: ``dx = n IDFT(dz)`` (forward DFT) or ``DFT(dz) / n`` (inverse), with the
    adjoints of one-sided output, ``dft_length`` padding/truncation and real input around it.
    Sizes not static (the signal's length, real or complex input) are read at run time."""
    x = n.x
    if n.attr("inverse", 0) and n.attr("onesided", 0):
        raise refuse(n, "an inverse one-sided DFT (a half spectrum in, a real signal out) is not supported")
    shape = x.static_shape
    if shape is None:
        return [_dft_grad_run_time(g, n, x, need_rank(n, x)), None, None]
    rank = len(shape)
    axis = _dft_axis(n, rank)
    length = shape[axis]
    size = _const_int(n, 1, "dft_length")
    size = length if size is None else size
    inverse, onesided = bool(n.attr("inverse", 0)), bool(n.attr("onesided", 0))
    full = (*shape[:axis], size, *shape[axis + 1 : -1], 2)

    dz = n.dy
    if onesided:  # only frequencies 0..n//2 were output: the others had no effect
        dz = _pad(g, dz, rank, axis, size - (size // 2 + 1))
    dx = _dft(g, dz, axis, not inverse, full)
    # F^H is n IDFT (the IDFT op divides by n) for a forward DFT, DFT / n for an inverse one
    dx = dx * float(size) if not inverse else dx * (1.0 / size)
    if size > length:  # the signal was zero-padded to n: its padding has no gradient
        dx = _slice(g, dx, axis, 0, length)
    elif size < length:  # the signal was truncated to n: the dropped samples have no gradient
        dx = _pad(g, dx, rank, axis, length - size)
    if shape[-1] == 1:  # real input: the real part
        dx = _slice(g, dx, rank - 1, 0, 1)
    return [dx, None, None]


def _dft_grad_run_time(g: GradBuilder, n: NodeContext, x: Var, rank: int) -> Var:
    """:func:`dft_grad` with the sizes read at run time: the transform's length n (``dft_length``
    or X's along the axis), the signal's length and X's last dim (1: real, 2: complex)."""
    axis = _dft_axis(n, rank)
    dims = g.shape_of(x)
    length = g.Slice(dims, [axis], [axis + 1])  # (1,)
    fixed = _const_int(n, 1, "dft_length")
    size = length if fixed is None else g.const(np.int64([fixed]))
    inverse, onesided = bool(n.attr("inverse", 0)), bool(n.attr("onesided", 0))
    dz = n.dy
    if onesided:  # frequencies n//2 + 1 .. n - 1 were not output
        half = g.Add(g.Div(size, g.const(np.int64([2]))), g.const(np.int64([1])))
        missing = g.Sub(size, half)
        dz = g.Pad(dz, g.Concat(g.const(np.int64([0])), missing, axis=0), None, g.const(np.int64([axis])))
    dx = _dft(g, dz, axis, not inverse, None)
    scale = g.Cast(g.Squeeze(size, [0]), to=x.dtype)
    dx = dx * scale if not inverse else dx / scale
    # the signal's own length: its padding cut, its truncated samples back as zeros
    dx = g.Slice(dx, g.const(np.int64([0])), length, g.const(np.int64([axis])))
    short = g.Sub(length, g.Slice(g.Shape(dx), [axis], [axis + 1]))
    dx = g.Pad(dx, g.Concat(g.const(np.int64([0])), short, axis=0), None, g.const(np.int64([axis])))
    last = g.Slice(dims, [rank - 1], [rank])  # 1 (real input: the real part) or 2
    return g.Slice(dx, g.const(np.int64([0])), last, g.const(np.int64([rank - 1])), shape=x.shape)
