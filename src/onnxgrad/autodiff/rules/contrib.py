"""Gradient rules of the onnxruntime contrib ops that deployed models hold.

onnxruntime's transformer optimizer (``onnxruntime.transformers.optimizer.optimize_model``) and
onnxruntime-genai's model builder fuse the standard ops of a transformer into ``com.microsoft`` ops
(and two onnxruntime ops of the default domain, ``SimplifiedLayerNormalization`` and the opset-1
``LayerNormalization``). Each rule here is the standard ops' rule for the same math:
the normalizations compose :mod:`.norm`'s standardize / normalize_backward, the activations
:mod:`.elementwise`'s Gelu derivative, the rotary caches :mod:`.attention`'s; the attention ops
recompute their probabilities (:func:`_sdpa_backward`), as they expose none. Their output
types come from :mod:`onnxgrad.model.contrib_schemas` (ONNX shape inference knows none of them).

Inputs that cannot carry a gradient (packed 4-bit weights, integer ids and masks) get none; a float
input whose gradient a rule does not give is refused with the node, op, domain and input named.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from ...errors import GradientNotImplementedError
from ...model.contrib_schemas import MS_DOMAIN
from ...model.nbits import default_zero_point, pack_bits, unpack_bits
from ..builder import GradBuilder, Var, cast, sigmoid
from ..registry import NodeContext, formulas, rule
from .attention import rotary_cache_grads
from .common import Grads, as_int64, need_rank, zeros
from .elementwise import _gelu as gelu_backward
from .norm import layer_norm, mean_over, normalize_backward, normalized_count, rms_norm, standardize

INT64 = TensorProto.INT64
_SKIP_LN_EPS = 1e-12  # onnxruntime's default epsilon of SkipLayerNormalization and EmbedLayerNormalization


def unsupported(n: NodeContext, i: int, why: str) -> GradientNotImplementedError:
    """The error for float input ``i`` of a contrib node whose gradient the rule does not give."""
    name = n.node.input[i] if i < len(n.node.input) else f"#{i}"
    return GradientNotImplementedError(
        f"no gradient for input {i} ({name!r}) of node {n.node.name!r}: op {n.node.op_type!r}, "
        f"domain {n.node.domain or 'ai.onnx'!r}: {why}. Mark it as not trainable."
    )


def _input(n: NodeContext, i: int) -> Var | None:
    return n.inputs[i] if i < len(n.inputs) else None


def _refuse_output_grads(n: NodeContext, slots: tuple[int, ...], what: str) -> None:
    for k in slots:
        if k < len(n.dout) and n.dout[k] is not None:
            raise GradientNotImplementedError(
                f"no gradient through output {k} ({n.node.output[k]!r}, {what}) of node {n.node.name!r}: "
                f"op {n.node.op_type!r}, domain {n.node.domain or 'ai.onnx'!r}"
            )


# ---- activations ------------------------------------------------------------------------------
# Gelu (erf form), FastGelu (tanh form): the derivative of the standard Gelu rule
formulas("Gelu", lambda x, dy: gelu_backward(x, dy), domain=MS_DOMAIN)


def _quick_gelu(x: Var, dy: Var, alpha: float = 1.702) -> Var:
    """y = x sigmoid(alpha x): dy (s + alpha x s (1 - s))."""
    s = sigmoid(x * alpha)
    return dy * (s + x * alpha * s * (1 - s))


formulas("QuickGelu", _quick_gelu, domain=MS_DOMAIN)


def _biased(g: GradBuilder, n: NodeContext, dx: Var) -> Grads:
    """[dX, dbias] of an op of X + bias (bias optional, broadcast over the leading axes)."""
    bias = _input(n, 1)
    db = g.unbroadcast(dx, bias, n.y.shape) if bias is not None and n.needs[1] else None
    return [dx if n.needs[0] else None, db][: len(n.inputs)]


@rule("FastGelu", domain=MS_DOMAIN)
def fast_gelu(g: GradBuilder, n: NodeContext) -> Grads:
    """y = gelu_tanh(X + bias): dX = dy gelu_tanh'(X + bias), dbias = dX summed over the rows."""
    u = n.x if _input(n, 1) is None else n.x + n.inputs[1]
    return _biased(g, n, gelu_backward(u, n.dy, approximate="tanh"))


