"""onnxruntime-training's offline tooling: :class:`TrainingBlock` (a loss block whose call builds
the training and eval models), :class:`ForwardBlock`, :func:`save_checkpoint` and
:func:`load_checkpoint_to_model`. ``generate_artifacts`` is built on them, as in 1.19.2."""

from __future__ import annotations

import os
from abc import abstractmethod
from typing import Any

import onnx
from onnx import numpy_helper

from ....errors import InputError, OnnxGradRuntimeError
from .. import checkpoint_file, graphs
from .blocks import Block

__all__ = ["ForwardBlock", "TrainingBlock", "load_checkpoint_to_model", "save_checkpoint"]

Parameters = tuple[list[onnx.TensorProto], list[onnx.TensorProto]]


def _names(output: Any) -> list[str]:
    names = list(output) if isinstance(output, (tuple, list)) else [output]
    if not names or not all(isinstance(n, str) for n in names):
        raise InputError(f"build must return the name(s) of its output(s), got {output!r}")
    return names


class ForwardBlock(Block):
    """A block whose call makes a model of its own: the base with the build's outputs as its
    outputs (:meth:`to_model_proto`)."""

    def __init__(self) -> None:
        super().__init__()
        self._model: onnx.ModelProto | None = None

    @abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Append the nodes; return the output name(s)."""

    def _finish(self, output: Any) -> None:
        """The model of this block: a copy of the base, the build's outputs as its outputs."""
        model = onnx.ModelProto()
        model.CopyFrom(self.base)
        graphs.set_outputs(model, _names(output))
        self._model = model

    def to_model_proto(self) -> onnx.ModelProto:
        """The model built by the call."""
        if self._model is None:
            raise OnnxGradRuntimeError("Please build the forward model first before trying to retrieve it.")
        return self._model


class TrainingBlock(Block):
    """A loss block whose call builds the training model (forward, loss, backward: plain ONNX)
    and the eval model from the base. Mark the parameters with :meth:`requires_grad` first; with
    none, the training model computes the loss in training mode and no gradient (as 1.19.2). A
    graph input marked too gets its gradient ``<input>_grad`` as an output of the training model."""

    def __init__(self) -> None:
        super().__init__()
        self._requires_grad: list[str] = []
        self._frozen_params: list[str] = []
        self._parameters: Parameters | None = None
        self._training_model: onnx.ModelProto | None = None
        self._eval_model: onnx.ModelProto | None = None

    @abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Append the loss; return the name of its output (the gradient starts from the first)."""

    def requires_grad(self, argument_name: str, value: bool = True) -> None:
        """Train ``argument_name`` (``value=True``) or keep it as a frozen parameter. A graph input
        named here gets its gradient as an output of the training model."""
        for names in (self._requires_grad, self._frozen_params):
            if argument_name in names:
                names.remove(argument_name)
        (self._requires_grad if value else self._frozen_params).append(argument_name)

    def parameters(self) -> Parameters:
        """(trainable, frozen) initializers, known once the block was called."""
        if self._parameters is None:
            raise OnnxGradRuntimeError(
                "Please build the training model first before trying to retrieve the parameters."
            )
        return self._parameters

    def to_model_proto(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """(training model, eval model)."""
        if self._training_model is None or self._eval_model is None:
            raise OnnxGradRuntimeError(
                "Please build the training and eval models first before trying to retrieve them."
            )
        return self._training_model, self._eval_model

    def _finish(self, output: Any) -> None:
        """The training and eval models from the base and the loss output(s); the base becomes
        the training model."""
        base = self.base
        outputs = _names(output)
        graphs.set_outputs(base, outputs)
        inits = {i.name: i for i in base.graph.initializer}
        graph_inputs = [i.name for i in base.graph.input if i.name not in inits]
        for label, names, known, what in (
            (
                "requires_grad",
                self._requires_grad,
                {*inits, *graph_inputs},
                "neither initializers nor graph inputs",
            ),
            ("frozen", self._frozen_params, set(inits), "not initializers"),
        ):
            unknown = [n for n in names if n not in known]
            if unknown:
                raise InputError(f"{label} names {unknown} that are {what} of the model")
        trainable = [n for n in inits if n in set(self._requires_grad)]
        frozen = [n for n in inits if n in set(self._frozen_params)]
        # a graph input requiring grad: its gradient '<input>_grad' is an output (1.19.2's rule)
        differentiated_inputs = [n for n in graph_inputs if n in set(self._requires_grad)]
        training = graphs.training_graph(base, trainable, frozen, outputs, differentiated_inputs)
        self._eval_model = graphs.eval_graph(base, [*trainable, *frozen], outputs)
        graphs.mark(self._eval_model, {"loss_outputs": outputs})
        self._parameters = ([_copy(inits[n]) for n in trainable], [_copy(inits[n]) for n in frozen])
        self._training_model = training.model
        base.CopyFrom(training.model)  # as onnxruntime-training: the base becomes the training model


def _copy(tensor: onnx.TensorProto) -> onnx.TensorProto:
    out = onnx.TensorProto()
    out.CopyFrom(tensor)
    return out


def save_checkpoint(
    parameters: Parameters, path_to_checkpoint: str | os.PathLike, nominal_checkpoint: bool = False
) -> None:
    """Write the checkpoint of ``(trainable, frozen)`` initializers (``TrainingBlock.parameters()``)."""
    if parameters is None:
        raise InputError("No checkpoint parameters provided.")
    trainable, frozen = parameters
    data = checkpoint_file.CheckpointData(
        trainable={t.name: numpy_helper.to_array(t) for t in trainable},
        frozen={t.name: numpy_helper.to_array(t) for t in frozen},
        nominal=nominal_checkpoint,
    )
    checkpoint_file.save(path_to_checkpoint, data)


def load_checkpoint_to_model(path_to_checkpoint: str | os.PathLike, model: onnx.ModelProto) -> None:
    """Overwrite the initializers of ``model`` that the checkpoint holds with its values, in place."""
    data = checkpoint_file.load(path_to_checkpoint)
    values = {**data.trainable, **data.frozen}
    inits = [
        numpy_helper.from_array(values[i.name], i.name) if i.name in values else i
        for i in model.graph.initializer
    ]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
