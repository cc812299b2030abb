"""Loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opset 12 on).

Both are ``l_i = -w[t_i] logp[i, t_i]`` per sample i (any trailing dims ``d1...`` count as more
samples), 0 where ``t_i == ignore_index``, then reduced: ``none``, ``sum``, or ``mean`` = sum(l) /
sum(w[t_i]) over the samples not ignored (their count when there are no weights). Every sample then
has a coefficient ``c_i = dL / d(-logp[i, t_i])`` (:func:`_targets`), the gradient of logp is
``-c_i`` at the label and 0 elsewhere, and SoftmaxCrossEntropyLoss runs that (plus the gradient of
its optional ``log_prob`` output) through the LogSoftmax backward, reading the log probabilities
its forward node computes anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from ...errors import GradientNotImplementedError
from ..builder import GradBuilder, Var, cast, exp, where
from ..registry import NodeContext, rule
from .common import Grads, node_label

INT64 = TensorProto.INT64


@dataclass(frozen=True)
class Targets:
    """What the backward of a loss needs to know about its labels.

    ``onehot``: bool (N, C, d...), true at each sample's label (also at ignored samples whose
    ``ignore_index`` is a valid class: their coefficient is 0). ``coef``: c_i, shaped like the
    labels when ``per_sample``, else one scalar for all (``sum``/``mean`` without weights or
    ``ignore_index``). ``valid``: bool, the samples not ignored (``None`` without ``ignore_index``).
    ``labels``: int64 labels, 0 at ignored samples (safe to gather with). ``total_weight``: the
    denominator sum(w_i) of a ``mean``. ``rank``: the rank of the scores.
    """

    onehot: Var
    coef: Var
    per_sample: bool
    valid: Var | None
    labels: Var
    reduction: str
    total_weight: Var | None
    rank: int


def _targets(g: GradBuilder, n: NodeContext, scores: Var, dy: Var) -> Targets:
    """Labels, per-sample weights and the coefficient c_i = dL / d(-logp[i, t_i]).

    ``none``: c_i = w_i dy_i; ``sum``: c_i = w_i dy; ``mean``: c_i = w_i dy / sum(w), where w_i is
    w[t_i] (or 1) and 0 for ignored samples.
    """
    labels, weight = n.inputs[1], n.inputs[2] if len(n.inputs) > 2 else None
    assert labels is not None
    rank = scores.rank if scores.rank is not None else None if labels.rank is None else labels.rank + 1
    if rank is None:
        raise GradientNotImplementedError(f"{node_label(n)}: the rank of its input must be known")
    lab = labels if labels.dtype == INT64 else g.Cast(labels, to=INT64)
    ignore = n.attr("ignore_index")
    valid = None if ignore is None else g.Not(g.Equal(lab, g.const(np.int64(ignore))))
    safe = lab if valid is None else where(valid, lab, g.const(np.int64(0)))
    # per-sample weights w_i, None meaning 1 for every sample
    w: Var | None = None
    if weight is not None:
        w = g.Gather(cast(weight, scores), safe, axis=0)
        if valid is not None:
            w = where(valid, w, 0)
    elif valid is not None:
        w = g.Cast(valid, to=scores.dtype)
    reduction = n.attr("reduction", "mean")
    total = None
    per = dy
    if reduction == "mean":
        if w is not None:
            total = g.ReduceSum(w, keepdims=0)
        else:
            static = labels.static_shape
            total = (
                g.const(float(np.prod(static)), scores.dtype)
                if static is not None
                else g.Cast(g.Size(labels), to=scores.dtype)
            )
        per = dy / total
    coef = per if w is None else w * per
    classes_n = (
        g.const(np.int64(scores.shape[1]))
        if scores.shape is not None and isinstance(scores.shape[1], int)
        else g.Squeeze(g.Slice(g.shape_of(scores), [1], [2]), [0])
    )
    classes = g.Reshape(
        g.Range(g.const(np.int64(0)), classes_n, g.const(np.int64(1))), [-1, *([1] * (rank - 2))]
    )
    onehot = g.Equal(g.Unsqueeze(lab, [1]), classes)
    per_sample = reduction == "none" or w is not None
    return Targets(onehot, coef, per_sample, valid, safe, reduction, total, rank)


def _logp_grad(g: GradBuilder, t: Targets) -> Var:
    """d(loss)/d(logp): -c_i at each sample's label, 0 elsewhere."""
    c = g.Unsqueeze(t.coef, [1]) if t.per_sample else t.coef
    return where(t.onehot, -c, 0)


def _weight_grad(g: GradBuilder, n: NodeContext, t: Targets, logp: Var, dy: Var) -> Var:
    """dL/dw[c] = sum over samples i with label c (not ignored) of dL/dw_i.

    With l_i = -logp[i, t_i]: ``none`` dL/dw_i = l_i dy_i, ``sum`` l_i dy, ``mean``
    (l_i - L) dy / sum(w), L the forward's loss.
    """
    weight = n.inputs[2]
    assert weight is not None
    nll = -g.Squeeze(g.GatherElements(logp, g.Unsqueeze(t.labels, [1]), axis=1), [1])
    if t.reduction == "mean":
        per = (nll - n.y) * (dy / t.total_weight)
    else:
        per = nll * dy
    if t.valid is not None:
        per = where(t.valid, per, 0)
    spread = where(t.onehot, g.Unsqueeze(per, [1]), 0)
    return cast(g.reduce_sum(spread, [0, *range(2, t.rank)], keepdims=False), weight)


@rule("NegativeLogLikelihoodLoss", since=12)
def nll_loss(g: GradBuilder, n: NodeContext) -> Grads:
    """loss = reduce(-w[t_i] input[i, t_i]): dinput = -c_i at the label, 0 elsewhere;
    dweight[c] sums dL/dw_i over the samples labelled c."""
    x = n.x
    grads: Grads = [None] * len(n.inputs)
    t = _targets(g, n, x, n.dy)
    if n.needs[0]:
        grads[0] = _logp_grad(g, t)
    if len(n.inputs) > 2 and n.needs[2]:
        grads[2] = _weight_grad(g, n, t, x, n.dy)
    return grads


@rule("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(g: GradBuilder, n: NodeContext) -> Grads:
    """loss = NLL(logp), logp = LogSoftmax(scores) over axis 1 (the optional second output).

    With G = dL/dlogp (from the loss, plus the gradient of the log_prob output when the model uses
    it): dscores = G - softmax * sum_c(G), softmax = exp(logp) read from the forward's log_prob.
    """
    x = n.x
    grads: Grads = [None] * len(n.inputs)
    logp = g.extra_output(n.node, 1, x.dtype, x.shape)
    dy, d_logp = n.dout[0], n.dout[1] if len(n.dout) > 1 else None
    t = _targets(g, n, x, dy) if dy is not None else None
    if n.needs[0]:
        total = _logp_grad(g, t) if t is not None else d_logp
        if t is not None and d_logp is not None:
            total = total + d_logp
        assert total is not None
        grads[0] = total - exp(logp) * g.reduce_sum(total, [1], keepdims=True)
    if dy is not None and len(n.inputs) > 2 and n.needs[2]:
        assert t is not None
        grads[2] = _weight_grad(g, n, t, logp, dy)
    return grads
