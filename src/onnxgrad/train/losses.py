"""Loss functions appended to an ONNX model as plain ONNX nodes.

:func:`add_loss` turns a model into a training model: it reads one of the model's outputs and a new
target input, and adds a scalar output (``"loss"``) computed only from ops that have gradient rules
(or carry no gradient), so :func:`onnxgrad.build_gradient` can differentiate it with
``outputs=["loss"]``. :func:`remove_loss` undoes it on a trained model, giving the inference model.

Formulas (``x`` the model output, ``t`` the target, ``w`` the optional per-sample weights):

* ``mse``: ``(x - t)^2``; ``l1``: ``|x - t|``;
* ``bce_with_logits``: ``softplus(x) - x t``, the stable form of
  ``-t log σ(x) - (1-t) log(1-σ(x))``;
* ``cross_entropy``: ``-Σ_c onehot(t)_c log_softmax(x)_c``, classes on axis 1, integer targets.

``reduction="mean"`` averages over every element (weighted: ``Σ w l / (Σ w · elements per
sample)``), ``"sum"`` adds them up, as PyTorch's functional losses do.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..autodiff.graph import (
    MAX_IR_VERSION,
    ValueInfo,
    check_model,
    infer_value_infos,
    ir_version_for,
    load_model,
    np_dtype,
    opset_of,
)
from ..errors import InputError

__all__ = ["LOSSES", "add_loss", "remove_loss"]

LOSSES = ("mse", "l1", "cross_entropy", "bce_with_logits")
REDUCTIONS = ("mean", "sum")


class _Emitter:
    """Appends nodes to a graph with fresh value names, writing axes the way the opset wants."""

    def __init__(self, graph: onnx.GraphProto, opset: int, dtype: int, prefix: str) -> None:
        self.graph, self.opset, self.dtype, self.prefix = graph, opset, dtype, prefix
        self.taken = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
        self.taken |= {i.name for i in graph.initializer}
        self.taken |= {o for n in graph.node for o in n.output} | {n.name for n in graph.node}

    def fresh(self, hint: str) -> str:
        name, k = f"{self.prefix}/{hint}", 1
        while name in self.taken:
            k += 1
            name = f"{self.prefix}/{hint}_{k}"
        self.taken.add(name)
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        out = out or self.fresh(op_type.lower())
        self.graph.node.append(
            helper.make_node(op_type, list(inputs), [out], name=self.fresh(op_type), **attrs)
        )
        return out

    def const(self, value: Any, dtype: int | None = None) -> str:
        # A Constant node, not an initializer: float initializers would count as trainable.
        arr = np.asarray(value, dtype=np_dtype(self.dtype if dtype is None else dtype))
        return self.op("Constant", value=numpy_helper.from_array(arr))

    def axes_op(self, op_type: str, x: str, axes: Sequence[int], **attrs: Any) -> str:
        """``op_type`` with ``axes`` as an input where the opset wants one, else an attribute."""
        since = {"Unsqueeze": 13, "ReduceSum": 13, "ReduceMean": 18}[op_type]
        if self.opset >= since:
            return self.op(op_type, x, self.const(list(axes), TensorProto.INT64), **attrs)
        return self.op(op_type, x, axes=list(axes), **attrs)


def add_loss(
    model: onnx.ModelProto | str | os.PathLike | bytes,
    kind: str,
    *,
    output: str | None = None,
    target_name: str = "target",
    weight_name: str | None = None,
    reduction: str = "mean",
    loss_name: str = "loss",
) -> onnx.ModelProto:
    """A copy of ``model`` with a new input ``target_name`` and a new scalar output ``loss_name``.

    ``kind``: one of :data:`LOSSES`. ``output``: the model output the loss reads (default: the
    first). ``weight_name``: when given, a new input of per-sample weights, shape ``(N,)``.
    The original outputs stay outputs; differentiate with ``build_gradient(m, outputs=[loss_name])``
    so that the loss is the only output taking a gradient.
    """
    if kind not in LOSSES:
        raise InputError(f"unknown loss {kind!r}; expected one of {list(LOSSES)}")
    if reduction not in REDUCTIONS:
        raise InputError(f"unknown reduction {reduction!r}; expected one of {list(REDUCTIONS)}")
    result = onnx.ModelProto()
    result.CopyFrom(load_model(model))
    graph = result.graph
    outputs = [o.name for o in graph.output]
    if not outputs:
        raise InputError("the model has no output to compute a loss from")
    output = outputs[0] if output is None else output
    if output not in outputs:
        raise InputError(f"{output!r} is not an output of the model (outputs: {outputs})")
    info = infer_value_infos(result).get(output)
    if info is None or not info.is_float:
        raise InputError(f"output {output!r} is not a floating-point tensor: it cannot feed a loss")
    existing = {v.name for v in (*graph.input, *graph.output, *graph.initializer)}
    existing |= {o for n in graph.node for o in n.output}
    new_names = [n for n in (target_name, weight_name, loss_name) if n is not None]
    for name in new_names:
        if name in existing:
            raise InputError(f"the model already has a value named {name!r}; choose another name")
    if len(set(new_names)) < len(new_names):
        raise InputError(f"the target, weight and loss names must differ, got {new_names}")

    e = _Emitter(graph, opset_of(result), info.dtype, loss_name)
    e.taken.update(new_names)
    if kind == "cross_entropy":
        per_elem, elem_rank = _cross_entropy(e, output, info, target_name), _rank(info, -1)
    else:
        target = helper.make_tensor_value_info(target_name, info.dtype, _dims(info.shape))
        graph.input.append(target)
        per_elem, elem_rank = _ELEMENTWISE[kind](e, output, target_name), _rank(info, 0)
    _reduce(e, per_elem, elem_rank, weight_name, reduction, info, loss_name)
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
def _mse(e: _Emitter, x: str, t: str) -> str:
    d = e.op("Sub", x, t)
    return e.op("Mul", d, d)


def _l1(e: _Emitter, x: str, t: str) -> str:
    return e.op("Abs", e.op("Sub", x, t))


def _bce_with_logits(e: _Emitter, x: str, t: str) -> str:
    # softplus(x) - x t: onnxruntime's Softplus is overflow-safe and its gradient, σ(x), is exact.
    return e.op("Sub", e.op("Softplus", x), e.op("Mul", x, t))


_ELEMENTWISE = {"mse": _mse, "l1": _l1, "bce_with_logits": _bce_with_logits}


def _cross_entropy(e: _Emitter, logits: str, info: ValueInfo, target: str) -> str:
    """``-log_softmax(logits)[target]`` per sample (per position for rank > 2), by a one-hot mask.

    The one-hot mask ``Equal(target[:, None], classes)`` carries no gradient, so the path from the
    logits only crosses LogSoftmax, Mul, ReduceSum and Neg.
    """
    rank = info.rank
    if rank is None or rank < 2:
        raise InputError(f"cross_entropy needs logits of known rank >= 2 (N, C, ...), got shape {info.shape}")
    if e.opset < 11 or (rank > 2 and e.opset < 13):
        raise InputError(
            f"cross_entropy needs opset >= 11 (>= 13 for rank > 2 logits); the model has {e.opset}"
        )
    shape = list(info.shape)  # type: ignore[arg-type]
    e.graph.input.append(helper.make_tensor_value_info(target, TensorProto.INT64, shape[:1] + shape[2:]))
    classes = shape[1]
    trailing = [1] * (rank - 2)  # classes broadcast against (N, 1, d1, ...)
    if isinstance(classes, int):
        ids = e.const(np.arange(classes).reshape([classes, *trailing]), TensorProto.INT64)
    else:  # dynamic class count: Range(0, C) from the logits' shape
        c = e.op("Gather", e.op("Shape", logits), e.const(1, TensorProto.INT64), axis=0)
        zero, one = e.const(0, TensorProto.INT64), e.const(1, TensorProto.INT64)
        ids = e.op("Range", zero, c, one)
        if trailing:
            ids = e.axes_op("Unsqueeze", ids, list(range(1, rank - 1)))
    hit = e.op("Equal", e.axes_op("Unsqueeze", target, [1]), ids)
    onehot = e.op("Cast", hit, to=e.dtype)
    logp = e.op("LogSoftmax", logits, axis=1)
    picked = e.axes_op("ReduceSum", e.op("Mul", onehot, logp), [1], keepdims=0)
    return e.op("Neg", picked)


def _reduce(
    e: _Emitter,
    per_elem: str,
    rank: int | None,
    weight_name: str | None,
    reduction: str,
    info: ValueInfo,
    out: str,
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


# ---- back to inference -------------------------------------------------------------------------
def remove_loss(
    model: onnx.ModelProto | str | os.PathLike | bytes, loss_name: str = "loss"
) -> onnx.ModelProto:
    """A copy of ``model`` without the output ``loss_name`` and what only it needed.

    Nodes that no remaining output reads are dropped, then inputs that nothing reads any more (the
    target and weights :func:`add_loss` added). Use it on ``ForwardBackward.to_onnx()`` to save the
    trained inference model.
    """
    result = onnx.ModelProto()
    result.CopyFrom(load_model(model))
    g = result.graph
    if loss_name not in {o.name for o in g.output}:
        raise InputError(f"the model has no output named {loss_name!r}")
    outputs = [o for o in g.output if o.name != loss_name]
    del g.output[:]
    g.output.extend(outputs)
    needed = {o.name for o in outputs}
    keep = []
    for node in reversed(list(g.node)):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
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