@rule("BiasGelu", domain=MS_DOMAIN)
def bias_gelu(g: GradBuilder, n: NodeContext) -> Grads:
    """y = gelu(A + B) (erf form): dA = dy gelu'(A + B), dB = dA summed over the rows."""
    return _biased(g, n, gelu_backward(n.x + n.inputs[1], n.dy))


@rule("BiasAdd", domain=MS_DOMAIN)
def bias_add(g: GradBuilder, n: NodeContext) -> Grads:
    """y = X + bias + skip: dX = dskip = dy, dbias = dy summed over (N, S)."""
    dy = n.dy
    bias, skip = n.inputs[1], n.inputs[2]
    return [
        dy if n.needs[0] else None,
        g.unbroadcast(dy, bias, n.y.shape) if n.needs[1] else None,  # type: ignore[arg-type]
        g.unbroadcast(dy, skip, n.y.shape) if n.needs[2] else None,  # type: ignore[arg-type]
    ]


# ---- FusedMatMul and MatMulNBits ------------------------------------------------------------------
def _swap_last(g: GradBuilder, x: Var, r: int) -> Var:
    """x (of rank r) with its last two axes swapped."""
    return g.Transpose(x, perm=[*range(r - 2), r - 1, r - 2])


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
    a1 = _swap_last(g, a, ra) if ta else a  # type: ignore[arg-type]
    b1 = _swap_last(g, b, rb) if tb else b  # type: ignore[arg-type]
    grads: Grads = [None, None]
    if n.needs[0]:
        da = g.MatMul(dy, _swap_last(g, b1, rb))  # type: ignore[arg-type]
        da = _swap_last(g, da, ry) if ta else da  # type: ignore[arg-type]
        grads[0] = g.unbroadcast(da, a, _batched(n, a))
    if n.needs[1]:
        db = g.MatMul(_swap_last(g, a1, ra), dy)  # type: ignore[arg-type]
        db = _swap_last(g, db, ry) if tb else db  # type: ignore[arg-type]
        grads[1] = g.unbroadcast(db, b, _batched(n, b))
    return grads


def _batched(n: NodeContext, x: Var) -> tuple | None:
    """The shape of a gradient before it is summed to ``x``: the output's batch dims, x's matrix dims."""
    if n.y.shape is None or x.shape is None:
        return None
    return (*n.y.shape[:-2], *x.shape[-2:])


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
    scales, zp = n.inputs[2], _input(n, 3)
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
    zp, g_idx, bias = _input(n, 3), _input(n, 4), _input(n, 5)
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


