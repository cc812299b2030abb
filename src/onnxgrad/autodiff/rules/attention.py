"""Transformer blocks: Attention (opset 23+), RotaryEmbedding (opset 23), SwiGLU (opset 28),
LinearAttention (opset 27: backpropagation through time as two Scans).

Attention's backward needs the softmax probabilities P. Rather than recomputing them -- which would
repeat every masking rule of the op (boolean and additive masks, bottom-right causal alignment with
a cache, ``nonpad_kv_seqlen``, sliding windows, fully masked rows) -- the rule asks the forward node
for its optional ``qk_matmul_output`` in mode 3, which is exactly P. RotaryEmbedding is a rotation,
so its input gradient is the opposite rotation: the same op with the sine negated.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ...errors import GradientNotImplementedError
from ...model.graph import Dim, ValueInfo
from ..builder import GradBuilder, Var, sigmoid
from ..registry import NodeContext, rule
from .common import Grads, node_label, scan, zeros

_AFTER_SOFTMAX = 3  # qk_matmul_output_mode that exposes the softmax probabilities


def _swap_last(g: GradBuilder, x: Var) -> Var:
    return g.Transpose(x, perm=[0, 1, 3, 2])


def _dim(x: Var, axis: int) -> Dim:
    return None if x.shape is None else x.shape[axis]


# ---- Attention ------------------------------------------------------------------------------
class _Heads:
    """Moves tensors between the op's layouts and the grouped layout the backward works in.

    3-D tensors (B, S, H D) are split into heads (B, H, S, D). Grouped-query attention repeats each
    key/value head for ``q_heads / kv_heads`` consecutive query heads; folding those query heads
    into the sequence axis, (B, Hq, S, X) -> (B, Hkv, Hq / Hkv * S, X), makes every product an
    ordinary batched MatMul against the unrepeated K and V (and sums the repeats for free).
    """

    def __init__(self, g: GradBuilder, n: NodeContext, q: Var, k: Var) -> None:
        self.g, self.q, self.k = g, q, k
        self.three_d = q.rank == 3
        if self.three_d:
            self.q_heads: Dim = int(n.attr("q_num_heads"))
            self.kv_heads: Dim = int(n.attr("kv_num_heads"))
        else:
            self.q_heads, self.kv_heads = _dim(q, 1), _dim(k, 1)
        # Query heads equal key/value heads when both are known and equal: no regrouping.
        self.grouped = not (isinstance(self.q_heads, int) and self.q_heads == self.kv_heads)

    def split(self, x: Var, heads: Dim) -> Var:
        """(B, S, H D) -> (B, H, S, D); 4-D tensors pass."""
        if not self.three_d:
            return x
        return self.g.Transpose(self.g.Reshape(x, [0, 0, heads, -1]), perm=[0, 2, 1, 3])

    def merge(self, x: Var, like: Var) -> Var:
        """(B, H, S, D) -> the layout of ``like``."""
        if not self.three_d:
            return x
        return self.g.Reshape(self.g.Transpose(x, perm=[0, 2, 1, 3]), [0, 0, -1], shape=like.shape)

    def group(self, x: Var) -> Var:
        """(B, Hq, S, X) -> (B, Hkv, Hq / Hkv S, X)."""
        return self._heads_first(x, self.kv_heads, self.k) if self.grouped else x

    def ungroup(self, x: Var) -> Var:
        """(B, Hkv, Hq / Hkv S, X) -> (B, Hq, S, X)."""
        return self._heads_first(x, self.q_heads, self.q) if self.grouped else x

    def _heads_first(self, x: Var, heads: Dim, like: Var) -> Var:
        """x reshaped to (B, heads, -1, X); heads read from ``like`` (4-D) at run time if unknown."""
        g = self.g
        if isinstance(heads, int):
            return g.Reshape(x, [0, heads, -1, 0])
        count = g.Slice(g.shape_of(like), [1], [2])
        return g.Reshape(x, g.Concat(g.const([0]), count, g.const([-1, 0]), axis=0))


def _probabilities(g: GradBuilder, n: NodeContext, shape: tuple[Dim, ...] | None) -> Var:
    """The forward's softmax probabilities: its ``qk_matmul_output`` in mode 3, added if unused.

    Where the model reads that output in another mode (0, the default: scale Q K^T; 1: after
    softcap; 2: after the mask too), a copy of the node in mode 3 gives the probabilities (the
    attention is computed twice in the forward). The copy keeps present_key/present_value when the
    node has a cache (onnxruntime refuses past_key without present_key).
    """
    node = n.node
    mode = int(n.attr("qk_matmul_output_mode", 0))
    used = len(node.output) > 3 and bool(node.output[3])
    q = n.inputs[0]
    assert q is not None
    if used and mode != _AFTER_SOFTMAX:
        y = g.new_fwd_value(f"{node.output[0]}_copy", n.y.info)
        probs_name = g.new_fwd_value(f"{node.output[0]}_probs", ValueInfo("", q.dtype, shape))
        presents = ["", ""]
        for slot in (1, 2):
            out = n.outputs[slot] if len(n.outputs) > slot else None
            if out is not None or (len(node.input) > slot + 3 and node.input[slot + 3]):
                info = ValueInfo("", q.dtype, None)
                presents[slot - 1] = g.new_fwd_value(f"{node.output[0]}_present{slot}", info)
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = g.fresh(f"{node.name or 'Attention'}_probs")
        del copy.output[:]
        copy.output.extend([y, *presents, probs_name])
        _set_mode(copy, _AFTER_SOFTMAX)
        g.fwd_nodes.append(copy)
        return g.fwd(probs_name)
    probs = g.extra_output(node, 3, q.dtype, shape)
    _set_mode(node, _AFTER_SOFTMAX)
    return probs


def _set_mode(node: onnx.NodeProto, mode: int) -> None:
    """Set the node's ``qk_matmul_output_mode`` (an absent attribute means mode 0)."""
    for a in node.attribute:
        if a.name == "qk_matmul_output_mode":
            a.i = mode
            return
    node.attribute.append(helper.make_attribute("qk_matmul_output_mode", mode))


