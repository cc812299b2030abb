"""The losses of ``onnxruntime.training.onnxblock.loss``, built the same way (same formulas, same
target inputs: ``target`` shaped like the loss input, ``labels`` int64 for cross-entropy)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ....errors import InputError
from . import blocks
from ._accessor import generate_graph_name

__all__ = ["BCEWithLogitsLoss", "CrossEntropyLoss", "L1Loss", "MSELoss"]

_REDUCTIONS = {"mean": blocks.ReduceMean, "sum": blocks.ReduceSum, "none": blocks.PassThrough}


def _reduction(reduction: str) -> blocks.Block:
    if reduction not in _REDUCTIONS:
        raise InputError(f"Reduction {reduction} not supported; expected one of {list(_REDUCTIONS)}")
    if reduction == "none":
        return blocks.PassThrough()
    return _REDUCTIONS[reduction](keepdims=False)


def _target(base: onnx.ModelProto, like: str, target_name: str) -> str:
    """``target_name``, added as an input shaped like ``like`` when the model lacks it."""
    if not blocks.node_arg_exists(base, target_name):
        return blocks.InputLike(like)(target_name)
    return target_name


class MSELoss(blocks.Block):
    """``reduce((output - target) ** 2)``."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self._reduce = _reduction(reduction)
        self._sub = blocks.Sub()
        self._square = blocks.Pow(2.0)

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        target_name = _target(self.base, loss_input_name, target_name)
        result = self._reduce(self._square(self._sub(loss_input_name, target_name)))
        return result[0] if isinstance(result, tuple) else result


class L1Loss(blocks.Block):
    """``reduce(|output - target|)``."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self._reduce = _reduction(reduction)
        self._abs = blocks.Abs()
        self._sub = blocks.Sub()

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        target_name = _target(self.base, loss_input_name, target_name)
        result = self._reduce(self._abs(self._sub(loss_input_name, target_name)))
        return result[0] if isinstance(result, tuple) else result


class CrossEntropyLoss(blocks.Block):
    """``SoftmaxCrossEntropyLoss`` of the scores and int64 ``labels`` (an input without the scores'
    last axis); ``weight`` rescales each class, ``ignore_index`` skips a label value."""

    def __init__(
        self, weight: np.ndarray | None = None, reduction: str = "mean", ignore_index: int | None = None
    ):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise InputError(f"Reduction {reduction} not supported; expected one of {list(_REDUCTIONS)}")
        self._weight, self._reduction, self._ignore_index = weight, reduction, ignore_index

    def build(self, scores_input_name: str, labels_name: str = "labels") -> str:
        base = self.base
        inputs = [scores_input_name, labels_name]
        if self._weight is not None:
            weight_name = generate_graph_name("celoss.weight")
            base.graph.initializer.append(numpy_helper.from_array(np.asarray(self._weight), weight_name))
            inputs.append(weight_name)
        if not blocks.node_arg_exists(base, labels_name):
            scores = blocks._find_value(base, scores_input_name)
            if scores is None:
                raise InputError(f"CrossEntropyLoss: {scores_input_name!r} is not a graph output")
            labels = copy.deepcopy(scores)
            labels.name = labels_name
            labels.type.tensor_type.elem_type = TensorProto.INT64
            del labels.type.tensor_type.shape.dim[-1]
            base.graph.input.append(labels)
        loss = generate_graph_name("loss")
        log_prob = generate_graph_name("log_prob")
        base.graph.node.append(
            helper.make_node(
                "SoftmaxCrossEntropyLoss",
                inputs,
                [loss, log_prob],
                reduction=self._reduction,
                ignore_index=self._ignore_index,
                name=generate_graph_name("SoftmaxCrossEntropyLoss"),
            )
        )
        return loss


class BCEWithLogitsLoss(blocks.Block):
    """``reduce(-(log(sigmoid(x)) * t * pos_weight + log(1 - sigmoid(x)) * (1 - t)) * weight)``,
    written with the same nodes as onnxruntime-training."""

    def __init__(
        self, weight: np.ndarray | None = None, reduction: str = "mean", pos_weight: np.ndarray | None = None
    ):
        super().__init__()
        self._weight, self._pos_weight = weight, pos_weight
        self._reduce = _reduction(reduction)
        self._sigmoid, self._log = blocks.Sigmoid(), blocks.Log()
        self._sub, self._add, self._mul, self._neg = blocks.Sub(), blocks.Add(), blocks.Mul(), blocks.Neg()

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        base = self.base
        init = base.graph.initializer

        def constant(hint: str, value: np.ndarray) -> str:
            name = generate_graph_name(hint)
            init.append(numpy_helper.from_array(np.asarray(value, dtype=np.float32), name))
            return name

        pos_weight = None if self._pos_weight is None else constant("bceloss.pos_weight", self._pos_weight)
        weight = None if self._weight is None else constant("bceloss.weight", self._weight)
        one1 = constant("bceloss.sub_ones", np.ones(1))
        one2 = constant("bceloss.sub_ones", np.ones(1))
        target_name = _target(base, loss_input_name, target_name)
        sig = self._sigmoid(loss_input_name)
        first = self._mul(self._log(sig), target_name)
        if pos_weight is not None:
            first = self._mul(first, pos_weight)
        second = self._mul(self._log(self._sub(one1, sig)), self._sub(one2, target_name))
        loss = self._neg(self._add(first, second))
        if weight is not None:
            loss = self._mul(weight, loss)
        result = self._reduce(loss)
        return result[0] if isinstance(result, tuple) else result