# ---- normalizations -------------------------------------------------------------------------------
def _skip_norm(g: GradBuilder, n: NodeContext, centered: bool) -> Grads:
    """SkipLayerNormalization (centered) and SkipSimplifiedLayerNormalization: y = norm(s) gamma (+
    beta) with s = input + skip (+ bias) over the last axis; outputs 1 and 2 are the mean (centered
    only) and inverse standard deviation of s, output 3 s itself.

    ds = normalize_backward(dy gamma) + (dmean - dinv inv^2 xh) / D (as the LayerNormalization rule)
    + the gradient of output 3; dinput = ds, dskip and dbias = ds summed to their shapes;
    dgamma = sum(dy xh), dbeta = sum(dy). s is the forward's output 3 (added when the model leaves
    it unused); the statistics are recomputed from it.
    """
    if not centered:
        _refuse_output_grads(n, (1,), "mean")
    x = n.inputs[0]
    assert x is not None
    gamma = n.inputs[2]
    beta = _input(n, 3) if centered else None
    bias = _input(n, 4) if centered else _input(n, 3)
    bias_slot = 4 if centered else 3
    grads: Grads = [None] * len(n.inputs)
    dy = n.dout[0]
    d_mean, d_inv, d_sum = (n.dout[k] if len(n.dout) > k else None for k in (1, 2, 3))
    if dy is not None and beta is not None and n.needs[3]:
        grads[3] = g.unbroadcast(dy, beta, x.shape)
    s = g.extra_output(n.node, 3, x.dtype, x.shape)
    mean = mean_over(g, [-1])
    ds = d_sum
    if dy is not None or d_mean is not None or d_inv is not None:
        xh, inv = standardize(g, s, mean, float(n.attr("epsilon", _SKIP_LN_EPS)), centered=centered)
        if dy is not None:
            if n.needs[2]:
                grads[2] = g.unbroadcast(dy * xh, gamma, x.shape)  # type: ignore[arg-type]
            dn = normalize_backward(dy * gamma, xh, inv, mean, centered=centered)
            ds = dn if ds is None else ds + dn
        if d_mean is not None or d_inv is not None:  # d inv / ds = -inv^3 (s - mean) / D
            extra = cast(d_mean, x) if d_mean is not None else None
            if d_inv is not None:
                term = cast(d_inv, x) * inv * inv * xh
                extra = -term if extra is None else extra - term
            stat = d_mean if d_mean is not None else d_inv
            extra = extra / normalized_count(g, x, [-1], stat)  # type: ignore[operator,arg-type]
            ds = extra if ds is None else ds + extra
    if ds is None:
        return grads
    if n.needs[0]:
        grads[0] = ds
    skip = n.inputs[1]
    if skip is not None and n.needs[1]:
        grads[1] = g.unbroadcast(ds, skip, x.shape)
    if bias is not None and n.needs[bias_slot]:
        grads[bias_slot] = g.unbroadcast(ds, bias, x.shape)
    return grads


@rule("SkipLayerNormalization", domain=MS_DOMAIN)
def skip_layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """LayerNormalization(input + skip + bias) gamma + beta over the last axis (see :func:`_skip_norm`)."""
    return _skip_norm(g, n, centered=True)


@rule("SkipSimplifiedLayerNormalization", domain=MS_DOMAIN)
def skip_simplified_layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """RMSNormalization(input + skip + bias) gamma over the last axis (see :func:`_skip_norm`)."""
    return _skip_norm(g, n, centered=False)


@rule("SimplifiedLayerNormalization")
def simplified_layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """onnxruntime's RMS normalization of the default domain (``axis``, ``epsilon``; no ONNX opset
    has it): the RMSNormalization rule; its
    inv_std_var output carries no gradient here (refused where the model differentiates it)."""
    _refuse_output_grads(n, (1,), "the inverse standard deviation")
    if n.dy is None:
        return [None] * len(n.inputs)
    return rms_norm(g, n)


# onnxruntime runs LayerNormalization at any opset (its own kernel before ONNX's opset 17): the
# same op, the same rule
rule("LayerNormalization", since=1)(layer_norm)


