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

Class labels follow torch: a label equal to ``ignore_index`` (default -100) adds nothing, and the
mean is over the labels not ignored (weighted: ``Σ w l / Σ w`` over them). Any other label outside
``[0, C)`` makes the loss NaN in the graph (a runtime that runs the graph sees a non-finite loss);
the front ends refuse such labels before running anything, with :func:`check_labels`.

The model :func:`add_loss` returns records what it added in its metadata (``onnxgrad.loss``,
read back by :func:`loss_spec`): the kind, the target, weight and ignore index, the reduction and
the class count. A training loop reads from it how to validate labels (:meth:`LossSpec.check`) and
by what each batch's loss was divided (:meth:`LossSpec.normalizer`), so that batches combine into
the loss of their concatenation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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

__all__ = [
    "CLASS_LOSSES",
    "IGNORE_INDEX",
    "LOSSES",
    "LossSpec",
    "add_loss",
    "check_labels",
    "keep_outputs",
    "loss_spec",
    "remove_loss",
    "with_parameters",
]

LOSSES = ("mse", "l1", "huber", "cross_entropy", "nll", "bce_with_logits")
CLASS_LOSSES = ("cross_entropy", "nll")  # integer class targets, classes on axis 1
REDUCTIONS = ("mean", "sum")
IGNORE_INDEX = -100  # torch's default ignore_index: labels of this value add nothing to a class loss
LOSS_METADATA = "onnxgrad.loss"  # the metadata_props key add_loss writes (a LossSpec as JSON)
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
    ignore_index: int | None = IGNORE_INDEX,
) -> onnx.ModelProto:
    """A copy of ``model`` with a new input ``target_name`` and a new scalar output ``loss_name``.

    ``kind``: one of :data:`LOSSES`. ``output``: the value the loss reads, a model output (default:
    the first) or any floating-point value computed inside the graph (e.g. the logits before a
    Softmax). ``weight_name``: when given, a new input of per-sample weights, shape ``(N,)``.
    ``delta``: the threshold of ``huber``. ``probabilities``: for ``nll``, the value holds
    probabilities rather than log-probabilities. ``ignore_index``: for ``cross_entropy`` and
    ``nll``, the label value that adds nothing (torch's ``ignore_index``; ``None``: none); any other
    label outside ``[0, C)`` makes the loss NaN (front ends refuse it first, :func:`check_labels`).
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
    if ignore_index is not None and not isinstance(ignore_index, int | np.integer):
        raise InputError(f"ignore_index must be an integer or None, got {ignore_index!r}")
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
    keep = None  # the class losses' mask of labels not ignored (float)
    if kind in CLASS_LOSSES:
        per_elem, keep = _class_loss(e, kind, output, info, target_name, probabilities, ignore_index)
        elem_rank = _rank(info, -1)
    else:
        target = helper.make_tensor_value_info(target_name, info.dtype, _dims(info.shape))
        graph.input.append(target)
        if kind == "huber":
            per_elem = _huber(e, output, target_name, delta)
        else:
            per_elem = _ELEMENTWISE[kind](e, output, target_name)
        elem_rank = _rank(info, 0)
    final = None if penalties else loss_name
    loss = _reduce(e, per_elem, elem_rank, weight_name, reduction, info, final, keep)
    if penalties:
        _add_penalties(e, loss, penalties, infos, loss_name)
    graph.output.append(helper.make_tensor_value_info(loss_name, info.dtype, []))
    classes = info.shape[1] if kind in CLASS_LOSSES and isinstance(info.shape[1], int) else None  # type: ignore[index]
    spec = LossSpec(
        kind=kind,
        loss=loss_name,
        target=target_name,
        weight=weight_name,
        reduction=reduction,
        classes=classes,
        ignore_index=None if kind not in CLASS_LOSSES or ignore_index is None else int(ignore_index),
    )
    _set_metadata(result, LOSS_METADATA, json.dumps(asdict(spec)))
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


def _class_loss(
    e: Emitter,
    kind: str,
    scores: str,
    info: ValueInfo,
    target: str,
    probabilities: bool,
    ignore_index: int | None,
) -> tuple[str, str | None]:
    """``-logp[target]`` per sample (per position for rank > 2), picked by a one-hot mask, and the
    mask of the labels not ignored (a float, ``None`` without ``ignore_index``).

    ``logp`` is ``log_softmax(scores)`` (cross_entropy), ``scores`` (nll) or
    ``log(max(scores, tiny))`` (nll from probabilities). The one-hot mask
    ``Equal(target[:, None], classes)`` carries no gradient, so the path from the scores only
    crosses LogSoftmax or Log, Mul, ReduceSum and Neg. A label equal to ``ignore_index`` gives 0
    (its row is multiplied by the mask, also when ``ignore_index`` is a class); any other label
    outside ``[0, C)`` gives NaN (``Where(bad, NaN, 0)`` added, no gradient through it), so a
    graph fed such a label reports a non-finite loss instead of a loss without that row.
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
        count = e.const(classes, TensorProto.INT64)
    else:  # dynamic class count: Range(0, C) from the scores' shape
        count = e.op("Gather", e.op("Shape", scores), e.const(1, TensorProto.INT64), axis=0)
        zero, one = e.const(0, TensorProto.INT64), e.const(1, TensorProto.INT64)
        ids = e.op("Range", zero, count, one)
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
    loss = e.op("Neg", picked)
    # labels outside [0, C): NaN, unless ignored
    outside = e.op(
        "Or", e.op("Less", target, e.const(0, TensorProto.INT64)), e.op("Not", e.op("Less", target, count))
    )
    keep = None
    if ignore_index is not None:
        ignored = e.op("Equal", target, e.const(int(ignore_index), TensorProto.INT64))
        outside = e.op("And", outside, e.op("Not", ignored))
        keep = e.op("Cast", e.op("Not", ignored), to=e.dtype)
        loss = e.op("Mul", loss, keep)
    nan = e.op("Where", outside, e.const(np.nan), e.const(0.0))
    return e.op("Add", loss, nan), keep


