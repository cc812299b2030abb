"""The ONNX Attention op (opset 23+).

Attention's backward needs the softmax probabilities P. Rather than recomputing them -- which would
repeat every masking rule of the op (boolean and additive masks, bottom-right causal alignment with
a cache, ``nonpad_kv_seqlen``, sliding windows, fully masked rows) -- the rule asks the forward node
for its optional ``qk_matmul_output`` in mode 3, which is exactly P.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ....errors import GradientNotImplementedError
from ....model.graph import Dim, ValueInfo
from ...builder import GradBuilder, Var
from ...registry import NodeContext, rule
from ..common import (
    Grads,
    node_label,
    swap_last,
)

_AFTER_SOFTMAX = 3  # qk_matmul_output_mode that exposes the softmax probabilities


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
        dv_all = g.MatMul(swap_last(g, probs, 4), dy_g)  # (B, Hkv, Skv, Dv)
        if len(n.dout) > 2 and n.dout[2] is not None:
            dv_all = dv_all + n.dout[2]
        _split_cache(g, n, heads, dv_all, v, past_v, 2, 5, grads)
    if not (n.needs[0] or need_k or need_mask):
        return grads
    # The gradient of qk_matmul_output joins at the stage its mode exposes: 3 the probabilities,
    # 2 the masked logits, 1 the softcapped scores, 0 scale Q K^T.
    mode = int(n.attr("qk_matmul_output_mode", 0))
    d_qk = heads.group(n.dout[3]) if len(n.dout) > 3 and n.dout[3] is not None else None
    dp = g.MatMul(dy_g, swap_last(g, v_all, 4))  # (B, Hkv, R Sq, Skv)
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
        t = g.Tanh(g.MatMul(q_g, swap_last(g, k_all, 4)) * scale / softcap)
        ds = ds * (1.0 - t * t)
    if d_qk is not None and mode == 0:
        ds = ds + d_qk
    ds = ds * scale
    if n.needs[0]:
        grads[0] = heads.merge(heads.ungroup(g.MatMul(ds, k_all)), q)
    if need_k:
        dk_all = g.MatMul(swap_last(g, ds, 4), q_g)  # (B, Hkv, Skv, D)
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