@rule("EmbedLayerNormalization", domain=MS_DOMAIN)
def embed_layer_norm(g: GradBuilder, n: NodeContext) -> Grads:
    """y = LayerNormalization(word[ids] + position[pos] + segment[segment_ids]) gamma + beta, pos
    the position_ids input or 0..S-1; output 2 is the sum, mask_index (output 1) is integer.

    dsum = normalize_backward(dy gamma) (+ the gradient of output 2); each table's gradient is dsum
    scatter-added at the rows it gathered (positions 0..S-1: dsum summed over the batch, padded with
    zero rows); dgamma = sum(dy xh), dbeta = sum(dy).
    """
    ids, seg_ids, words, positions, segments = (_input(n, k) for k in range(5))
    gamma, beta, pos_ids = _input(n, 5), _input(n, 6), _input(n, 8)
    assert ids is not None and words is not None and gamma is not None
    grads: Grads = [None] * len(n.inputs)
    dy = n.dout[0]
    d_sum = n.dout[2] if len(n.dout) > 2 else None
    out_shape = n.y.shape
    s = g.extra_output(n.node, 2, words.dtype, out_shape)
    mean = mean_over(g, [-1])
    ds = d_sum
    if dy is not None:
        if beta is not None and n.needs[6]:
            grads[6] = g.unbroadcast(dy, beta, out_shape)
        xh, inv = standardize(g, s, mean, float(n.attr("epsilon", _SKIP_LN_EPS)))
        if n.needs[5]:
            grads[5] = g.unbroadcast(dy * xh, gamma, out_shape)
        dn = normalize_backward(dy * gamma, xh, inv, mean)
        ds = dn if ds is None else ds + dn
    if ds is None:
        return grads
    if n.needs[2]:
        grads[2] = _scatter_rows(g, words, ids, ds)
    if segments is not None and seg_ids is not None and n.needs[4]:
        grads[4] = _scatter_rows(g, segments, seg_ids, ds)
    if positions is not None and n.needs[3]:
        if pos_ids is not None:  # (B, S), or (1, S) shared by the batch
            shared = pos_ids.shape is not None and pos_ids.shape[0] == 1
            grads[3] = _scatter_rows(
                g, positions, pos_ids, g.ReduceSum(ds, [0], keepdims=1) if shared else ds
            )
        else:  # rows 0..S-1, the same for every sequence of the batch
            per_pos = g.ReduceSum(ds, [0], keepdims=0)  # (S, hidden)
            length = g.Gather(g.shape_of(per_pos), g.const(np.int64(0)))
            rows = g.Range(g.const(np.int64(0)), length, g.const(np.int64(1)))
            grads[3] = _scatter_rows(g, positions, rows, per_pos)
    return grads


def _scatter_rows(g: GradBuilder, table: Var, ids: Var, d: Var) -> Var:
    """The gradient of ``table[ids]`` (rows gathered): ``d`` scatter-added into zero rows."""
    rows = g.Unsqueeze(as_int64(g, ids), [-1])
    dx = g.ScatterND(zeros(g, g.shape_of(table), d.dtype), rows, d, reduction="add")
    return g.reshape(dx, table)


# ---- RotaryEmbedding ----------------------------------------------------------------------------
@rule("RotaryEmbedding", domain=MS_DOMAIN)
def rotary_embedding(g: GradBuilder, n: NodeContext) -> Grads:
    """The rotation of :func:`.attention.rotary_embedding` with the contrib input order (input,
    position_ids, cos_cache, sin_cache): dX is the same contrib op with the sine negated; the
    caches' gradients are scatter-added at the rows position_ids gathered ((B, S), or (1,): an
    offset, rows offset..offset + S - 1), with :func:`.attention.rotary_cache_grads`."""
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
        steps = g.Range(g.const(np.int64(0)), _dim_of(g, x, seq_axis), g.const(np.int64(1)))
        batch = g.Slice(g.shape_of(x), g.const([0]), g.const([1]))
        rows = g.Expand(
            g.Reshape(rows, g.const([1, 1])) + g.Unsqueeze(steps, [0]), g.Concat(batch, g.const([1]), axis=0)
        )
    rotary_cache_grads(g, n, x, n.dy, rows, {2: cos, 3: sin}, grads)
    return grads


# ---- Attention, MultiHeadAttention, GroupQueryAttention -------------------------------------------
def _split_heads(g: GradBuilder, x: Var, heads: int) -> Var:
    """(B, S, N H) -> (B, N, S, H)."""
    return g.Transpose(g.Reshape(x, [0, 0, heads, -1]), perm=[0, 2, 1, 3])


def _merge_heads(g: GradBuilder, x: Var) -> Var:
    """(B, N, S, H) -> (B, S, N H)."""
    return g.Reshape(g.Transpose(x, perm=[0, 2, 1, 3]), [0, 0, -1])


def _last_dim(n: NodeContext, x: Var, slot: int) -> int:
    if x.shape is None or not isinstance(x.shape[-1], int):
        raise unsupported(n, slot, "its last dimension must be known")
    return x.shape[-1]


def _scale_of(n: NodeContext, head_size: int) -> float:
    scale = float(n.attr("scale", 0.0) or 0.0)
    return scale if scale else 1.0 / math.sqrt(head_size)


