"""Learning-rate schedules: the learning rate as a pure function of the optimizer step.

A schedule is any callable ``step -> lr`` where ``step`` counts the optimizer updates already made
(0 for the first update). The classes here reproduce ``torch.optim.lr_scheduler`` stepped once per
optimizer update (``scheduler.step()`` after each ``optimizer.step()``); being stateless, they need
nothing in a checkpoint but the optimizer's step counter, and they compose: :class:`LinearWarmup`
wraps any other schedule. Give one as ``lr`` to any optimizer of :mod:`onnxgrad.train`.

Each schedule checks its base rate when it is made, through the one check of a learning rate
(:func:`onnxgrad.train.optimizers.check_lr`), and its other arguments (step counts: integers >= 1),
so that a bad value is an :class:`~onnxgrad.errors.InputError` where it is written, not a failure
at the first step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import InputError
from .optimizers import NOT_A_RATE, as_float, check_lr

__all__ = [
    "Constant",
    "Cosine",
    "InverseScaling",
    "LinearWarmup",
    "ReduceLROnPlateau",
    "Schedule",
    "StepDecay",
    "as_schedule",
]

LearningRate = float | Callable[[int], float]


class Schedule:
    """Base class: ``schedule(step)`` is the learning rate of update number ``step`` (from 0)."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


def _real(key: str, value: object) -> float:
    """``value`` as a finite float (not a bool or a string), :class:`InputError` otherwise."""
    number = None if isinstance(value, bool | str | bytes) else as_float(value)
    if number is None:
        raise InputError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(number):
        raise InputError(f"{key} must be a finite number, got {value!r}")
    return number


def _positive(**values: float) -> None:
    for key, value in values.items():
        if not _real(key, value) > 0:
            raise InputError(f"{key} must be > 0, got {value}")


def _count(**values: object) -> int:
    """A number of steps: an integer >= 1 (not a bool, a float or a string), :class:`InputError`
    otherwise; ``warmup_steps=2.5`` was taken as 2, ``"3"`` failed with a raw TypeError."""
    ((key, value),) = values.items()
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise InputError(f"{key} must be an integer >= 1, got {value!r}")
    return int(value)


def _non_negative(**values: float) -> None:
    for key, value in values.items():
        if not _real(key, value) >= 0:
            raise InputError(f"{key} must be >= 0, got {value}")


class Constant(Schedule):
    """``lr`` at every step."""

    def __init__(self, lr: float) -> None:
        self.lr = check_lr(lr)

    def __call__(self, step: int) -> float:
        return self.lr


