"""``onnxruntime.training.artifacts`` on onnxgrad: :func:`generate_artifacts`, :class:`LossType`,
:class:`OptimType`.

The folder has the file names onnxruntime-training writes (``training_model.onnx``,
``eval_model.onnx``, ``optimizer_model.onnx``, ``checkpoint``, ``nominal_checkpoint``), with plain
ONNX inside that stock onnxruntime loads (see :mod:`onnxgrad.compat.training.graphs`); the
checkpoint is onnxruntime-training's format, so 1.19.2 apps read it too.
"""

from __future__ import annotations

import os
import pathlib
from enum import Enum

import onnx
from onnx import numpy_helper

from ...errors import InputError
from ...model.graph import FLOAT_TYPES
from . import checkpoint_file, graphs, onnxblock

__all__ = ["LossType", "OptimType", "generate_artifacts"]


class LossType(Enum):
    """The losses ``generate_artifacts`` appends (``loss=``)."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(Enum):
    """The optimizers ``generate_artifacts`` writes (``optimizer=``)."""

    AdamW = 1
    SGD = 2


_LOSSES = {
    LossType.MSELoss: onnxblock.loss.MSELoss,
    LossType.CrossEntropyLoss: onnxblock.loss.CrossEntropyLoss,
    LossType.BCEWithLogitsLoss: onnxblock.loss.BCEWithLogitsLoss,
    LossType.L1Loss: onnxblock.loss.L1Loss,
}


def _load(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)  # onnxruntime-training edits the caller's model; onnxgrad does not
        return copy
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            raise InputError(f"no model file at {os.fspath(model)!r}")
        return onnx.load(os.fspath(model))
    raise InputError(f"model must be an onnx.ModelProto or a path, got {type(model).__name__}")


def _loss_block(loss: LossType | onnxblock.Block | None) -> onnxblock.Block:
    if loss is None:
        return onnxblock.blocks.PassThrough()
    if isinstance(loss, LossType):
        return _LOSSES[loss]()
    if isinstance(loss, onnxblock.Block):
        return loss
    raise InputError(f"loss must be a LossType, an onnxblock.Block or None, got {type(loss).__name__}")


def _optimizer(optimizer: OptimType | object | None) -> tuple[str, dict] | None:
    if optimizer is None:
        return None
    if optimizer == OptimType.AdamW:
        optimizer = onnxblock.optim.AdamW()
    elif optimizer == OptimType.SGD:
        optimizer = onnxblock.optim.SGD()
    if isinstance(optimizer, onnxblock.optim.AdamW):
        return graphs.ADAMW, optimizer.attributes
    if isinstance(optimizer, onnxblock.optim.SGD):
        return graphs.SGD, optimizer.attributes
    raise InputError(
        "optimizer must be an OptimType, onnxblock.optim.AdamW or onnxblock.optim.SGD, "
        f"got {type(optimizer).__name__}"
    )


def _set_outputs(model: onnx.ModelProto, names: list[str]) -> None:
    """Make ``names`` the graph outputs (onnxruntime-training keeps only the loss outputs)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    infos = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input)}
    missing = [n for n in names if n not in infos]
    if missing:
        raise InputError(
            f"no value named {missing} in the model to output (the loss must return value names)"
        )
    del model.graph.output[:]
    model.graph.output.extend(infos[n] for n in names)