def _reduce(
    e: Emitter,
    per_elem: str,
    rank: int | None,
    weight_name: str | None,
    reduction: str,
    info: ValueInfo,
    out: str | None,
    keep: str | None = None,
) -> str:
    """The scalar loss from per-element losses, optionally weighted per sample (axis 0).

    ``keep``: a float mask of the elements that count (the labels not ignored), which the mean
    divides by: ``Σ w l / Σ w keep`` (``Σ l / Σ keep`` unweighted); ``per_elem`` is 0 where it is 0.
    """
    op = "ReduceMean" if reduction == "mean" else "ReduceSum"
    if weight_name is None:
        if keep is None or reduction == "sum":
            return e.op(op, per_elem, out=out, keepdims=0)  # no axes: every element
        num = e.op("ReduceSum", per_elem, keepdims=0)
        return e.op("Div", num, e.op("ReduceSum", keep, keepdims=0), out=out)
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
    if keep is not None:  # Σ w l / Σ w over the labels not ignored
        num = e.op("ReduceSum", weighted, keepdims=0)
        return e.op("Div", num, e.op("ReduceSum", e.op("Mul", keep, w), keepdims=0), out=out)
    # mean(w l) / mean(w) = Σ w l / (Σ w · elements per sample): the weighted mean.
    num = e.op("ReduceMean", weighted, keepdims=0)
    return e.op("Div", num, e.op("ReduceMean", weight_name, keepdims=0), out=out)


