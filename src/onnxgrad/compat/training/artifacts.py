"""``onnxruntime.training.artifacts`` on onnxgrad: :func:`generate_artifacts`, :class:`LossType`,
:class:`OptimType`, and stock onnxruntime's ORT-format converter (``OptimizationStyle``,
``convert_onnx_models_to_ort``, re-exported as 1.19.2 did).

The folder has the file names onnxruntime-training writes (``training_model.onnx``,
``eval_model.onnx``, ``optimizer_model.onnx``, ``checkpoint``, ``nominal_checkpoint``), with plain
ONNX inside that stock onnxruntime loads (see :mod:`onnxgrad.compat.training.graphs`); the
checkpoint is onnxruntime-training's format, so 1.19.2 apps read it too. ``ort_format=True`` adds
each model in the ORT format beside it (``training_model.ort``, ...).
"""

from __future__ import annotations

import os
import pathlib
from enum import Enum
from typing import Any

import onnx
from onnxruntime.tools import convert_onnx_models_to_ort as _ort_format

from ...errors import InputError
from ...model.graph import FLOAT_TYPES
from . import checkpoint_file, onnxblock

__all__ = ["LossType", "OptimType", "OptimizationStyle", "convert_onnx_models_to_ort", "generate_artifacts"]

OptimizationStyle = _ort_format.OptimizationStyle
"""How the ORT-format converter optimizes (``Fixed`` or ``Runtime``): stock onnxruntime's enum,
``onnxruntime.tools.convert_onnx_models_to_ort.OptimizationStyle``, re-exported as 1.19.2 did."""


def convert_onnx_models_to_ort(*args: Any, **kwargs: Any) -> Any:
    """Stock onnxruntime's ORT-format converter
    (``onnxruntime.tools.convert_onnx_models_to_ort.convert_onnx_models_to_ort``), re-exported as
    1.19.2 did; ``generate_artifacts(ort_format=True)`` calls it on each written model."""
    return _ort_format.convert_onnx_models_to_ort(*args, **kwargs)


convert_onnx_models_to_ort.__wrapped__ = _ort_format.convert_onnx_models_to_ort  # type: ignore[attr-defined]


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


def _optimizer(optimizer: OptimType | object | None) -> onnxblock.optim.AdamW | onnxblock.optim.SGD | None:
    if optimizer is None:
        return None
    if optimizer == OptimType.AdamW:
        return onnxblock.optim.AdamW()
    if optimizer == OptimType.SGD:
        return onnxblock.optim.SGD()
    if isinstance(optimizer, (onnxblock.optim.AdamW, onnxblock.optim.SGD)):
        return optimizer
    raise InputError(
        "optimizer must be an OptimType, onnxblock.optim.AdamW or onnxblock.optim.SGD, "
        f"got {type(optimizer).__name__}"
    )


class _TrainingBlock(onnxblock.TrainingBlock):
    """The loss block, fed ``loss_input_names`` when given, returning the additional outputs too."""

    def __init__(
        self, loss: onnxblock.Block, loss_input_names: list[str] | None, additional: list[str]
    ) -> None:
        super().__init__()
        self._loss, self._loss_input_names, self._additional = loss, loss_input_names, additional

    def build(self, *inputs_to_loss: str) -> tuple[str, ...]:
        out = self._loss(*(self._loss_input_names or inputs_to_loss))
        return (*(out if isinstance(out, (tuple, list)) else (out,)), *self._additional)


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
    ``optimizer`` an :class:`OptimType` (or ``onnxblock.optim.AdamW(...)``/``SGD()``). With no
    ``requires_grad`` the training model computes the loss and no gradient, as in 1.19.2; a graph
    input in ``requires_grad`` gets its gradient ``<input>_grad`` as a training-model output.
    ``ort_format=True`` also writes each model in the ORT format beside it (stock onnxruntime's
    converter, ``OptimizationStyle.Fixed``; for onnxruntime builds that load only that format, as
    1.19.2 does). ``custom_op_library`` cannot mean anything for onnxgrad's gradients and raises
    :class:`~onnxgrad.errors.InputError`.
    """
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
    not_float = [
        n for n in requires_grad if n in {i.name for i in base.graph.initializer} and n not in floats
    ]
    if not_float:
        raise InputError(f"requires_grad names {not_float}, which are not floating-point initializers")
    if additional_output_names is not None and not isinstance(additional_output_names, list):
        raise InputError(
            f"additional_output_names must be a list of strings, got {type(additional_output_names).__name__}"
        )
    optimizer_block = _optimizer(optimizer)
    block = _TrainingBlock(_loss_block(loss), loss_input_names, list(additional_output_names or []))
    for name in requires_grad:
        block.requires_grad(name)
    for name in frozen_params:
        block.requires_grad(name, False)
    with onnxblock.base(base):
        block(*[o.name for o in base.graph.output])
    training, evaluation = block.to_model_proto()

    directory = pathlib.Path(artifact_directory if artifact_directory is not None else os.getcwd())
    directory.mkdir(parents=True, exist_ok=True)
    # weights over the threshold go to external data beside each file (checkpoint_file's docstring)
    written = [directory / f"{prefix}training_model.onnx", directory / f"{prefix}eval_model.onnx"]
    checkpoint_file.save_onnx(training, written[0])
    checkpoint_file.save_onnx(evaluation, written[1])
    onnxblock.save_checkpoint(block.parameters(), directory / f"{prefix}checkpoint")
    if nominal_checkpoint:
        onnxblock.save_checkpoint(block.parameters(), directory / f"{prefix}nominal_checkpoint", True)
    if optimizer_block is not None:
        with onnxblock.empty_base():
            optimizer_block(block.parameters())
        written.append(directory / f"{prefix}optimizer_model.onnx")
        checkpoint_file.save_onnx(optimizer_block.to_model_proto(), written[-1])
    if ort_format:
        for path in written:
            _to_ort_format(path)


def _to_ort_format(path: pathlib.Path) -> None:
    """Write ``<name>.ort`` beside the model file ``path`` (stock onnxruntime's converter, the
    graph optimizations fixed at conversion, as 1.19.2 did)."""
    try:
        convert_onnx_models_to_ort(
            path, output_dir=path.parent, optimization_styles=[OptimizationStyle.Fixed]
        )
    except Exception as exc:  # the converter reports a model it cannot convert this way
        raise InputError(f"cannot convert {path.name} to the ORT format: {exc}") from exc
    if not path.with_suffix(".ort").is_file():
        raise InputError(f"the ORT-format converter wrote no {path.with_suffix('.ort').name}")