def _scale(g: GradBuilder, n: NodeContext, q: Var, heads: _Heads) -> Var | float:
    """The ``scale`` attribute, else 1 / sqrt(head size of Q)."""
    scale = n.attr("scale")
    if scale is not None:
        return float(scale)
    last = _dim(q, -1)
    if isinstance(last, int):
        size = last // heads.q_heads if heads.three_d and isinstance(heads.q_heads, int) else last
        return 1.0 / math.sqrt(size)
    size_v = g.Cast(g.Gather(g.shape_of(q), g.const(np.array(-1, dtype=np.int64))), to=q.dtype)
    if heads.three_d:
        size_v = size_v / float(heads.q_heads)  # type: ignore[arg-type]
    return g.Reciprocal(g.Sqrt(size_v))


@rule("Attention", since=23)
def attention(g: GradBuilder, n: NodeContext) -> Grads:
    """Y = P V with P = softmax(softcap(scale Q K^T) + bias), K, V after the past cache.

    dV = P^T dY; dP = dY V^T (+ the gradient of qk_matmul_output when the model uses it in mode
    3; in modes 2, 1, 0 it adds to the logits before, between or after the mask and softcap
    steps below); dS = P (dP - rowsum(dP P)) is the gradient of the logits, hence of an additive attn_mask
    (summed where the mask broadcasts, cut to the mask's length when it is shorter); softcap c
    multiplies it by 1 - tanh^2(scale Q K^T / c); then dQ = scale dS K and dK = scale dS^T Q.
    The cache: present_key = concat(past_key, K) along the sequence, so the gradient of the
    concatenation (plus that of present_key itself) splits between past_key and K. Grouped-query
    heads share K and V (see :class:`_Heads`). Boolean masks and nonpad_kv_seqlen get none.
    """
    q, k, v = n.inputs[0], n.inputs[1], n.inputs[2]
    assert q is not None and k is not None and v is not None
    mask = n.inputs[3] if len(n.inputs) > 3 else None
    past_k = n.inputs[4] if len(n.inputs) > 4 else None
    past_v = n.inputs[5] if len(n.inputs) > 5 else None
    if q.rank not in (3, 4):
        raise GradientNotImplementedError(f"{node_label(n)}: the rank of Q (3 or 4) must be known")
    heads = _Heads(g, n, q, k)
    grads: Grads = [None] * len(n.inputs)
    dy = heads.split(n.dout_or_zeros(0), heads.q_heads)

    # K and V as the scores saw them: after the cache (the present outputs), split into heads.
    if past_k is not None and past_v is not None:
        k_all = g.extra_output(n.node, 1, k.dtype, None)
        v_all = g.extra_output(n.node, 2, v.dtype, None)
    else:
        k_all, v_all = heads.split(k, heads.kv_heads), heads.split(v, heads.kv_heads)
    probs_shape = None
    if n.y.shape is not None and k_all.shape is not None:
        probs_shape = (_dim(n.y, 0), heads.q_heads, _dim(q, 2 if not heads.three_d else 1), _dim(k_all, 2))
    probs = heads.group(_probabilities(g, n, probs_shape))  # (B, Hkv, R Sq, Skv)
    dy_g = heads.group(dy)

    need_k = n.needs[1] or (past_k is not None and n.needs[4])
    need_v = n.needs[2] or (past_v is not None and n.needs[5])
    need_mask = mask is not None and n.needs[3]
    if need_v:
        dv_all = g.MatMul(_swap_last(g, probs), dy_g)  # (B, Hkv, Skv, Dv)
        if len(n.dout) > 2 and n.dout[2] is not None:
            dv_all = dv_all + n.dout[2]
        _split_cache(g, n, heads, dv_all, v, past_v, 2, 5, grads)
    if not (n.needs[0] or need_k or need_mask):
        return grads
    # The gradient of qk_matmul_output joins at the stage its mode exposes: 3 the probabilities,
    # 2 the masked logits, 1 the softcapped scores, 0 scale Q K^T.
    mode = int(n.attr("qk_matmul_output_mode", 0))
    d_qk = heads.group(n.dout[3]) if len(n.dout) > 3 and n.dout[3] is not None else None
    dp = g.MatMul(dy_g, _swap_last(g, v_all))  # (B, Hkv, R Sq, Skv)
    if d_qk is not None and mode == _AFTER_SOFTMAX:
        dp = dp + d_qk
    ds = probs * (dp - g.ReduceSum(dp * probs, [-1], keepdims=1))
    if d_qk is not None and mode == 2:
        ds = ds + d_qk
    if need_mask:
        grads[3] = _mask_grad(g, heads.ungroup(ds), mask, probs_shape)  # type: ignore[arg-type]
    if d_qk is not None and mode == 1:
        ds = ds + d_qk
    scale = _scale(g, n, q, heads)
    q_g = heads.group(heads.split(q, heads.q_heads))
    softcap = float(n.attr("softcap", 0.0) or 0.0)
    if softcap > 0:  # d(c tanh(s / c)) / ds = 1 - tanh^2(s / c), s = scale Q K^T recomputed
        t = g.Tanh(g.MatMul(q_g, _swap_last(g, k_all)) * scale / softcap)
        ds = ds * (1.0 - t * t)
    if d_qk is not None and mode == 0:
        ds = ds + d_qk
    ds = ds * scale
    if n.needs[0]:
        grads[0] = heads.merge(heads.ungroup(g.MatMul(ds, k_all)), q)
    if need_k:
        dk_all = g.MatMul(_swap_last(g, ds), q_g)  # (B, Hkv, Skv, D)
        if len(n.dout) > 1 and n.dout[1] is not None:
            dk_all = dk_all + n.dout[1]
        _split_cache(g, n, heads, dk_all, k, past_k, 1, 4, grads)
    return grads