# ---- what add_loss added -----------------------------------------------------------------------
@dataclass(frozen=True)
class LossSpec:
    """What :func:`add_loss` appended to a model, as its metadata (``onnxgrad.loss``) records it.

    ``kind``, ``reduction``: as given to :func:`add_loss`; ``loss``, ``target``, ``weight``: the
    names of the loss output and of the target and weight inputs (``weight`` ``None`` without
    sample weights); ``classes``: the class count of a class loss (``None`` when the model declares
    it symbolic, or for other losses); ``ignore_index``: the label value a class loss skips.
    """

    kind: str
    loss: str
    target: str
    weight: str | None
    reduction: str
    classes: int | None
    ignore_index: int | None

    def check(self, data: Mapping[str, Any], what: str = "the data") -> None:
        """Refuse class labels outside ``[0, classes)`` (other than ``ignore_index``) in
        ``data[target]``, with an :class:`InputError` naming the value and its row."""
        if self.kind in CLASS_LOSSES and self.target in data:
            check_labels(
                data[self.target],
                self.classes,
                self.ignore_index,
                name=f"the target {self.target!r} of {what}",
            )

    def normalizer(self, batch: Mapping[str, np.ndarray]) -> float:
        """What the loss of ``batch`` was divided by, up to a factor the same for every batch: 1
        for ``reduction="sum"``, else the sum of the sample weights, or the sample count (of the
        labels not ignored, for a class loss; weights summed over those).

        Batches of losses ``L_b`` and normalizers ``D_b`` make the loss of their concatenation
        ``Σ D_b L_b / Σ D_b`` (``Σ L_b`` for a sum), and so do their gradients.
        """
        if self.reduction == "sum":
            return 1.0
        target = np.asarray(batch[self.target])
        n = len(target)
        weights = np.asarray(batch[self.weight], dtype=np.float64).reshape(n) if self.weight else None
        if self.kind in CLASS_LOSSES and self.ignore_index is not None:
            keep = (target != self.ignore_index).reshape(n, -1).sum(axis=1)
            return float(keep.sum() if weights is None else (keep * weights).sum())
        return float(n if weights is None else weights.sum())


def loss_spec(model: onnx.ModelProto | Mapping[str, str]) -> LossSpec | None:
    """The :class:`LossSpec` recorded by :func:`add_loss` in ``model``'s metadata (or in a metadata
    mapping, e.g. an onnxruntime session's ``get_modelmeta().custom_metadata_map``); ``None`` when
    the model's loss was not added by :func:`add_loss`."""
    if isinstance(model, onnx.ModelProto):
        meta = {p.key: p.value for p in model.metadata_props}
    else:
        meta = dict(model)
    text = meta.get(LOSS_METADATA)
    if text is None:
        return None
    try:
        return LossSpec(**json.loads(text))
    except (ValueError, TypeError) as exc:
        raise InputError(f"the model's {LOSS_METADATA!r} metadata is not a loss description: {exc}") from None


def check_labels(
    labels: Any, classes: int | None, ignore_index: int | None = IGNORE_INDEX, *, name: str = "the target"
) -> None:
    """Refuse class labels outside ``[0, classes)`` other than ``ignore_index``, as torch does: an
    :class:`InputError` naming the first such value and its row (its position for a target of rank
    > 1). ``classes`` ``None`` (a symbolic class count): only negative labels are refused."""
    arr = np.asarray(labels)
    if arr.dtype.kind not in "iub" or arr.size == 0:
        return  # non-integers are the input contract's business (as_feeds)
    bad = arr < 0
    if classes is not None:
        bad |= arr >= classes
    if ignore_index is not None:
        bad &= arr != ignore_index
    if not bad.any():
        return
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    row = f"row {where[0]}" if len(where) == 1 else f"row {where[0]} (position {list(where)})"
    valid = f"[0, {classes})" if classes is not None else "[0, C)"
    skipped = f"; only ignore_index {ignore_index} may lie outside" if ignore_index is not None else ""
    raise InputError(
        f"{name} holds class {int(arr[where])} at {row}: class labels must lie in {valid}{skipped} "
        f"({int(bad.sum())} such label(s))"
    )


def _set_metadata(model: onnx.ModelProto, key: str, value: str | None) -> None:
    """Set (``None``: remove) one ``metadata_props`` entry of ``model``."""
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if value is not None:
        model.metadata_props.add(key=key, value=value)


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
    result = keep_outputs(checked, [n for n in names if n != loss_name])
    _set_metadata(result, LOSS_METADATA, None)  # the loss it described is gone
    return result


def with_parameters(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes, params: Mapping[str, np.ndarray]
) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``params`` hold these values (dtype kept)."""
    result = onnx.ModelProto()
    result.CopyFrom(load_model(model))
    g = result.graph
    done = set()
    for i, init in enumerate(g.initializer):
        if init.name in params:
            value = np.asarray(params[init.name], dtype=np_dtype(init.data_type))
            if tuple(value.shape) != tuple(init.dims):
                raise InputError(f"{init.name!r} has shape {tuple(init.dims)}, got {value.shape}")
            g.initializer[i].CopyFrom(numpy_helper.from_array(value, init.name))
            done.add(init.name)
    unknown = [n for n in params if n not in done]
    if unknown:
        raise InputError(f"{unknown} are not initializers of the model")
    return result
