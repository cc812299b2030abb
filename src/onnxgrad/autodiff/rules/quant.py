"""Quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger, ConvInteger,
and onnxruntime's MatMulNBits (``com.microsoft``: blockwise 4/8-bit weights, frozen; see
:func:`matmul_nbits`).

A quantized tensor ``q`` stands for the real number ``(q - zero_point) * scale``; these rules
differentiate every op as the function of real numbers it computes, so an integer tensor carries a
*float* gradient (d loss / d q, q read as a real number) from one rule to the next. Which rules
apply is ``build_gradient(quantized=...)`` (``autodiff/backward.py``: :data:`QUANTIZED_OPS`):

- **exact** (``"ste"`` and ``"refuse"``): DequantizeLinear ``y = (x - zp) * scale`` is linear in
  ``scale`` (d scale = sum of dy (x - zp) over the elements sharing a scale: per tensor, per axis,
  per block) and in ``x`` (dx = dy scale: float8 inputs, and integer ones carrying a gradient);
  MatMulInteger and ConvInteger are the float products of ``(a - a_zp)`` and ``(b - b_zp)``.
- **straight-through** (``"ste"`` only): QuantizeLinear ``q = clamp(round(x / scale) + zp)`` and
  DynamicQuantizeLinear round; their derivative is zero almost everywhere. The straight-through
  estimator of quantization-aware training (PyTorch's fake-quantize backward) reads the rounding as
  the identity where the value lands inside [qmin, qmax] and as a constant where it is clamped:
  dx = dq / scale there, 0 elsewhere. QuantizeLinear followed by DequantizeLinear then gives
  exactly ``torch.fake_quantize_per_tensor_affine`` / ``_per_channel_affine``'s backward in x, and,
  with the LSQ gradient of QuantizeLinear's scale (d scale = -dq x / scale^2 where not clamped),
  ``torch._fake_quantize_learnable_per_tensor_affine``'s in the scale they share.
  DynamicQuantizeLinear's scale and zero point, computed from the range of x, count as constants
  (the composite ``(q - zp) * scale`` is x under the estimator whatever the scale), so
  DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(scales) gives d x = dy @ dequant(W)^T.
- ``"refuse"`` raises where a gradient would cross a rounding; ``"zero"`` stops the gradient at
  every op of the family (the engine never calls these rules then).

The straight-through scale gradient is not the derivative almost everywhere, and is not meant to
be. For a pair ``y = DequantizeLinear(QuantizeLinear(x, s, zp), s, zp)`` sharing ``s``, the
derivative almost everywhere is ``d s = sum dy (q - zp)`` (y is ``s (q - zp)`` between the
jumps of the rounding) and ``dx = 0``; the estimator reads the rounding as the identity in both x
and s, which adds ``-sum dy x / s`` where not clamped: ``d s = sum dy (round(x / s) - x / s)``
(LSQ), the rounding error's dependence on the scale. The two differ by ``sum dy x / s``: 9.3 in
the test named below and 887 in a report, on the output quantization of a ``quantize_static``
model (``y_scale``). That scale is the only one whose derivative almost everywhere is not 0 in a
model that quantizes each activation: under it nothing upstream of a rounding would train
(tests/autodiff/test_rules_quant.py,
``test_qdq_scale_gradients_are_lsq_not_the_derivative_almost_everywhere``).

Zero points are integers: they get no gradient.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ...errors import GradientNotImplementedError
from ...model.contrib_schemas import MS_DOMAIN
from ...model.nbits import default_zero_point, pack_bits, unpack_bits
from ..backward import note_straight_through, quantized_mode, version_of
from ..builder import GradBuilder, Var, cast, where
from ..registry import NodeContext, lookup, rule
from .common import Grads, need_rank, nonneg_axis, optional_input, refuse, unsupported

# The integer range of each quantized type: values rounding outside it are clamped.
_INT_RANGES = {
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT8: (0, 255),
    TensorProto.INT16: (-32768, 32767),
    TensorProto.UINT16: (0, 65535),
    TensorProto.INT32: (-(2**31), 2**31 - 1),
    TensorProto.INT4: (-8, 7),
    TensorProto.UINT4: (0, 15),
}
# The largest finite value of each float8 / float4 type: saturate=1 clamps to it.
_FLOAT_MAX = {
    TensorProto.FLOAT8E4M3FN: 448.0,
    TensorProto.FLOAT8E4M3FNUZ: 240.0,
    TensorProto.FLOAT8E5M2: 57344.0,
    TensorProto.FLOAT8E5M2FNUZ: 57344.0,
}
if hasattr(TensorProto, "FLOAT4E2M1"):
    _FLOAT_MAX[TensorProto.FLOAT4E2M1] = 6.0
if hasattr(TensorProto, "INT2"):
    _INT_RANGES[TensorProto.INT2] = (-2, 1)
    _INT_RANGES[TensorProto.UINT2] = (0, 3)


def _rounding(g: GradBuilder, n: NodeContext) -> bool:
    """Whether a rule may pass the gradient straight through this rounding node: ``True`` under
    ``quantized="ste"``, ``False`` under ``"zero"``; raises under ``"refuse"``."""
    mode = quantized_mode(g)
    if mode == "refuse":
        raise GradientNotImplementedError(
            f"node {n.node.name!r} (op {n.node.op_type!r}, opset {version_of(g.versions, n.node.domain)}) "
            "rounds its input: its gradient is zero almost everywhere and was refused "
            "(quantized='refuse'); quantized='ste' passes it straight through as quantization-aware "
            "training does, quantized='zero' stops it"
        )
    if mode == "ste":
        note_straight_through(g, n.node.name or n.node.output[0])
    return mode == "ste"


def _layout(n: NodeContext, x: Var, scale: Var) -> tuple[str, int, int]:
    """How ``scale`` maps onto ``x``: ``("tensor", 0, 0)``, ``("axis", axis, 0)`` or
    ``("block", axis, block_size)``."""
    block = int(n.attr("block_size", 0) or 0)
    if block <= 0 and (scale.rank == 0 or scale.shape == (1,)):
        return "tensor", 0, 0
    axis = nonneg_axis(n, int(n.attr("axis", 1)), x.rank)
    return ("block" if block > 0 else "axis"), axis, block


def _static(n: NodeContext, v: Var) -> tuple[int, ...]:
    shape = v.static_shape
    if shape is None:
        raise GradientNotImplementedError(
            f"{n.node.op_type} node {n.node.name!r}: blocked quantization needs static shapes"
        )
    return tuple(shape)


def _expand(g: GradBuilder, n: NodeContext, v: Var, x: Var) -> Var:
    """``v`` (a scale or a zero point of ``x``) in a shape that broadcasts against ``x``."""
    kind, axis, block = _layout(n, x, v)
    if kind == "tensor":
        return v
    rank = need_rank(n, x)
    if kind == "axis":
        return g.Reshape(v, g.const(np.array([1] * axis + [-1] + [1] * (rank - axis - 1), np.int64)))
    xs, vs = _static(n, x), _static(n, v)
    blocks = g.Expand(
        g.Unsqueeze(v, [axis + 1]), g.const(np.array([*vs[: axis + 1], block, *vs[axis + 1 :]]))
    )
    whole = g.Reshape(blocks, g.const(np.array([*vs[:axis], vs[axis] * block, *vs[axis + 1 :]], np.int64)))
    return g.Slice(whole, [0], [xs[axis]], [axis])


def _reduce(g: GradBuilder, n: NodeContext, t: Var, v: Var, x: Var) -> Var:
    """``t`` (shaped like ``x``) summed over the elements sharing each entry of ``v``: the gradient
    of a scale from the gradient of its broadcast copy."""
    kind, axis, block = _layout(n, x, v)
    rank = need_rank(n, x)
    if kind == "tensor":
        total = g.reduce_sum(t, list(range(rank)), keepdims=False) if rank else t
        return g.Reshape(total, g.const(np.array(v.static_shape or (), np.int64))) if v.rank else total
    if kind == "axis":
        return g.reduce_sum(t, [a for a in range(rank) if a != axis], keepdims=False)
    xs, vs = _static(n, x), _static(n, v)
    extra = vs[axis] * block - xs[axis]
    if extra:
        pads = [0] * (2 * rank)
        pads[rank + axis] = extra
        t = g.Pad(t, g.const(np.array(pads, np.int64)))
    split = g.Reshape(t, g.const(np.array([*vs[: axis + 1], block, *vs[axis + 1 :]], np.int64)))
    return g.reduce_sum(split, [axis + 1], keepdims=False)


def _as_float(g: GradBuilder, v: Var, like: Var) -> Var:
    """An integer (or float8) tensor as the float type of ``like``."""
    return v if v.dtype == like.dtype else g.Cast(v, to=like.dtype, shape=v.shape)


@rule("DequantizeLinear", since=10)
def dequantize_linear(g: GradBuilder, n: NodeContext) -> Grads:
    """y = (x - zp) * scale: dx = dy scale; d scale = dy (x - zp) summed per scale (exact)."""
    x, scale = n.inputs[0], n.inputs[1]
    assert x is not None and scale is not None
    zp = optional_input(n, 2)
    dy = n.dy
    grads: Grads = [None] * len(n.inputs)
    if n.needs[0]:
        grads[0] = dy * cast(_expand(g, n, scale, x), dy)
    if n.needs[1]:
        one = g.Expand(g.const(1.0, scale.dtype), g.shape_of(scale))
        attrs = {a: n.attr(a) for a in ("axis", "block_size") if n.attr(a) is not None}
        centered = g.DequantizeLinear(x, one, zp, dtype=scale.dtype, **attrs)  # x - zp, as a float
        grads[1] = cast(_reduce(g, n, dy * cast(centered, dy), scale, x), scale)
    return grads


@rule("QuantizeLinear", since=10)
def quantize_linear(g: GradBuilder, n: NodeContext) -> Grads:
    """q = clamp(round(x / scale) + zp): straight through where not clamped (see the module)."""
    x, scale = n.inputs[0], n.inputs[1]
    assert x is not None and scale is not None
    zp = optional_input(n, 2)
    grads: Grads = [None] * len(n.inputs)
    if not _rounding(g, n) or n.dout[0] is None:
        return grads
    s = cast(_expand(g, n, scale, x), x)
    v = x / s
    q = n.y.dtype
    if q in _FLOAT_MAX:
        lo, hi = -_FLOAT_MAX[q], _FLOAT_MAX[q]
        r = v
    elif q in _INT_RANGES:
        lo, hi = _INT_RANGES[q]
        r = g.Round(v)
        if zp is not None:
            r = r + _as_float(g, _expand(g, n, zp, x), x)
    else:
        raise refuse(n, f"the range of its output type {helper.tensor_dtype_to_string(q)} is unknown")
    kept = where(g.And(r >= float(lo), r <= float(hi)), cast(n.dy, x), 0.0)
    if n.needs[0]:
        grads[0] = kept / s
    if n.needs[1]:  # LSQ: d(x / scale) / d scale = -x / scale^2
        grads[1] = cast(_reduce(g, n, -(kept * v / s), scale, x), scale)
    return grads


@rule("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(g: GradBuilder, n: NodeContext) -> Grads:
    """(q, scale, zp) = DynamicQuantizeLinear(x): dx = dq / scale where round(x / scale) + zp lands
    in [0, 255]; scale and zp, computed from the range of x, count as constants (see the module)."""
    x = n.x
    if not _rounding(g, n) or n.dout[0] is None or not n.needs[0]:
        return [None]
    scale, zp = n.outputs[1], n.outputs[2]
    if scale is None or zp is None:  # the outputs were not named: add them to the node
        scale = g.extra_output(n.node, 1, x.dtype, ())
        zp = g.extra_output(n.node, 2, TensorProto.UINT8, ())
    s = where(g.Equal(scale, g.const(0.0, scale.dtype)), 1.0, scale)  # x all zeros: scale 0
    r = g.Round(x / s) + _as_float(g, zp, x)
    kept = where(g.And(r >= 0.0, r <= 255.0), cast(n.dy, x), 0.0)
    return [kept / s]


def _centered(g: GradBuilder, v: Var, zp: Var | None, like: Var, row_axis: int | None = None) -> Var:
    """``v - zp`` as the float type of ``like``; ``row_axis``: a 1-D zp indexes that axis of v
    (MatMulInteger's per-row A zero point, ConvInteger's per-channel weight one)."""
    f = _as_float(g, v, like)
    if zp is None:
        return f
    z = _as_float(g, zp, like)
    if row_axis is not None and zp.rank == 1 and v.rank is not None:
        trailing = v.rank - 1 - row_axis if row_axis >= 0 else -row_axis - 1
        z = g.Reshape(z, g.const(np.array([-1] + [1] * trailing, np.int64)))
    return g.Sub(f, z, shape=v.shape)


def _as_product(g: GradBuilder, n: NodeContext, op: str, a: Var, b: Var) -> Grads:
    """The gradients of the float ``op`` (MatMul, Conv) of ``a`` and ``b``, by that op's rule."""
    float_op = helper.make_node(op, list(n.node.input[:2]), list(n.node.output), name=n.node.name)
    float_op.attribute.extend(n.node.attribute)
    r = lookup("", op, max(n.opset, 13))
    assert r is not None and r.fn is not None
    ctx = NodeContext(float_op, [a, b], n.outputs, n.dout, n.needs[:2], max(n.opset, 13), g)
    grads = list(r.fn(g, ctx))[:2]
    return grads + [None] * (len(n.inputs) - 2)