def _split_cache(
    g: GradBuilder,
    n: NodeContext,
    heads: _Heads,
    d_all: Var,
    new: Var,
    past: Var | None,
    new_slot: int,
    past_slot: int,
    grads: Grads,
) -> None:
    """Split the gradient of concat(past, new) along the sequence axis between past and new."""
    if past is None:
        if n.needs[new_slot]:
            grads[new_slot] = heads.merge(d_all, new)
        return
    length = _dim(past, 2)
    cut = g.const([length]) if isinstance(length, int) else g.Slice(g.shape_of(past), [2], [3])
    if n.needs[past_slot]:
        grads[past_slot] = g.Slice(d_all, g.const([0]), cut, [2], shape=past.shape)
    if n.needs[new_slot]:
        end = g.const([np.iinfo(np.int64).max])
        grads[new_slot] = heads.merge(g.Slice(d_all, cut, end, [2]), new)


def _mask_grad(g: GradBuilder, ds: Var, mask: Var, shape: tuple[Dim, ...] | None) -> Var:
    """The gradient of an additive mask: dS (of ``shape``) summed where the mask broadcast, cut to
    the mask's key length where that is shorter (opset 24 pads a short mask with -inf)."""
    keys = None if mask.shape is None else mask.shape[-1]
    if not (isinstance(keys, int) and shape is not None and shape[-1] == keys):
        length = g.Slice(g.shape_of(mask), [-1], [np.iinfo(np.int64).max])
        ds = g.Slice(ds, g.const([0]), length, [-1])
        shape = None if shape is None else (*shape[:-1], keys)
    return g.unbroadcast(ds, mask, shape)


