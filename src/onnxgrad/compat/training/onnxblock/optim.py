"""The optimizers ``generate_artifacts`` accepts as blocks: their hyperparameters, with
onnxruntime-training 1.19.2's defaults (AdamW: Hugging Face's variant, eps 1e-6)."""

from __future__ import annotations

from dataclasses import dataclass

from ....errors import InputError

__all__ = ["SGD", "AdamW"]


@dataclass
class AdamW:
    """AdamW as onnxruntime-training runs it (``adam_mode=1``): the bias corrections folded into
    the step size, ``eps`` added outside the square root, weight decay applied after the step."""

    bias_correction: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    clip_grad: object = None

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
class SGD:
    """Plain SGD: ``p -= lr * grad``."""

    clip_grad: object = None

    def __post_init__(self) -> None:
        if self.clip_grad is not None:
            raise InputError("SGD(clip_grad=...) is not supported; clip the gradients in the loss instead")

    @property
    def attributes(self) -> dict:
        return {}