class StepDecay(Schedule):
    """``lr · gamma^⌊step / step_size⌋`` (``torch.optim.lr_scheduler.StepLR``)."""

    def __init__(self, lr: float, step_size: int, gamma: float = 0.1) -> None:
        self.lr = check_lr(lr)  # every schedule: the one check of a learning rate, when made
        _non_negative(gamma=gamma)
        self.step_size, self.gamma = _count(step_size=step_size), float(gamma)

    def __call__(self, step: int) -> float:
        return self.lr * self.gamma ** (step // self.step_size)


class Cosine(Schedule):
    """``min_lr + (lr - min_lr) (1 + cos(π step / total_steps)) / 2`` (``CosineAnnealingLR``).

    As in torch, the curve goes back up after ``total_steps`` (a cosine of period
    ``2 total_steps``); choose ``total_steps`` as the number of updates of the whole run.
    """

    def __init__(self, lr: float, total_steps: int, min_lr: float = 0.0) -> None:
        self.lr = check_lr(lr)
        _non_negative(min_lr=min_lr)
        self.total_steps, self.min_lr = _count(total_steps=total_steps), float(min_lr)

    def __call__(self, step: int) -> float:
        cos = 1 + math.cos(math.pi * step / self.total_steps)
        return self.min_lr + (self.lr - self.min_lr) * cos / 2


class InverseScaling(Schedule):
    """``lr / (step + 1)^power``: scikit-learn's ``learning_rate='invscaling'`` (``power_t``)."""

    def __init__(self, lr: float, power: float = 0.5) -> None:
        self.lr = check_lr(lr)
        _non_negative(power=power)
        self.power = float(power)

    def __call__(self, step: int) -> float:
        return self.lr * (step + 1) ** -self.power


class LinearWarmup(Schedule):
    """``after`` preceded by ``warmup_steps`` steps rising linearly to its first value.

    Step ``s < warmup_steps``: ``after(0) · (start_factor + (1 - start_factor) s / warmup_steps)``;
    then ``after(s - warmup_steps)``: ``after`` starts when the warm-up ends. This is torch's
    ``SequentialLR([LinearLR(start_factor, 1, warmup_steps), after], milestones=[warmup_steps])``.
    ``after`` may be a number (a constant learning rate) or any schedule.
    """

    def __init__(self, after: LearningRate, warmup_steps: int, start_factor: float = 0.1) -> None:
        warmup_steps = _count(warmup_steps=warmup_steps)
        _positive(start_factor=start_factor)
        if start_factor > 1:
            raise InputError(f"start_factor must be <= 1, got {start_factor}")
        self.after, self.warmup_steps, self.start_factor = as_schedule(after), warmup_steps, start_factor

    def __call__(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.after(step - self.warmup_steps)
        f = self.start_factor + (1 - self.start_factor) * step / self.warmup_steps
        return self.after(0) * f


def warmup_past_run(schedule: object, updates: int, run: str = "") -> str | None:
    """What to say when ``schedule`` is a :class:`LinearWarmup` as long as a run of ``updates``
    optimizer updates or longer (the learning rate never reaches the rate it warms up to), else
    ``None``. ``run`` describes the run (``"2 epochs of 8"``). The one rule behind the
    :class:`~onnxgrad.train.Trainer`'s warning, which ``onnxgrad train`` shows."""
    if not isinstance(schedule, LinearWarmup) or schedule.warmup_steps < updates:
        return None
    detail = f": {run}" if run else ""
    return (
        f"the warm-up of {schedule.warmup_steps} updates is as long as the run or longer ({updates} "
        f"updates{detail}): the learning rate never reaches {schedule.after(0):g}"
    )


def as_schedule(lr: LearningRate) -> Callable[[int], float]:
    """A number becomes a :class:`Constant`; a callable ``step -> lr`` is used as given."""
    if callable(lr):
        return lr
    if isinstance(lr, NOT_A_RATE):  # no rate (check_lr's rule)
        raise InputError(f"lr must be a number or a callable step -> lr, got {lr!r}")
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise InputError(f"lr must be a number or a callable step -> lr, got {lr!r}") from None
    return Constant(value)


class ReduceLROnPlateau(Schedule):
    """Divide the learning rate when a metric stops improving: ``torch.optim.lr_scheduler.
    ReduceLROnPlateau``, stepped once per epoch with the epoch's ``monitor`` value.

    Unlike the other schedules this one has state: :meth:`step` takes the metric and may lower the
    rate, ``schedule(step)`` returns the current rate whatever the step. :class:`onnxgrad.train.
    Trainer` steps it at the end of every epoch with ``logs[monitor]`` (``"val_loss"``, or
    ``"loss"``, or a metric) and keeps its state in checkpoints.

    Semantics of torch: ``mode`` ``"min"`` or ``"max"``; a value improves on the best when below
    ``best · (1 - threshold)`` (``threshold_mode="rel"``, ``"min"``) or ``best - threshold``
    (``"abs"``), mirrored for ``"max"``; after more than ``patience`` epochs without improvement the
    rate becomes ``max(lr · factor, min_lr)`` (a change smaller than ``eps`` is ignored), then
    ``cooldown`` epochs pass before bad epochs count again.
    """

    def __init__(
        self,
        lr: float,
        *,
        monitor: str = "val_loss",
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_lr: float = 0.0,
        eps: float = 1e-8,
    ) -> None:
        lr = check_lr(lr)
        _non_negative(patience=patience, threshold=threshold, cooldown=cooldown, min_lr=min_lr, eps=eps)
        if not 0 <= _real("factor", factor) < 1:
            raise InputError(f"factor must be in [0, 1), got {factor}")
        if mode not in ("min", "max"):
            raise InputError(f"mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise InputError(f"threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
        self.lr, self.monitor, self.mode, self.factor = float(lr), monitor, mode, float(factor)
        self.patience, self.threshold, self.threshold_mode = int(patience), float(threshold), threshold_mode
        self.cooldown, self.min_lr, self.eps = int(cooldown), float(min_lr), float(eps)
        self.reset()

    def reset(self) -> None:
        """Back to the state of a new schedule: the rate ``lr``, no best value, no epoch seen.
        (:class:`onnxgrad.train.Trainer` steps a copy of the schedule it is given, reset so.)"""
        self.current = self.lr
        self.best = math.inf if self.mode == "min" else -math.inf
        self.num_bad_epochs, self.cooldown_counter, self.last_epoch = 0, 0, 0

    def __call__(self, step: int) -> float:
        return self.current

    def is_better(self, value: float) -> bool:
        """Whether ``value`` improves on the best one by more than the threshold."""
        sign = 1.0 if self.mode == "min" else -1.0
        if self.threshold_mode == "rel":
            return sign * value < sign * self.best * (1 - sign * self.threshold)
        return sign * value < sign * self.best - self.threshold

    def step(self, value: float) -> float:
        """Record one epoch's metric; returns the learning rate for what comes next."""
        value = float(value)
        self.last_epoch += 1
        if self.is_better(value):
            self.best, self.num_bad_epochs = value, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            new = max(self.current * self.factor, self.min_lr)
            if self.current - new > self.eps:
                self.current = new
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        return self.current

    def state_dict(self) -> dict[str, float | int]:
        """What changes as it steps: the current rate, the best value and the counters."""
        keys = ("current", "best", "num_bad_epochs", "cooldown_counter", "last_epoch")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.current, self.best = float(state["current"]), float(state["best"])
        self.num_bad_epochs, self.cooldown_counter = (
            int(state["num_bad_epochs"]),
            int(state["cooldown_counter"]),
        )
        self.last_epoch = int(state["last_epoch"])


class Optimal(Schedule):
    """scikit-learn's and onnxcustom's ``learning_rate='optimal'``: ``1 / (alpha (t + t0))``.

    ``t0`` comes from Léon Bottou's heuristic: with ``typw = sqrt(1 / sqrt(alpha))``, the first
    rate is ``eta_b = typw / max(1, dloss)`` and ``t0 = 1 / (alpha eta_b)``. ``dloss`` is the slope
    of the loss at prediction ``-typw`` for target 1: by default ``2 (1 + typw)``, the squared
    error ``(p - y)²`` as onnxcustom's ``LearningRateSGD`` computed it; scikit-learn's
    ``SGDRegressor`` takes the signed slope of ``(p - y)² / 2``, negative, so its ``max`` is 1:
    pass ``dloss=1`` for its rates.

    ``eta0``: when given, the curve is scaled to start at ``eta0``: ``eta0 t0 / (t0 + t)``, which is
    ``LearningRateSGD(eta0=eta0, alpha=alpha, learning_rate='optimal')``; ``None``: ``1 / (alpha
    (t0 + t))``, scikit-learn's. ``t = step // steps_per_epoch``: onnxcustom changed the rate once
    per epoch (``steps_per_epoch`` = batches per epoch), scikit-learn's SGD once per sample
    (``steps_per_epoch=1`` with one sample per batch).
    """

    def __init__(
        self,
        alpha: float = 1e-4,
        eta0: float | None = None,
        dloss: float | None = None,
        steps_per_epoch: int = 1,
    ) -> None:
        _positive(alpha=alpha, steps_per_epoch=steps_per_epoch)
        if eta0 is not None:
            _non_negative(eta0=eta0)
        if dloss is not None:
            _non_negative(dloss=dloss)
        self.alpha, self.eta0, self.dloss = float(alpha), eta0, dloss
        self.steps_per_epoch = int(steps_per_epoch)
        typw = math.sqrt(1.0 / math.sqrt(self.alpha))
        slope = 2.0 * (1.0 + typw) if dloss is None else float(dloss)
        self.t0 = 1.0 / (self.alpha * (typw / max(1.0, slope)))

    def __call__(self, step: int) -> float:
        t = step // self.steps_per_epoch
        if self.eta0 is None:
            return 1.0 / (self.alpha * (self.t0 + t))
        return self.eta0 * self.t0 / (self.t0 + t)