# ---- RotaryEmbedding ------------------------------------------------------------------------
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
    RotaryEmbedding (``rules/contrib.py``)."""
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


# ---- SwiGLU ---------------------------------------------------------------------------------
@rule("SwiGLU", since=28)
def swiglu(g: GradBuilder, n: NodeContext) -> Grads:
    """y = a sigmoid(alpha a) b: da = dy b s (1 + alpha a (1 - s)), db = dy a s, s = sigmoid(alpha a)."""
    a, b = n.inputs[0], n.inputs[1]
    assert a is not None and b is not None
    alpha = float(n.attr("alpha", 1.0))
    s = sigmoid(a * alpha if alpha != 1.0 else a)
    da = n.dy * b * s * (a * alpha * (1.0 - s) + 1.0) if n.needs[0] else None
    db = n.dy * a * s if n.needs[1] else None
    return [da, db]


# ---- LinearAttention ------------------------------------------------------------------------
_STATE_RANK = 4  # (B, Hkv, dk, dv): what the Scans declare for a state whose Var does not tell


def _write_step(sp: Var, k: Var, v: Var, a: Var | None, beta: Var | None) -> tuple[Var, Var, Var, Var | None]:
    """One recurrence step on (B, H, dk, dv) states, in the Scan body of ``sp``: (S~, kc, w, u) with
    S~ = a S_prev, kc = k as a column, u = v - S~^T k (delta rules) and w = beta u the row written,
    S = S~ + kc w."""
    body = sp.g
    st = sp if a is None else sp * body.Unsqueeze(a, [-1])
    kc = body.Unsqueeze(k, [-1])  # (B, H, dk, 1)
    row = body.Unsqueeze(v, [-2])  # (B, H, 1, dv)
    if beta is None:
        return st, kc, row, None
    u = row - _swap_last(body, kc) @ st
    return st, kc, body.Unsqueeze(beta, [-1]) * u, u


@rule("LinearAttention", since=27)
def linear_attention(g: GradBuilder, n: NodeContext) -> Grads:
    """The recurrence S_t = a_t S_{t-1} + k_t w_t^T, w_t = beta_t (v_t - (a_t S_{t-1})^T k_t) for the
    delta rules (v_t otherwise), a_t = exp(decay_t) for the gated rules (1 otherwise), read by
    o_t = scale S_t^T q_t for each query head of the group (GQA).

    Backpropagation through time as two Scans in the backward: one recomputes the states S_{t-1}
    from past_state, the other runs backwards carrying dS (seeded with the gradient of
    present_state): dS_t += scale q_t do_t^T; dq_t = scale S_t do_t; dk_t = dS_t w_t (- S~ du_t);
    dw_t = dS_t^T k_t; du_t = beta_t dw_t, dv_t = du_t (dw_t without delta), dbeta_t = <dw_t, u_t>;
    dS~ = dS_t (- k_t du_t^T); dS_{t-1} = a_t dS~; d decay_t = a_t sum(dS~ S_{t-1}) over dv (and
    dk for a per-head decay). The final dS is the gradient of past_state.
    """
    q, k, v = n.inputs[0], n.inputs[1], n.inputs[2]
    assert q is not None and k is not None and v is not None
    past = n.inputs[3] if len(n.inputs) > 3 else None
    decay = n.inputs[4] if len(n.inputs) > 4 else None
    beta = n.inputs[5] if len(n.inputs) > 5 else None
    grads: Grads = [None] * len(n.inputs)
    hq, hkv = int(n.attr("q_num_heads")), int(n.attr("kv_num_heads"))
    rule_name = str(n.attr("update_rule", "gated_delta"))
    gated, delta = rule_name in ("gated", "gated_delta"), rule_name in ("delta", "gated_delta")
    if (decay is not None) != gated or (beta is not None) != delta:
        raise GradientNotImplementedError(f"{node_label(n)}: decay/beta inputs do not match {rule_name!r}")
    groups = hq // hkv
    dt = q.dtype
    if (past is not None and past.dtype != dt) or any(x.dtype != dt for x in (k, v)):
        raise GradientNotImplementedError(f"{node_label(n)}: mixed element types")
    # scale: the attribute, else 1 / sqrt(dk); the output gradient is scaled once, outside the loop
    scale: float | Var
    if float(n.attr("scale", 0.0) or 0.0) != 0.0:
        scale = float(n.attr("scale"))
    elif q.shape is not None and isinstance(q.shape[-1], int):
        scale = 1.0 / math.sqrt(q.shape[-1] // hq)
    else:
        d_k = g.Cast(g.Gather(g.shape_of(q), g.const(np.array(-1, dtype=np.int64))), to=dt) / float(hq)
        scale = g.Reciprocal(g.Sqrt(d_k))

    def time_major(x: Var, heads: list[int]) -> Var:  # (B, T, heads... * d) -> (T, B, heads..., d)
        r = len(heads) + 3
        return g.Transpose(g.Reshape(x, [0, 0, *heads, -1]), perm=[1, 0, *range(2, r)], shape=(None,) * r)

    def batch_major(x: Var, like: Var) -> Var:  # back from (T, B, ...) to the layout of ``like``
        r = x.rank if x.rank is not None else 4
        return g.reshape(g.Transpose(x, perm=[1, 0, *range(2, r)]), like)

    qs = time_major(q, [hkv, groups])  # (T, B, Hkv, R, dk)
    ks, vs = time_major(k, [hkv]), time_major(v, [hkv])  # (T, B, Hkv, d)
    per_head_decay = False
    a_s = b_s = None
    if decay is not None:
        last = decay.shape[-1] if decay.shape is not None else None
        per_head_decay = isinstance(last, int) and last == hkv
        a_s = time_major(g.Exp(decay), [hkv])  # (T, B, Hkv, dk | 1)
    if beta is not None:  # (T, B, Hkv | 1, 1)
        b_s = g.Transpose(g.Unsqueeze(beta, [-1]), perm=[1, 0, 2, 3], shape=(None,) * 4)
    if past is not None:
        s0 = past
    else:
        s0 = zeros(g, g.Concat(g.Slice(g.Shape(ks), [1], [4]), g.Slice(g.Shape(vs), [3], [4]), axis=0), dt)
    extra = [x for x in (a_s, b_s) if x is not None]

    def gates(rest: list[Var]) -> tuple[Var | None, Var | None]:  # one step's a_t and beta_t
        it = iter(rest)
        return (next(it) if a_s is not None else None), (next(it) if b_s is not None else None)

    # Scan 1: the state before each step.
    def state_step(body: GradBuilder, states: list[Var], slices: list[Var]) -> tuple[list[Var], list[Var]]:
        (sp,), (k_t, v_t, *rest) = states, slices
        st, kc, w, _ = _write_step(sp, k_t, v_t, *gates(rest))
        return [st + kc @ w], [sp]

    _, (states,) = scan(g, [s0], [ks, vs, *extra], state_step, rank=_STATE_RANK)

    # Scan 2: backwards through time.
    dy = n.dout_or_zeros(0)
    dos = time_major(dy * scale, [hkv, groups])  # (T, B, Hkv, R, dv)
    d_present = n.dout[1] if len(n.dout) > 1 and n.dout[1] is not None else None
    ds0 = d_present if d_present is not None else g.zeros_like(past) if past is not None else s0

    def grad_step(body: GradBuilder, states: list[Var], slices: list[Var]) -> tuple[list[Var], list[Var]]:
        (ds,), (q_t, do_t, k_t, v_t, *rest, sp) = states, slices
        a_t, beta_t = gates(rest)
        st, kc, w, u = _write_step(sp, k_t, v_t, a_t, beta_t)
        s_t = st + kc @ w
        ds_t = ds + _swap_last(body, q_t) @ do_t
        dq_t = do_t @ _swap_last(body, s_t)  # (B, H, R, dk)
        dkc = ds_t @ _swap_last(body, w)  # (B, H, dk, 1)
        dw = _swap_last(body, kc) @ ds_t  # (B, H, 1, dv)
        d_st = ds_t
        outs = []
        if beta_t is not None:
            assert u is not None
            du = body.Unsqueeze(beta_t, [-1]) * dw
            dbeta = body.ReduceSum(dw * u, [3], keepdims=0)  # (B, H, 1)
            d_st = d_st - kc @ du
            dkc = dkc - st @ _swap_last(body, du)
            dv_t = body.Squeeze(du, [2])
        else:
            dbeta = None
            dv_t = body.Squeeze(dw, [2])
        dk_t = body.Squeeze(dkc, [3])
        if a_t is not None:
            d_sp = d_st * body.Unsqueeze(a_t, [-1])
            da = body.ReduceSum(d_st * sp, [3], keepdims=0)  # (B, H, dk)
            outs.append(da * a_t)  # per key dim; summed below for a per-head decay
        else:
            d_sp = d_st
        if dbeta is not None:
            outs.append(dbeta)
        return [d_sp], [dq_t, dk_t, dv_t, *outs]

    seqs = [qs, dos, ks, vs, *extra, states]
    out_ranks = [4, 3, 3] + [3] * len(extra)  # dq_t, dk_t, dv_t, then d decay_t and dbeta_t
    (d_past,), (dq, dk, dv, *rest) = scan(
        g, [ds0], seqs, grad_step, backward=True, rank=_STATE_RANK, out_ranks=out_ranks, portable=False
    )
    if n.needs[0]:
        grads[0] = batch_major(dq, q)
    if n.needs[1]:
        grads[1] = batch_major(dk, k)
    if n.needs[2]:
        grads[2] = batch_major(dv, v)
    if past is not None and n.needs[3]:
        grads[3] = g.Identity(d_past, shape=past.shape)
    if decay is not None:
        d_decay = rest.pop(0)  # (T, B, Hkv, dk)
        if n.needs[4]:
            assert a_s is not None
            d_decay = (
                g.ReduceSum(d_decay, [3], keepdims=1) if per_head_decay else g.unbroadcast(d_decay, a_s, None)
            )
            grads[4] = batch_major(d_decay, decay)
    if beta is not None and n.needs[5]:
        assert b_s is not None  # (T, B, Hkv, 1) to (T, B, Hkv | 1, 1): one beta may serve every head
        d_beta = g.unbroadcast(rest.pop(0), b_s, None)
        grads[5] = g.reshape(g.Transpose(d_beta, perm=[1, 0, 2, 3]), beta)
    return grads
