"""onnxruntime's fused attention ops (com.microsoft): Attention (BERT's, with the QKV projection),
MultiHeadAttention and GroupQueryAttention.

Unlike the ONNX Attention op they expose no probabilities: each rule recomputes them
(:func:`_sdpa_backward`) with the op's masking (key padding, causal, sequence lengths).
"""

from __future__ import annotations

import math

import numpy as np

from ....model.contrib_schemas import MS_DOMAIN
from ...builder import INT64, GradBuilder, Var
from ...registry import NodeContext, rule
from ..common import (
    Grads,
    dim_of,
    optional_input,
    refuse_attrs,
    refuse_inputs,
    refuse_output_grads,
    swap_last,
    unsupported,
)


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
    key_pos = g.Range(g.const(np.int64(0)), dim_of(g, k, 2), g.const(np.int64(1)))  # (T,)
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


def _causal(g: GradBuilder, q: Var, k: Var, key_pos: Var, total: Var | None) -> Var:
    """Key j after query i + total - S (total: the keys of each sequence, (B, 1, 1, 1), else T)."""
    s = dim_of(g, q, 2)
    query_pos = g.Unsqueeze(g.Range(g.const(np.int64(0)), s, g.const(np.int64(1))), [1])  # (S, 1)
    end = total if total is not None else dim_of(g, k, 2)
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
    s = g.MatMul(q, swap_last(g, k, 4)) * scale
    if bias is not None:
        s = s + bias
    if masked is not None:  # added, as onnxruntime adds mask_filter_value; -inf: replaced
        fill = g.const(mask_value, s.dtype)
        zero = g.const(0.0, s.dtype)
        s = g.Where(masked, fill, s) if math.isinf(mask_value) else s + g.Where(masked, fill, zero)
    p = g.Softmax(s, axis=-1)
    dv = g.MatMul(swap_last(g, p, 4), dout)
    dp = g.MatMul(dout, swap_last(g, v, 4))
    ds = p * (dp - g.ReduceSum(dp * p, [-1], keepdims=1))
    dq = g.MatMul(ds, k) * scale
    dk = g.MatMul(swap_last(g, ds, 4), q) * scale
    return dq, dk, dv, ds


_MASK_FILTER_VALUE = -10000.0  # onnxruntime's default mask_filter_value


@rule("MultiHeadAttention", domain=MS_DOMAIN)
def multi_head_attention(g: GradBuilder, n: NodeContext) -> Grads:
    """O = softmax(scale Q K^T + attention_bias + mask) V per head, Q, K, V (B, S|T, N H) with the
    packed ``bias`` (q, k, v biases) added first; key_padding_mask (B,) / (B, T) and
    ``unidirectional`` add ``mask_filter_value`` at masked keys. present_key / present_value (no
    past) are K and V split into heads: their gradients join dK, dV. See :func:`_sdpa_backward`.
    Packed QKV or KV, 4-D keys, past caches and the qk output are refused.
    """
    refuse_inputs(n, {6: "past_key", 7: "past_value", 8: "past_sequence_length", 9: "cache_indirection"})
    refuse_output_grads(n, (3,), "qk")
    q, k, v = n.inputs[0], optional_input(n, 1), optional_input(n, 2)
    assert q is not None
    if k is None or v is None or q.rank != 3 or k.rank != 3 or v.rank != 3:
        raise unsupported(n, 0, "query, key and value must be separate (B, S, D) tensors")
    bias, key_mask, attn_bias = optional_input(n, 3), optional_input(n, 4), optional_input(n, 5)
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
    refuse_inputs(n, {4: "past", 6: "past_sequence_length"})
    refuse_output_grads(n, (1,), "present")
    refuse_attrs(n, {"do_rotary": 0, "past_present_share_buffer": 0})
    x, w, b = n.inputs[0], n.inputs[1], optional_input(n, 2)
    mask, attn_bias = optional_input(n, 3), optional_input(n, 5)
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


