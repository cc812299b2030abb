"""``LinearLRScheduler``: a linear warm-up from 0 to ``initial_lr``, then a linear decay to 0.

onnxruntime-training 1.19.2's Python wrapper hands ``warmup_step_count`` and ``total_step_count``
to its C++ scheduler in the wrong order (onnxruntime PR #13882), so its schedule warms up over
``total_step_count`` steps and decays over the rest. This one follows the documented schedule::

    lr(step) = initial_lr * step / warmup_step_count                          if step < warmup
             = initial_lr * max(0, (total - step) / max(1, total - warmup))  otherwise

where ``step`` is the optimizer's number of updates made; the rate is set when the scheduler is
made and at each :meth:`LinearLRScheduler.step`.
"""

from __future__ import annotations

from ....errors import InputError
from .optimizer import Optimizer

__all__ = ["LinearLRScheduler"]


class LinearLRScheduler:
    """Linear warm-up then linear decay of ``optimizer``'s learning rate (see the module doc)."""

    def __init__(
        self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int, initial_lr: float
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise InputError(f"LinearLRScheduler takes an api.Optimizer, got {type(optimizer).__name__}")
        if warmup_step_count < 0 or total_step_count < 0:
            raise InputError("warmup_step_count and total_step_count must be >= 0")
        if warmup_step_count > total_step_count:
            raise InputError(
                f"warmup_step_count ({warmup_step_count}) is larger than "
                f"total_step_count ({total_step_count})"
            )
        self._optimizer = optimizer
        self.warmup_step_count, self.total_step_count = int(warmup_step_count), int(total_step_count)
        self.initial_lr = float(initial_lr)
        self._apply()

    def factor(self, step: int) -> float:
        """The multiple of ``initial_lr`` after ``step`` updates."""
        warmup, total = self.warmup_step_count, self.total_step_count
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    def _apply(self) -> None:
        self._optimizer.set_learning_rate(self.initial_lr * self.factor(self._optimizer._group.step))

    def step(self) -> None:
        """Set the learning rate for the optimizer's next update."""
        self._apply()