def build_loss_model(
    model: onnx.ModelProto,
    loss: LossType | onnxblock.Block | None,
    additional_output_names: list[str] | None = None,
    loss_input_names: list[str] | None = None,
) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with the loss appended and its outputs set: (loss model, loss outputs)."""
    block = _loss_block(loss)
    if additional_output_names is not None and not isinstance(additional_output_names, list):
        raise InputError(
            f"additional_output_names must be a list of strings, got {type(additional_output_names).__name__}"
        )
    inputs = list(loss_input_names) if loss_input_names else [o.name for o in model.graph.output]
    with onnxblock.base(model):
        out = block(*inputs)
    outputs = list(out) if isinstance(out, (tuple, list)) else [out]
    outputs += list(additional_output_names or [])
    if not outputs or not all(isinstance(o, str) for o in outputs):
        raise InputError(f"the loss block must return the name(s) of its output(s), got {out!r}")
    _set_outputs(model, outputs)
    return model, outputs


def generate_artifacts(
    model: onnx.ModelProto | str | os.PathLike,
    requires_grad: list[str] | None = None,
    frozen_params: list[str] | None = None,
    loss: LossType | onnxblock.Block | None = None,
    optimizer: OptimType | object | None = None,
    artifact_directory: str | os.PathLike | None = None,
    prefix: str = "",
    ort_format: bool = False,
    custom_op_library: str | os.PathLike | None = None,
    additional_output_names: list[str] | None = None,
    nominal_checkpoint: bool = False,
    loss_input_names: list[str] | None = None,
) -> None:
    """Write the training, eval and optimizer models and the checkpoint of ``model``.

    The same arguments as onnxruntime-training's: ``requires_grad`` the initializers to train,
    ``frozen_params`` initializers kept in the checkpoint but not trained (the others stay
    constants of the graphs), ``loss`` a :class:`LossType` or an ``onnxblock.Block``,
    ``optimizer`` an :class:`OptimType` (or ``onnxblock.optim.AdamW(...)``/``SGD()``).
    ``ort_format`` and ``custom_op_library`` cannot mean anything on stock onnxruntime and raise
    :class:`~onnxgrad.errors.InputError`.
    """
    if ort_format:
        raise InputError(
            "ort_format=True is not supported: onnxgrad writes plain ONNX files, which every onnxruntime "
            "(Python, Node, web, mobile) loads as they are"
        )
    if custom_op_library is not None:
        raise InputError("custom_op_library is not supported: onnxgrad differentiates standard ONNX ops only")
    requires_grad, frozen_params = list(requires_grad or []), list(frozen_params or [])
    both = sorted(set(requires_grad) & set(frozen_params))
    if both:
        raise InputError(
            f"a parameter cannot be frozen and require gradient computation at the same time {both}"
        )
    base = _load(model)
    floats = {i.name for i in base.graph.initializer if i.data_type in FLOAT_TYPES}
    inits = {i.name for i in base.graph.initializer}
    for label, names in (("requires_grad", requires_grad), ("frozen_params", frozen_params)):
        unknown = [n for n in names if n not in inits]
        if unknown:
            raise InputError(f"{label} names {unknown} that are not initializers of the model")
    not_float = [n for n in requires_grad if n not in floats]
    if not_float:
        raise InputError(f"requires_grad names {not_float}, which are not floating-point initializers")
    opt = _optimizer(optimizer)
    loss_model, loss_outputs = build_loss_model(base, loss, additional_output_names, loss_input_names)
    order = [i.name for i in loss_model.graph.initializer]
    trainable = [n for n in order if n in set(requires_grad)]
    frozen = [n for n in order if n in set(frozen_params)]
    training = graphs.training_graph(loss_model, trainable, frozen, loss_outputs)
    evaluation = graphs.eval_graph(loss_model, [*trainable, *frozen], loss_outputs)
    graphs.mark(evaluation, {"loss_outputs": loss_outputs})

    directory = pathlib.Path(artifact_directory if artifact_directory is not None else os.getcwd())
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(training.model, directory / f"{prefix}training_model.onnx")
    onnx.save(evaluation, directory / f"{prefix}eval_model.onnx")
    values = {i.name: numpy_helper.to_array(i) for i in loss_model.graph.initializer}
    data = checkpoint_file.CheckpointData(
        trainable={n: values[n] for n in trainable}, frozen={n: values[n] for n in frozen}
    )
    checkpoint_file.save(directory / f"{prefix}checkpoint", data)
    if nominal_checkpoint:
        data.nominal = True
        checkpoint_file.save(directory / f"{prefix}nominal_checkpoint", data)
    if opt is not None:
        kind, attrs = opt
        specs = {n: (values[n].dtype, list(values[n].shape)) for n in trainable}
        specs = {n: (onnx.helper.np_dtype_to_tensor_dtype(d), s) for n, (d, s) in specs.items()}
        onnx.save(graphs.optimizer_graph(kind, attrs, specs), directory / f"{prefix}optimizer_model.onnx")
