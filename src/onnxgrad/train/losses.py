"""Loss functions appended to an ONNX model as plain ONNX nodes.

:func:`add_loss` turns a model into a training model: it reads one of the model's values and a new
target input, and adds a scalar output (``"loss"``) computed only from ops that have gradient rules
(or carry no gradient), so :func:`onnxgrad.build_gradient` can differentiate it with
``outputs=["loss"]``. :func:`remove_loss` undoes it on a trained model, giving the inference model.

Formulas (``x`` the model value, ``t`` the target, ``w`` the optional per-sample weights):

* ``mse``: ``(x - t)^2``; ``l1``: ``|x - t|``;
* ``huber``: ``0.5 d^2`` where ``|d| < δ``, else ``δ (|d| - 0.5 δ)``, ``d = x - t``, written
  ``q (|d| - q / 2)`` with ``q = min(|d|, δ)`` (torch's ``huber_loss``);
* ``bce_with_logits``: ``softplus(x) - x t``, the stable form of
  ``-t log σ(x) - (1-t) log(1-σ(x))``;
* ``cross_entropy``: ``-Σ_c onehot(t)_c log_softmax(x)_c``, classes on axis 1, integer targets;
* ``nll``: ``-Σ_c onehot(t)_c x_c`` for log-probabilities ``x`` (torch's ``nll_loss``); with
  ``probabilities=True``, ``x`` holds probabilities and the loss reads ``log(max(x, tiny))``.

``reduction="mean"`` averages over every element (weighted: ``Σ w l / (Σ w · elements per
sample)``), ``"sum"`` adds them up, as PyTorch's functional losses do. Penalties are added to the
reduced loss: ``+ Σ_W l1_W Σ|W| + l2_W Σ W²`` over the chosen initializers ``W``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..autodiff.params import apply_parameters
from ..errors import InputError
from ..model.emit import Emitter
from ..model.graph import (
    FLOAT_TYPES,
    MAX_IR_VERSION,
    ValueInfo,
    check_model,
    ir_version_for,
    np_dtype,
    opset_of,
)
from ..model.infer import infer_value_infos
from ..model.load import CheckedModel, load_checked, load_model

__all__ = ["CLASS_LOSSES", "LOSSES", "add_loss", "keep_outputs", "remove_loss", "with_parameters"]

LOSSES = ("mse", "l1", "huber", "cross_entropy", "nll", "bce_with_logits")
CLASS_LOSSES = ("cross_entropy", "nll")  # integer class targets, classes on axis 1
REDUCTIONS = ("mean", "sum")
Penalty = float | Mapping[str, float]
_Emitter = Emitter  # the emitter's name before it became public (onnxgrad.model.emit); kept for imports


def add_loss(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes,
    kind: str,
    *,
    output: str | None = None,
    target_name: str = "target",
    weight_name: str | None = None,
    reduction: str = "mean",
    loss_name: str = "loss",
    delta: float = 1.0,
    probabilities: bool = False,
    l1: Penalty = 0.0,
    l2: Penalty = 0.0,
    penalized: Iterable[str] | None = None,
) -> onnx.ModelProto:
    """A copy of ``model`` with a new input ``target_name`` and a new scalar output ``loss_name``.

    ``kind``: one of :data:`LOSSES`. ``output``: the value the loss reads, a model output (default:
    the first) or any floating-point value computed inside the graph (e.g. the logits before a
    Softmax). ``weight_name``: when given, a new input of per-sample weights, shape ``(N,)``.
    ``delta``: the threshold of ``huber``. ``probabilities``: for ``nll``, the value holds
    probabilities rather than log-probabilities.
    ``l1`` / ``l2``: penalty coefficients, one number for every weight in ``penalized`` (default:
    every floating-point initializer of rank >= 2, i.e. weight matrices and kernels, not biases), or a
    mapping initializer name -> coefficient.
    The original outputs stay outputs; differentiate with ``build_gradient(m, outputs=[loss_name])``
    so that the loss is the only output taking a gradient.
    """
    if kind not in LOSSES:
        raise InputError(f"unknown loss {kind!r}; expected one of {list(LOSSES)}")
    if reduction not in REDUCTIONS:
        raise InputError(f"unknown reduction {reduction!r}; expected one of {list(REDUCTIONS)}")
    if kind == "huber" and not delta > 0:
        raise InputError(f"huber needs delta > 0, got {delta}")
    if probabilities and kind != "nll":
        raise InputError(f"probabilities=True applies to the 'nll' loss only, not {kind!r}")
    result = onnx.ModelProto()
    result.CopyFrom(load_model(model))
    graph = result.graph
    outputs = [o.name for o in graph.output]
    if not outputs and output is None:
        raise InputError("the model has no output to compute a loss from")
    output = outputs[0] if output is None else output
    infos = infer_value_infos(result)
    computed = {o for n in graph.node for o in n.output}
    if output not in outputs and output not in computed:
        raise InputError(f"{output!r} is neither an output nor a value of the model (outputs: {outputs})")
    info = infos.get(output)
    if info is None or not info.is_float:
        raise InputError(f"value {output!r} is not a floating-point tensor: it cannot feed a loss")
    existing = {v.name for v in (*graph.input, *graph.output, *graph.initializer)} | computed
    new_names = [n for n in (target_name, weight_name, loss_name) if n is not None]
    for name in new_names:
        if name in existing:
            raise InputError(f"the model already has a value named {name!r}; choose another name")
    if len(set(new_names)) < len(new_names):
        raise InputError(f"the target, weight and loss names must differ, got {new_names}")
    penalties = _penalties(graph, l1, l2, penalized)

    e = Emitter(graph, opset_of(result), info.dtype, loss_name)
    e.taken.update(new_names)
    if kind in CLASS_LOSSES:
        per_elem, elem_rank = _class_loss(e, kind, output, info, target_name, probabilities), _rank(info, -1)
    else:
        target = helper.make_tensor_value_info(target_name, info.dtype, _dims(info.shape))
        graph.input.append(target)
        if kind == "huber":
            per_elem = _huber(e, output, target_name, delta)
        else:
            per_elem = _ELEMENTWISE[kind](e, output, target_name)
        elem_rank = _rank(info, 0)
    final = None if penalties else loss_name
    loss = _reduce(e, per_elem, elem_rank, weight_name, reduction, info, final)
    if penalties:
        _add_penalties(e, loss, penalties, infos, loss_name)
    graph.output.append(helper.make_tensor_value_info(loss_name, info.dtype, []))
    _set_ir_version(result)
    check_model(result)
    return result


def _set_ir_version(model: onnx.ModelProto) -> None:
    # What the opsets need, never below what the model had, at most what onnxruntime loads.
    floor = min(model.ir_version, MAX_IR_VERSION)
    model.ir_version = max(ir_version_for(model.opset_import), floor)


def _dims(shape: tuple | None) -> list | None:
    return None if shape is None else list(shape)


def _rank(info: ValueInfo, delta: int) -> int | None:
    return None if info.rank is None else info.rank + delta


# ---- per-element losses ------------------------------------------------------------------------
def _mse(e: Emitter, x: str, t: str) -> str:
    d = e.op("Sub", x, t)
    return e.op("Mul", d, d)


def _l1(e: Emitter, x: str, t: str) -> str:
    # |x - t|: the gradient is sign(x - t), pointing uphill as a gradient must (onnxcustom had it
    # the other way round, so its absolute loss trained away from the targets).
    return e.op("Abs", e.op("Sub", x, t))


def _huber(e: Emitter, x: str, t: str, delta: float) -> str:
    # q (|d| - q/2) with q = min(|d|, δ): one formula for both branches, no Where needed, and the
    # gradient sign(d) q is continuous at |d| = δ whichever side Min's tie goes.
    a = e.op("Abs", e.op("Sub", x, t))
    q = e.op("Min", a, e.const(delta))
    return e.op("Mul", q, e.op("Sub", a, e.op("Mul", q, e.const(0.5))))


def _bce_with_logits(e: Emitter, x: str, t: str) -> str:
    # softplus(x) - x t: onnxruntime's Softplus is overflow-safe and its gradient, σ(x), is exact.
    return e.op("Sub", e.op("Softplus", x), e.op("Mul", x, t))


_ELEMENTWISE = {"mse": _mse, "l1": _l1, "bce_with_logits": _bce_with_logits}


def _class_loss(e: Emitter, kind: str, scores: str, info: ValueInfo, target: str, probabilities: bool) -> str:
    """``-logp[target]`` per sample (per position for rank > 2), picked by a one-hot mask.

    ``logp`` is ``log_softmax(scores)`` (cross_entropy), ``scores`` (nll) or
    ``log(max(scores, tiny))`` (nll from probabilities). The one-hot mask
    ``Equal(target[:, None], classes)`` carries no gradient, so the path from the scores only
    crosses LogSoftmax or Log, Mul, ReduceSum and Neg.
    """
    rank = info.rank
    if rank is None or rank < 2:
        raise InputError(f"{kind} needs scores of known rank >= 2 (N, C, ...), got shape {info.shape}")
    if e.opset < 11 or (rank > 2 and e.opset < 13):
        raise InputError(f"{kind} needs opset >= 11 (>= 13 for rank > 2 scores); the model has {e.opset}")
    shape = list(info.shape)  # type: ignore[arg-type]
    e.graph.input.append(helper.make_tensor_value_info(target, TensorProto.INT64, shape[:1] + shape[2:]))
    classes = shape[1]
    trailing = [1] * (rank - 2)  # classes broadcast against (N, 1, d1, ...)
    if isinstance(classes, int):
        ids = e.const(np.arange(classes).reshape([classes, *trailing]), TensorProto.INT64)
    else:  # dynamic class count: Range(0, C) from the scores' shape
        c = e.op("Gather", e.op("Shape", scores), e.const(1, TensorProto.INT64), axis=0)
        zero, one = e.const(0, TensorProto.INT64), e.const(1, TensorProto.INT64)
        ids = e.op("Range", zero, c, one)
        if trailing:
            ids = e.axes_op("Unsqueeze", ids, list(range(1, rank - 1)))
    hit = e.op("Equal", e.axes_op("Unsqueeze", target, [1]), ids)
    onehot = e.op("Cast", hit, to=e.dtype)
    if kind == "cross_entropy":
        logp = e.op("LogSoftmax", scores, axis=1)
    elif probabilities:
        # log(0) would be -inf and its gradient inf: clamp at the smallest normal number.
        logp = e.op("Log", e.op("Max", scores, e.const(np.finfo(np_dtype(e.dtype)).tiny)))
    else:
        logp = scores
    picked = e.axes_op("ReduceSum", e.op("Mul", onehot, logp), [1], keepdims=0)
    return e.op("Neg", picked)


def _reduce(
    e: Emitter,
    per_elem: str,
    rank: int | None,
    weight_name: str | None,
    reduction: str,
    info: ValueInfo,
    out: str | None,
) -> str:
    """The scalar loss from per-element losses, optionally weighted per sample (axis 0)."""
    op = "ReduceMean" if reduction == "mean" else "ReduceSum"
    if weight_name is None:
        return e.op(op, per_elem, out=out, keepdims=0)  # no axes: every element
    if rank is None or rank < 1:
        raise InputError(f"sample weights need an output of known rank >= 1, not {info.shape}")
    batch = None if info.shape is None else info.shape[0]
    e.graph.input.append(helper.make_tensor_value_info(weight_name, info.dtype, [batch]))
    w = weight_name
    if rank > 1:
        w = e.axes_op("Unsqueeze", w, list(range(1, rank)))
    weighted = e.op("Mul", per_elem, w)
    if reduction == "sum":
        return e.op("ReduceSum", weighted, out=out, keepdims=0)
    # mean(w l) / mean(w) = Σ w l / (Σ w · elements per sample): the weighted mean.
    num = e.op("ReduceMean", weighted, keepdims=0)
    return e.op("Div", num, e.op("ReduceMean", weight_name, keepdims=0), out=out)


# ---- penalties ---------------------------------------------------------------------------------
def _penalties(
    graph: onnx.GraphProto, l1: Penalty, l2: Penalty, penalized: Iterable[str] | None
) -> list[tuple[str, float, float]]:
    """``(initializer, l1, l2)`` for each penalized weight, validated."""
    floats = {i.name: i for i in graph.initializer if i.data_type in FLOAT_TYPES}
    names = None if penalized is None else list(dict.fromkeys(penalized))
    coefs: dict[str, list[float]] = {}
    for slot, value in enumerate((l1, l2)):
        label = ("l1", "l2")[slot]
        if isinstance(value, Mapping):
            if names is not None:
                raise InputError(f"give {label} either as a mapping or with penalized=, not both")
            per_name = dict(value)
        elif value:
            chosen = names if names is not None else [n for n, t in floats.items() if len(t.dims) >= 2]
            if not chosen:
                raise InputError(f"{label}={value}: the model has no weight of rank >= 2 to penalize")
            per_name = dict.fromkeys(chosen, value)
        else:
            continue
        for name, coef in per_name.items():
            if name not in floats:
                kind = "not floating-point" if any(i.name == name for i in graph.initializer) else "unknown"
                raise InputError(f"{label} penalty on {name!r}: {kind} initializer (have {list(floats)})")
            if not float(coef) >= 0:
                raise InputError(f"{label} penalty on {name!r} must be >= 0, got {coef}")
            coefs.setdefault(name, [0.0, 0.0])[slot] = float(coef)
    return [(name, a, b) for name, (a, b) in coefs.items() if a or b]


def _add_penalties(
    e: Emitter,
    data_loss: str,
    penalties: list[tuple[str, float, float]],
    infos: Mapping[str, ValueInfo],
    out: str,
) -> str:
    """``data_loss + Σ l1 Σ|W| + l2 Σ W²``, each term cast to the loss dtype when W's differs."""
    terms = [data_loss]
    for name, a, b in penalties:
        w = name
        if infos[name].dtype != e.dtype:
            w = e.op("Cast", w, to=e.dtype)
        for coef, reduce_op in ((a, "ReduceL1"), (b, "ReduceSumSquare")):
            if coef:
                terms.append(e.op("Mul", e.const(coef), e.axes_op(reduce_op, w, None, keepdims=0)))
    total = terms[0]
    for k, term in enumerate(terms[1:], start=2):
        total = e.op("Add", total, term, out=out if k == len(terms) else None)
    return total


