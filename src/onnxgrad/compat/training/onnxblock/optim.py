"""The optimizer blocks: their hyperparameters, with onnxruntime-training 1.19.2's defaults
(AdamW: Hugging Face's variant, eps 1e-6). Pass one to ``generate_artifacts(optimizer=...)``, or
call it on ``TrainingBlock.parameters()`` inside ``with onnxblock.empty_base():`` and take
``to_model_proto()`` (a plain ONNX update graph)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ....errors import InputError
from .. import graphs
from . import _accessor

__all__ = ["SGD", "AdamW"]


class _OptimizerBlock:
    kind = ""
    _model: onnx.ModelProto | None = None

    @property
    def attributes(self) -> dict:
        return {}

    def __call__(self, parameters: tuple[list[onnx.TensorProto], list[onnx.TensorProto]]) -> str:
        """Build the update graph of the trainable parameters of ``parameters``; returns the name
        of its first output."""
        _accessor.current()  # inside a base, as onnxruntime-training requires
        trainable, _ = parameters
        specs = {t.name: (t.data_type, list(t.dims)) for t in trainable}
        self._model = graphs.optimizer_graph(self.kind, self.attributes, specs)
        return self._model.graph.output[0].name

    def to_model_proto(self) -> onnx.ModelProto:
        """The optimizer model built by the call."""
        if self._model is None:
            raise InputError("Please build the optimizer model first before trying to retrieve it.")
        return self._model


@dataclass
class AdamW(_OptimizerBlock):
    """AdamW as onnxruntime-training runs it (``adam_mode=1``): the bias corrections folded into
    the step size, ``eps`` added outside the square root, weight decay applied after the step."""

    bias_correction: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    clip_grad: object = None
    kind = graphs.ADAMW

    def __post_init__(self) -> None:
        if self.clip_grad is not None:
            raise InputError("AdamW(clip_grad=...) is not supported; clip the gradients in the loss instead")

    @property
    def attributes(self) -> dict:
        """The attributes of onnxruntime-training's ``AdamWOptimizer`` node."""
        return {
            "alpha": float(self.betas[0]),
            "beta": float(self.betas[1]),
            "epsilon": float(self.eps),
            "weight_decay": float(self.weight_decay),
            "correct_bias": int(bool(self.bias_correction)),
            "adam_mode": 1,
        }


@dataclass
class SGD(_OptimizerBlock):
    """Plain SGD: ``p -= lr * grad``."""

    clip_grad: object = None
    kind = graphs.SGD

    def __post_init__(self) -> None:
        if self.clip_grad is not None:
            raise InputError("SGD(clip_grad=...) is not supported; clip the gradients in the loss instead")