@rule("MatMulInteger", since=10)
def matmul_integer(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = (A - a_zp) @ (B - b_zp), differentiated as the float product (a per-row a_zp indexes
    the rows of A, a per-column b_zp the columns of B)."""
    a, b = n.inputs[0], n.inputs[1]
    assert a is not None and b is not None
    dy = n.dy
    return _as_product(
        g,
        n,
        "MatMul",
        _centered(g, a, optional_input(n, 2), dy, -2),
        _centered(g, b, optional_input(n, 3), dy),
    )


@rule("ConvInteger", since=10)
def conv_integer(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = Conv(X - x_zp, W - w_zp), differentiated as the float convolution (a per-channel w_zp
    indexes the output channels of W)."""
    x, w = n.inputs[0], n.inputs[1]
    assert x is not None and w is not None
    dy = n.dy
    return _as_product(
        g, n, "Conv", _centered(g, x, optional_input(n, 2), dy), _centered(g, w, optional_input(n, 3), dy, 0)
    )


# ---- MatMulNBits (com.microsoft): blockwise 4/8-bit weights ----------------------------------------
def _unpack(g: GradBuilder, packed: Var, bits: int, count: Var | int) -> Var:
    """uint8 bytes (..., m) -> int32 values (..., m * 8 / bits), low bits first, cut to ``count``
    values along the last axis (a Var: a 1-element int64)."""
    values = g.Cast(packed, to=TensorProto.INT32)
    if bits == 4:
        high = values / 16  # integer division
        low = values - high * 16
        values = g.Reshape(g.Concat(g.Unsqueeze(low, [-1]), g.Unsqueeze(high, [-1]), axis=-1), [0, 0, -1])
    end = g.const([count]) if isinstance(count, int) else count
    return g.Slice(values, g.const([0]), end, g.const([-1]))


def _packed_tensor(g: GradBuilder, dtype: int, dims: list[int], raw: bytes) -> Var:
    """A new initializer of the backward graph, of ``dtype`` (uint4 / uint8) from its raw bytes."""
    name = g.fresh("packed")
    g.initializers[name] = helper.make_tensor(name, dtype, dims, raw, raw=True)
    return Var(g, name, dtype, tuple(dims))


def _packed_weight(g: GradBuilder, n: NodeContext, bits: int, blocks: int, block: int) -> Var | None:
    """W (N, n_blocks block) for dA when B is an initializer: a ``com.microsoft`` DequantizeLinear
    (per axis, one scale per block row) of B's own bytes, re-typed as a uint4 / uint8 initializer
    (N n_blocks, block); None when B or uint8 zero points are fed at run time.

    Dequantizing with plain ops (unpacking, ``(q - zero point) scale``) from initializers is
    constant-folded by onnxruntime into a float (N, K) initializer per weight: the backward session
    would hold every 4-bit weight in float. onnxruntime does not fold DequantizeLinear (it keeps
    quantized weights quantized), so the backward holds B packed (the same bytes) and dequantizes one
    weight at a time at run time. Float zero points are applied after: W = DQ(q) - zero point scale.
    """
    scales, zp = n.inputs[2], optional_input(n, 3)
    assert scales is not None
    packed = n.const_input(1)
    if packed is None or scales.dtype not in (TensorProto.FLOAT, TensorProto.FLOAT16):
        return None
    n_dim = int(n.attr("N"))
    rows = n_dim * blocks
    qtype = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
    if zp is None:
        zeros = np.full(rows, default_zero_point(bits), np.uint8)
    elif zp.dtype == TensorProto.UINT8:
        values = n.const_input(3)
        if values is None:
            return None
        zeros = unpack_bits(values.reshape(n_dim, -1), bits, blocks).reshape(-1)
    else:
        zeros = None  # float zero points: subtracted after the DequantizeLinear
    q = _packed_tensor(g, qtype, [rows, block], np.ascontiguousarray(packed, np.uint8).tobytes())
    scale = g.Reshape(scales, [-1])
    if zeros is None:
        w = g.DequantizeLinear(q, scale, domain=MS_DOMAIN, axis=0, dtype=scales.dtype)
        w = w - g.Reshape(zp * scales, [rows, 1])  # type: ignore[operator]
    else:
        zero = _packed_tensor(g, qtype, [rows], pack_bits(zeros, bits).tobytes())
        w = g.DequantizeLinear(q, scale, zero, domain=MS_DOMAIN, axis=0, dtype=scales.dtype)
    return g.Reshape(w, [n_dim, blocks * block])


@rule("MatMulNBits", domain=MS_DOMAIN)
def matmul_nbits(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = A W^T + bias, W (N, K) the blockwise dequantization of the frozen packed weight B.

    B is uint8 (N, n_blocks, blob_size), ``bits`` values per byte, low bits first; ``scales``
    (N n_blocks); ``zero_points`` uint8 packed like B (N, ceil(n_blocks bits / 8)) or of the scales'
    type (N n_blocks), absent meaning 2^(bits - 1). The backward dequantizes W (a ``com.microsoft``
    DequantizeLinear of B's bytes when B is an initializer, see :func:`_packed_weight`, else plain
    ops: integer unpacking, (q - zero point) scale per block), keeps the K columns and gives
    dA = dY W, dbias = dY summed over the rows. B (integers) gets none; float scales and zero
    points, when trained, get theirs from dW = dY^T A (rows of every batch) per block:
    dscale = sum(dW (q - zero point)), dzero_point = -scale sum(dW).
    """
    a, b, scales = n.inputs[0], n.inputs[1], n.inputs[2]
    zp, g_idx, bias = optional_input(n, 3), optional_input(n, 4), optional_input(n, 5)
    assert a is not None and b is not None and scales is not None
    bits, block = int(n.attr("bits", 4)), int(n.attr("block_size"))
    k_dim, n_dim = int(n.attr("K")), int(n.attr("N"))
    grads: Grads = [None] * len(n.inputs)
    if bias is not None and n.needs[5]:
        grads[5] = g.unbroadcast(n.dy, bias, n.y.shape)
    need_scales = n.needs[2]
    need_zero = zp is not None and n.needs[3] and zp.dtype != TensorProto.UINT8
    if not (n.needs[0] or need_scales or need_zero):
        return grads
    if bits not in (4, 8):
        raise unsupported(n, 0, f"bits={bits} (the rule unpacks 4 and 8)")
    if g_idx is not None:
        raise unsupported(n, 0, "a g_idx input (act-order) is not supported")
    blocks = -(-k_dim // block)

    def plain() -> tuple[Var, Var, Var]:
        """q (N, n_blocks, block), its zero points and scales (N, n_blocks, 1), in A's type."""
        q = g.Cast(_unpack(g, b, bits, block), to=a.dtype)
        if zp is None:
            zero = g.const(float(2 ** (bits - 1)), a.dtype)
        elif zp.dtype == TensorProto.UINT8:
            zero = g.Cast(_unpack(g, g.Reshape(zp, [n_dim, 1, -1]), bits, blocks), to=a.dtype)
            zero = g.Reshape(zero, [n_dim, blocks, 1])
        else:
            zero = g.Reshape(g.Cast(zp, to=a.dtype), [n_dim, blocks, 1])
        return q, zero, g.Reshape(g.Cast(scales, to=a.dtype), [n_dim, blocks, 1])

    if n.needs[0]:
        w = _packed_weight(g, n, bits, blocks, block)
        if w is None:  # B or its zero points fed at run time: nothing onnxruntime could fold
            q, zero, scale = plain()
            w = g.Reshape((q - zero) * scale, [n_dim, blocks * block])
        if blocks * block != k_dim:
            w = g.Slice(w, g.const([0]), g.const([k_dim]), g.const([1]))
        grads[0] = g.MatMul(n.dy, cast(w, a), shape=a.shape)  # (..., N) @ (N, K)
    if need_scales or need_zero:
        rows_dy, rows_a = g.Reshape(n.dy, g.const([-1, n_dim])), g.Reshape(a, g.const([-1, k_dim]))
        dw = g.Gemm(rows_dy, rows_a, transA=1)  # (N, K)
        if blocks * block != k_dim:
            dw = g.Pad(dw, g.const([0, 0, 0, blocks * block - k_dim]))
        dw = g.Reshape(dw, g.const([n_dim, blocks, block]))
        q, zero, scale = plain()
        if need_scales:
            grads[2] = g.Cast(
                g.Reshape(g.ReduceSum(dw * (q - zero), [2], keepdims=0), g.shape_of(scales)), to=scales.dtype
            )
        if need_zero:
            d_zero = g.ReduceSum(dw, [2], keepdims=1) * scale * -1.0
            grads[3] = g.Cast(g.Reshape(d_zero, g.shape_of(zp)), to=zp.dtype)  # type: ignore[arg-type]
    return grads
