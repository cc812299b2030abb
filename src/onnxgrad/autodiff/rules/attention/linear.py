"""LinearAttention (opset 27): backpropagation through time as two Scans."""

from __future__ import annotations

import math

import numpy as np

from ....errors import GradientNotImplementedError
from ...builder import GradBuilder, Var
from ...registry import NodeContext, rule
from ..common import (
    Grads,
    node_label,
    scan,
    swap_last,
    zeros,
)

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
    u = row - swap_last(body, kc, 4) @ st
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
        ds_t = ds + swap_last(body, q_t, 4) @ do_t
        dq_t = do_t @ swap_last(body, s_t, 4)  # (B, H, R, dk)
        dkc = ds_t @ swap_last(body, w, 4)  # (B, H, dk, 1)
        dw = swap_last(body, kc, 4) @ ds_t  # (B, H, 1, dv)
        d_st = ds_t
        outs = []
        if beta_t is not None:
            assert u is not None
            du = body.Unsqueeze(beta_t, [-1]) * dw
            dbeta = body.ReduceSum(dw * u, [3], keepdims=0)  # (B, H, 1)
            d_st = d_st - kc @ du
            dkc = dkc - st @ swap_last(body, du, 4)
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