def _key_mask(g: GradBuilder, n: NodeContext, mask: Var | None, slot: int, q: Var, k: Var) -> Var | None:
    """True where a key is masked, broadcastable to (B, N, S, T): from an integer ``mask`` (0 masks:
    (B, T) or (B, S, T); (B,) the number of valid keys of each sequence), ``unidirectional`` adding
    the causal mask (key j after query i + T - S)."""
    masked = None
    key_pos = g.Range(g.const(np.int64(0)), _dim_of(g, k, 2), g.const(np.int64(1)))  # (T,)
    if mask is not None:
        if mask.rank == 1:
            valid = g.Unsqueeze(g.Cast(mask, to=INT64), [1, 2, 3])  # (B, 1, 1, 1)
            masked = g.GreaterOrEqual(key_pos, valid)
        elif mask.rank in (2, 3):
            axes = [1, 2] if mask.rank == 2 else [1]
            masked = g.Equal(g.Unsqueeze(g.Cast(mask, to=INT64), axes), g.const(np.int64(0)))
        else:
            raise unsupported(n, slot, f"a mask of rank {mask.rank} (the rule reads (B,), (B, T), (B, S, T))")
    if int(n.attr("unidirectional", 0)):
        masked = _or(g, masked, _causal(g, q, k, key_pos, None))
    return masked


def _dim_of(g: GradBuilder, x: Var, axis: int) -> Var:
    """Dimension ``axis`` of x as an int64 scalar."""
    return g.Gather(g.shape_of(x), g.const(np.int64(axis)))


def _causal(g: GradBuilder, q: Var, k: Var, key_pos: Var, total: Var | None) -> Var:
    """Key j after query i + total - S (total: the keys of each sequence, (B, 1, 1, 1), else T)."""
    s = _dim_of(g, q, 2)
    query_pos = g.Unsqueeze(g.Range(g.const(np.int64(0)), s, g.const(np.int64(1))), [1])  # (S, 1)
    end = total if total is not None else _dim_of(g, k, 2)
    return g.Greater(key_pos, query_pos + (end - s))


def _or(g: GradBuilder, a: Var | None, b: Var) -> Var:
    return b if a is None else g.Or(a, b)


def _sdpa_backward(
    g: GradBuilder,
    q: Var,
    k: Var,
    v: Var,
    dout: Var,
    scale: float,
    bias: Var | None,
    masked: Var | None,
    mask_value: float,
) -> tuple[Var, Var, Var, Var]:
    """(dQ, dK, dV, dS) of O = softmax(scale Q K^T + bias + masked mask_value) V, all (B, N, ., .).

    The probabilities are recomputed: dV = P^T dO; dP = dO V^T; dS = P (dP - rowsum(dP P)) (the
    gradient of the logits, hence of an additive bias); dQ = scale dS K; dK = scale dS^T Q.
    """
    s = g.MatMul(q, _swap_last(g, k, 4)) * scale
    if bias is not None:
        s = s + bias
    if masked is not None:  # added, as onnxruntime adds mask_filter_value; -inf: replaced
        fill = g.const(mask_value, s.dtype)
        zero = g.const(0.0, s.dtype)
        s = g.Where(masked, fill, s) if math.isinf(mask_value) else s + g.Where(masked, fill, zero)
    p = g.Softmax(s, axis=-1)
    dv = g.MatMul(_swap_last(g, p, 4), dout)
    dp = g.MatMul(dout, _swap_last(g, v, 4))
    ds = p * (dp - g.ReduceSum(dp * p, [-1], keepdims=1))
    dq = g.MatMul(ds, k) * scale
    dk = g.MatMul(_swap_last(g, ds, 4), q) * scale
    return dq, dk, dv, ds


def _refuse_inputs(n: NodeContext, slots: dict[int, str]) -> None:
    """Refuse a node that has any of these optional inputs (slot -> what the rule does not cover)."""
    for slot, what in slots.items():
        if slot < len(n.node.input) and n.node.input[slot]:
            raise GradientNotImplementedError(
                f"no gradient for node {n.node.name!r}: op {n.node.op_type!r}, domain "
                f"{n.node.domain or 'ai.onnx'!r}: input {slot} ({what}) is not supported"
            )