# ---- back to inference -------------------------------------------------------------------------
def keep_outputs(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes, names: Sequence[str]
) -> onnx.ModelProto:
    """A copy of ``model`` with only the outputs ``names``, and only what they need.

    Nodes that no kept output reads are dropped, then inputs and initializers that nothing reads.
    """
    result = onnx.ModelProto()
    result.CopyFrom(load_model(model))
    g = result.graph
    have = [o.name for o in g.output]
    missing = [n for n in names if n not in have]
    if missing:
        raise InputError(f"the model has no output named {missing[0]!r} (outputs: {have})")
    outputs = [o for o in g.output if o.name in set(names)]
    del g.output[:]
    g.output.extend(outputs)
    needed = {o.name for o in outputs}
    keep = []
    for node in reversed(list(g.node)):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
            for attr in node.attribute:  # subgraphs read outer values by name
                for sub in (attr.g, *attr.graphs):
                    needed.update(i for n in sub.node for i in n.input if i)
    keep.reverse()
    del g.node[:]
    g.node.extend(keep)
    inputs = [i for i in g.input if i.name in needed]
    del g.input[:]
    g.input.extend(inputs)
    inits = [i for i in g.initializer if i.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
    _set_ir_version(result)
    return result


def remove_loss(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes, loss_name: str = "loss"
) -> onnx.ModelProto:
    """A copy of ``model`` without the output ``loss_name`` and what only it needed.

    Nodes that no remaining output reads are dropped, then inputs that nothing reads any more (the
    target and weights :func:`add_loss` added). Use it on ``ForwardBackward.to_onnx()`` to save the
    trained inference model.
    """
    checked = load_checked(model)
    names = [o.name for o in checked.proto.graph.output]
    if loss_name not in names:
        raise InputError(f"the model has no output named {loss_name!r}")
    return keep_outputs(checked, [n for n in names if n != loss_name])


def with_parameters(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes,
    params: Mapping[str, np.ndarray],
    *,
    tie_weights: bool = True,
) -> onnx.ModelProto:
    """A copy of ``model`` holding the trained ``params`` (dtypes kept): the way to put weights
    trained anywhere (``Runner.parameters``, JS ``exportParameters()``, ``Trainer.parameters``) back
    into the model file. Tied copies follow their parameter and aliases trained apart become
    initializers, as every front end chose them; a mapping that would leave a copy stale raises
    :class:`InputError` naming it (:func:`onnxgrad.autodiff.params.apply_parameters`)."""
    return apply_parameters(load_model(model), params, tie_weights=tie_weights)