def _split_present(
    g: GradBuilder,
    n: NodeContext,
    d: Var,
    past: Var,
    offset: Var,
    s_len: Var,
    slots: tuple[int, int],
    grads: Grads,
) -> None:
    """The gradient ``d`` (B, Nkv, T, H) of GroupQueryAttention's present keys (or values), into
    those of its new keys (slot ``slots[0]``) and past keys (``slots[1]``, (B, Nkv, P, H)).

    onnxruntime writes sequence b's present rows as its first ``offset[b]`` past rows, then its S
    new rows (offset (B, 1, 1, 1): max(seqlens_k[b] + 1 - S, 0)); a padded sequence's new rows thus
    start before P. So the new keys' gradient is gathered from rows offset[b] .. offset[b] + S - 1,
    and past row t gets that of present row t where t < offset[b], zero where the sequence does not
    read it."""
    new_slot, past_slot = slots
    one, zero = g.const(np.int64(1)), g.const(np.int64(0))
    if n.needs[new_slot]:
        rows = offset + g.Unsqueeze(g.Range(zero, s_len, one), [0, 1, 3])  # (B, 1, S, 1)
        dims = g.shape_of(d)
        size = g.Concat(
            g.Slice(dims, g.const([0]), g.const([2])),
            g.Unsqueeze(s_len, [0]),
            g.Slice(dims, g.const([3]), g.const([4])),
            axis=0,
        )
        grads[new_slot] = _merge_heads(g, g.GatherElements(d, g.Expand(rows, size), axis=2))
    if n.needs[past_slot]:
        length = dim_of(g, past, 2)
        read = g.Less(g.Unsqueeze(g.Range(zero, length, one), [0, 1, 3]), offset)  # (B, 1, P, 1)
        head = g.Slice(d, g.const([0]), g.Unsqueeze(length, [0]), g.const([2]))
        grads[past_slot] = g.Where(read, head, g.const(0.0, d.dtype), shape=past.shape)


@rule("GroupQueryAttention", domain=MS_DOMAIN)
def group_query_attention(g: GradBuilder, n: NodeContext) -> Grads:
    """O = softmax(scale Q K^T + attention_bias + causal and padding masks) V over the keys K =
    present_key (past_key then the new keys; K itself without a past), each key/value head serving
    num_heads / kv_num_heads consecutive query heads (their gradients summed).

    Sequence b has seqlens_k[b] + 1 keys: later ones are masked, and query i sees keys up to
    i + max(seqlens_k[b] + 1 - S, 0) (bottom-right with a past; a first prompt, shorter than S
    where padded, is causal from the top). The gradient of the keys (plus that of present_key)
    splits between past_key and the new keys as onnxruntime writes present_key: sequence b's new
    keys follow its own max(seqlens_k[b] + 1 - S, 0) past keys (:func:`_split_present`), so the
    later rows of its past_key get no gradient. Packed QKV and rotary reach the rule unfused
    (:mod:`onnxgrad.autodiff.unfuse`); softcap, local windows, smooth softmax and head sinks are
    refused.
    """
    refuse_inputs(n, {9: "position_ids", 11: "head_sink"})
    refuse_output_grads(n, (3,), "qk")
    refuse_attrs(n, {"do_rotary": 0, "softcap": 0.0, "local_window_size": -1, "smooth_softmax": 0})
    q, k, v = n.inputs[0], optional_input(n, 1), optional_input(n, 2)
    past_k, past_v = optional_input(n, 3), optional_input(n, 4)
    seqlens, attn_bias = optional_input(n, 5), optional_input(n, 10)
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
    key_pos = g.Range(g.const(np.int64(0)), dim_of(g, k4, 2), g.const(np.int64(1)))
    s_len = dim_of(g, q4, 2)
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
        elif seqlens is None:  # every sequence holds all P past keys: a concatenation
            cut = g.Slice(g.shape_of(past), g.const([2]), g.const([3]))
            if n.needs[past_slot]:
                grads[past_slot] = g.Slice(d, g.const([0]), cut, g.const([2]), shape=past.shape)
            if n.needs[new_slot]:
                end = g.const([np.iinfo(np.int64).max])
                grads[new_slot] = _merge_heads(g, g.Slice(d, cut, end, g.const([2])))
        else:
            _split_present(g, n, d, past, offset, s_len, (new_slot, past_slot), grads)
    if attn_bias is not None and n.needs[10]:
        grads[10] = g.unbroadcast(ds, attn_bias, None)
    return grads