def _refuse_attrs(n: NodeContext, attrs: dict[str, object]) -> None:
    """Refuse a node whose attribute differs from the value the rule covers."""
    for name, default in attrs.items():
        if n.attr(name, default) != default:
            raise GradientNotImplementedError(
                f"no gradient for node {n.node.name!r}: op {n.node.op_type!r}, domain "
                f"{n.node.domain or 'ai.onnx'!r}: {name}={n.attr(name)!r} is not supported"
            )


_MASK_FILTER_VALUE = -10000.0  # onnxruntime's default mask_filter_value


@rule("MultiHeadAttention", domain=MS_DOMAIN)
def multi_head_attention(g: GradBuilder, n: NodeContext) -> Grads:
    """O = softmax(scale Q K^T + attention_bias + mask) V per head, Q, K, V (B, S|T, N H) with the
    packed ``bias`` (q, k, v biases) added first; key_padding_mask (B,) / (B, T) and
    ``unidirectional`` add ``mask_filter_value`` at masked keys. present_key / present_value (no
    past) are K and V split into heads: their gradients join dK, dV. See :func:`_sdpa_backward`.
    Packed QKV or KV, 4-D keys, past caches and the qk output are refused.
    """
    _refuse_inputs(n, {6: "past_key", 7: "past_value", 8: "past_sequence_length", 9: "cache_indirection"})
    _refuse_output_grads(n, (3,), "qk")
    q, k, v = n.inputs[0], _input(n, 1), _input(n, 2)
    assert q is not None
    if k is None or v is None or q.rank != 3 or k.rank != 3 or v.rank != 3:
        raise unsupported(n, 0, "query, key and value must be separate (B, S, D) tensors")
    bias, key_mask, attn_bias = _input(n, 3), _input(n, 4), _input(n, 5)
    heads = int(n.attr("num_heads"))
    dq_size, dk_size, dv_size = _last_dim(n, q, 0), _last_dim(n, k, 1), _last_dim(n, v, 2)
    if bias is not None:
        bq, bk, bv = g.Split(bias, g.const([dq_size, dk_size, dv_size]), axis=0, outputs=3)
        q, k, v = q + bq, k + bk, v + bv
    q4, k4, v4 = (_split_heads(g, x, heads) for x in (q, k, v))
    grads: Grads = [None] * len(n.inputs)
    masked = _key_mask(g, n, key_mask, 4, q4, k4)
    mask_value = float(n.attr("mask_filter_value", _MASK_FILTER_VALUE))
    dout = _split_heads(g, n.dout_or_zeros(0), heads)
    scale = _scale_of(n, dq_size // heads)
    dq, dk, dv, ds = _sdpa_backward(g, q4, k4, v4, dout, scale, attn_bias, masked, mask_value)
    if len(n.dout) > 1 and n.dout[1] is not None:  # present_key, present_value: K, V in heads
        dk = dk + n.dout[1]
    if len(n.dout) > 2 and n.dout[2] is not None:
        dv = dv + n.dout[2]
    dq3, dk3, dv3 = (_merge_heads(g, d) for d in (dq, dk, dv))
    grads[0] = dq3 if n.needs[0] else None
    grads[1] = dk3 if n.needs[1] else None
    grads[2] = dv3 if n.needs[2] else None
    if bias is not None and n.needs[3]:
        parts = [g.ReduceSum(d, [0, 1], keepdims=0) for d in (dq3, dk3, dv3)]
        grads[3] = g.Concat(*parts, axis=0)
    if attn_bias is not None and n.needs[5]:
        grads[5] = g.unbroadcast(ds, attn_bias, None)
    return grads


@rule("Attention", domain=MS_DOMAIN)
def contrib_attention(g: GradBuilder, n: NodeContext) -> Grads:
    """BERT's fused self-attention: Q, K, V = split(X W + bias) (``qkv_hidden_sizes``, else thirds),
    then :func:`multi_head_attention`'s math, mask_index (B,) / (B, T) / (B, S, T) and
    ``unidirectional`` adding ``mask_filter_value``, attention_bias added to the logits.

    dQKV = concat(dQ, dK, dV); dX = dQKV W^T, dW = X^T dQKV (rows of every batch), dbias = dQKV summed
    over the rows. Past state, rotary and the present output's gradient are refused.
    """
    _refuse_inputs(n, {4: "past", 6: "past_sequence_length"})
    _refuse_output_grads(n, (1,), "present")
    _refuse_attrs(n, {"do_rotary": 0, "past_present_share_buffer": 0})
    x, w, b = n.inputs[0], n.inputs[1], _input(n, 2)
    mask, attn_bias = _input(n, 3), _input(n, 5)
    assert x is not None and w is not None
    if x.rank != 3:
        raise unsupported(n, 0, "the input must be (B, S, hidden)")
    heads = int(n.attr("num_heads"))
    sizes = [int(v) for v in n.attr("qkv_hidden_sizes", []) or []]
    if not sizes:
        total = _last_dim(n, w, 1)
        sizes = [total // 3] * 3
    qkv = g.MatMul(x, w)
    if b is not None:
        qkv = qkv + b
    q, k, v = g.Split(qkv, g.const(sizes), axis=-1, outputs=3)
    q4, k4, v4 = (_split_heads(g, t, heads) for t in (q, k, v))
    masked = _key_mask(g, n, mask, 3, q4, k4)
    mask_value = float(n.attr("mask_filter_value", _MASK_FILTER_VALUE))
    dout = _split_heads(g, n.dout_or_zeros(0), heads)
    scale = _scale_of(n, sizes[0] // heads)
    dq, dk, dv, ds = _sdpa_backward(g, q4, k4, v4, dout, scale, attn_bias, masked, mask_value)
    d_qkv = g.Concat(*(_merge_heads(g, d) for d in (dq, dk, dv)), axis=-1)  # (B, S, Dq + Dk + Dv)
    grads: Grads = [None] * len(n.inputs)
    if n.needs[0]:
        grads[0] = g.MatMul(d_qkv, g.Transpose(w, perm=[1, 0]), shape=x.shape)
    if n.needs[1]:
        rows_x = g.Reshape(x, g.const([-1, _last_dim(n, x, 0)]))
        rows_d = g.Reshape(d_qkv, g.const([-1, sum(sizes)]))
        grads[1] = g.Gemm(rows_x, rows_d, transA=1, shape=w.shape)
    if b is not None and n.needs[2]:
        grads[2] = g.ReduceSum(d_qkv, [0, 1], keepdims=0, shape=b.shape)
    if attn_bias is not None and n.needs[5]:
        grads[5] = g.unbroadcast(ds, attn_bias, None)
    return grads


def _repeat_heads(g: GradBuilder, x: Var, groups: int, heads: int, size: int) -> Var:
    """(B, Nkv, T, H) -> (B, Nkv groups, T, H): each key/value head serves ``groups`` query heads."""
    if groups == 1:
        return x
    wide = g.Expand(g.Unsqueeze(x, [2]), g.const([1, 1, groups, 1, 1]))
    return g.Reshape(wide, g.const([0, heads, -1, size]))


def _sum_groups(g: GradBuilder, d: Var, groups: int, kv_heads: int, size: int) -> Var:
    """The adjoint of :func:`_repeat_heads`: the gradients of each head's copies summed."""
    if groups == 1:
        return d
    return g.ReduceSum(g.Reshape(d, g.const([0, kv_heads, groups, -1, size])), [2], keepdims=0)


@rule("GroupQueryAttention", domain=MS_DOMAIN)
def group_query_attention(g: GradBuilder, n: NodeContext) -> Grads:
    """O = softmax(scale Q K^T + attention_bias + causal and padding masks) V over the keys K =
    present_key (past_key then the new keys; K itself without a past), each key/value head serving
    num_heads / kv_num_heads consecutive query heads (their gradients summed).

    Sequence b has seqlens_k[b] + 1 keys: later ones are masked, and query i sees keys up to
    i + max(seqlens_k[b] + 1 - S, 0) (bottom-right with a past; a first prompt, shorter than S
    where padded, is causal from the top). The gradient of the keys (plus that of present_key)
    splits between past_key (the first P) and the new keys, as a concatenation: with a past, every
    sequence of the batch is taken to have all P past keys (onnxruntime packs a shorter one's new
    keys after its own past length). Packed QKV, rotary, softcap, local windows, smooth softmax and
    head sinks are refused.
    """
    _refuse_inputs(n, {9: "position_ids", 11: "head_sink"})
    _refuse_output_grads(n, (3,), "qk")
    _refuse_attrs(n, {"do_rotary": 0, "softcap": 0.0, "local_window_size": -1, "smooth_softmax": 0})
    q, k, v = n.inputs[0], _input(n, 1), _input(n, 2)
    past_k, past_v = _input(n, 3), _input(n, 4)
    seqlens, attn_bias = _input(n, 5), _input(n, 10)
    assert q is not None
    if k is None or v is None:
        raise unsupported(n, 0, "packed QKV (the rule reads separate query, key and value)")
    if (past_k is None) != (past_v is None):
        raise unsupported(n, 3 if past_k is not None else 4, "past_key and past_value come together")
    heads, kv_heads = int(n.attr("num_heads")), int(n.attr("kv_num_heads"))
    groups = heads // kv_heads
    size = _last_dim(n, q, 0) // heads
    q4 = _split_heads(g, q, heads)
    if past_k is not None:  # the keys and values the scores saw: the present outputs
        k4 = g.extra_output(n.node, 1, k.dtype, None)
        v4 = g.extra_output(n.node, 2, v.dtype, None)
    else:
        k4, v4 = _split_heads(g, k, kv_heads), _split_heads(g, v, kv_heads)
    k_rep, v_rep = _repeat_heads(g, k4, groups, heads, size), _repeat_heads(g, v4, groups, heads, size)
    key_pos = g.Range(g.const(np.int64(0)), _dim_of(g, k4, 2), g.const(np.int64(1)))
    s_len = _dim_of(g, q4, 2)
    query_pos = g.Unsqueeze(g.Range(g.const(np.int64(0)), s_len, g.const(np.int64(1))), [1])
    if seqlens is not None:
        total = g.Unsqueeze(g.Cast(seqlens, to=INT64), [1, 2, 3]) + g.const(np.int64(1))  # (B, 1, 1, 1)
        offset = g.Max(total - s_len, g.const(np.int64(0)))
        masked = g.Or(g.Greater(key_pos, query_pos + offset), g.GreaterOrEqual(key_pos, total))
    else:
        masked = g.Greater(key_pos, query_pos)  # (S, T)
    dout = _split_heads(g, n.dout_or_zeros(0), heads)
    dq, dk, dv, ds = _sdpa_backward(
        g, q4, k_rep, v_rep, dout, _scale_of(n, size), attn_bias, masked, -math.inf
    )
    dk, dv = _sum_groups(g, dk, groups, kv_heads, size), _sum_groups(g, dv, groups, kv_heads, size)
    if len(n.dout) > 1 and n.dout[1] is not None:
        dk = dk + n.dout[1]
    if len(n.dout) > 2 and n.dout[2] is not None:
        dv = dv + n.dout[2]
    grads: Grads = [None] * len(n.inputs)
    if n.needs[0]:
        grads[0] = _merge_heads(g, dq)
    for new_slot, past_slot, d, past in ((1, 3, dk, past_k), (2, 4, dv, past_v)):
        if past is None:
            grads[new_slot] = _merge_heads(g, d) if n.needs[new_slot] else None
            continue
        cut = g.Slice(g.shape_of(past), g.const([2]), g.const([3]))
        if n.needs[past_slot]:
            grads[past_slot] = g.Slice(d, g.const([0]), cut, g.const([2]), shape=past.shape)
        if n.needs[new_slot]:
            end = g.const([np.iinfo(np.int64).max])
            grads[new_slot] = _merge_heads(g, g.Slice(d, cut, end, g.const([2])))
    if attn_bias is not None and n.needs[10]:
        grads[10] = g.unbroadcast(ds, attn_bias, None)
    return grads
