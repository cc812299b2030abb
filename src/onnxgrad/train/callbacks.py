"""Hooks into :meth:`onnxgrad.train.Trainer.fit` (:class:`Callback`), the ones onnxgrad ships
(:class:`EarlyStopping`, :class:`HistoryFile`) and the accuracy metric.

A callback sees the trainer through :class:`TrainerView`, the part of :class:`Trainer` it may read
and change: the history, the live parameters, whether validation data was given, and the
``stop_training`` flag.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from ..errors import InputError
from .history import History

__all__ = [
    "Callback",
    "EarlyStopping",
    "HistoryFile",
    "Metric",
    "TrainerView",
    "accuracy",
    "accuracy_metric",
    "as_callback",
    "infer_mode",
]

Metric = Callable[[Mapping[str, np.ndarray], Mapping[str, np.ndarray]], float]


class TrainerView(Protocol):
    """What a callback may use of the trainer that calls it."""

    history: History
    stop_training: bool
    has_validation: bool

    @property
    def parameters(self) -> dict[str, np.ndarray]: ...

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None: ...


class Callback:
    """Hooks called by :meth:`Trainer.fit`; override the ones needed.

    ``logs`` of ``on_batch_end`` has ``loss`` and ``batch_size`` (one mini-batch); ``on_step_end``
    comes after each optimizer update (once per ``accumulate`` batches) with ``loss`` (the mean over
    the batches of the update), ``lr`` and, when the trainer clips by norm, ``grad_norm`` (before
    clipping); ``logs`` of ``on_epoch_end`` is the epoch's history record. Setting
    ``trainer.stop_training = True`` ends the run after the epoch.

    This is the hook for experiment trackers: MLflow, Weights & Biases or TensorBoard need a few
    lines, e.g. ``on_epoch_end = lambda self, t, epoch, logs: mlflow.log_metrics({k: v for k, v in
    logs.items() if k != "epoch"}, step=epoch)`` (``wandb.log(dict(logs))``,
    ``SummaryWriter.add_scalar``); :class:`HistoryFile` writes a CSV or JSON file.
    A callback with state (counters, best values) returns it from :meth:`state_dict` (numbers,
    strings, lists, dicts and numpy arrays) so that checkpoints carry it.
    """

    def on_train_begin(self, trainer: TrainerView) -> None: ...

    def on_epoch_begin(self, trainer: TrainerView, epoch: int) -> None: ...

    def on_batch_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None: ...

    def on_step_end(self, trainer: TrainerView, step: int, logs: Mapping[str, Any]) -> None: ...

    def on_epoch_end(self, trainer: TrainerView, epoch: int, logs: Mapping[str, Any]) -> None: ...

    def on_train_end(self, trainer: TrainerView) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class _EpochEndFunction(Callback):
    """A plain function ``fn(trainer, epoch, logs)`` called at the end of each epoch."""

    def __init__(self, fn: Callable[[TrainerView, int, Mapping[str, Any]], Any]) -> None:
        self.fn = fn

    def on_epoch_end(self, trainer: TrainerView, epoch: int, logs: Mapping[str, Any]) -> None:
        self.fn(trainer, epoch, logs)


class HistoryFile(Callback):
    """Write the history to ``path`` (``.csv`` or ``.json``, one row per epoch) after every epoch,
    so that the file is complete however the run ends (a resumed run rewrites it whole)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if os.path.splitext(self.path)[1].lower() not in (".csv", ".json"):
            raise InputError(f"history file {self.path!r}: expected a .csv or .json file")

    def on_epoch_end(self, trainer: TrainerView, epoch: int, logs: Mapping[str, Any]) -> None:
        trainer.history.save(self.path)


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of rows whose largest logit (last axis) is the label."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    return float(np.mean(np.argmax(logits, axis=-1) == labels.reshape(logits.shape[:-1])))


def accuracy_metric(output: str, target: str = "target") -> Metric:
    """A metric for ``Trainer(metrics={"acc": accuracy_metric("logits")})``: the accuracy of the
    ``output`` logits against the ``target`` class indices of the batch."""

    def metric(outputs: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray]) -> float:
        return accuracy(outputs[output], batch[target])

    return metric


# metric names whose larger values are better, as Keras infers mode="auto" ("acc", "accuracy",
# "auc"... in the name; "fmeasure" for F-scores); anything else is a loss or an error
_HIGHER_IS_BETTER = ("acc", "auc", "f1", "fmeasure", "precision", "recall", "r2", "iou", "dice")


def infer_mode(monitor: str) -> str:
    """``"max"`` when ``monitor`` names an accuracy-like metric (``acc``, ``val_accuracy``,
    ``val_auc``, ``f1``, ``precision``, ``recall``, ``r2``, ``iou``, ``dice``, in the name after an
    optional ``val_``, and no ``loss`` or ``err``), else ``"min"`` (losses, errors): Keras's
    ``mode="auto"``."""
    name = monitor.lower().removeprefix("val_")
    if "loss" in name or "err" in name:  # "dice_loss", "acc_error": lower is better
        return "min"
    return "max" if any(word in name for word in _HIGHER_IS_BETTER) else "min"


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` epochs.

    ``mode``: ``"min"`` (lower is better: losses), ``"max"`` (higher is better: accuracy) or
    ``"auto"`` (the default): ``"max"`` for accuracy-like names (``acc``, ``val_acc``, ``auc``,
    ``f1``...; :func:`infer_mode`), ``"min"`` otherwise, as Keras infers it.
    With ``restore_best``, the parameters of the best epoch are put back when it stops.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        patience: int = 5,
        min_delta: float = 0.0,
        restore_best: bool = True,
        mode: str = "auto",
    ) -> None:
        if patience < 1:
            raise InputError(f"patience must be >= 1, got {patience}")
        if mode not in ("min", "max", "auto"):
            raise InputError(f"mode must be 'min', 'max' or 'auto', got {mode!r}")
        if not min_delta >= 0:
            raise InputError(f"min_delta must be >= 0, got {min_delta}")
        self.monitor, self.patience, self.min_delta = monitor, int(patience), float(min_delta)
        self.mode = infer_mode(monitor) if mode == "auto" else mode
        self.restore_best = restore_best
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch, self.wait, self.stopped_epoch = 0, 0, 0
        self.best_params: dict[str, np.ndarray] | None = None

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best one by more than ``min_delta``, in the mode's direction."""
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_train_begin(self, trainer: TrainerView) -> None:
        if self.monitor.startswith("val_") and not trainer.has_validation:
            raise InputError(f"EarlyStopping monitors {self.monitor!r} but fit() got no validation data")

    def on_epoch_end(self, trainer: TrainerView, epoch: int, logs: Mapping[str, Any]) -> None:
        if self.monitor not in logs:
            raise InputError(f"EarlyStopping monitors {self.monitor!r}, not in the epoch's logs {list(logs)}")
        value = float(logs[self.monitor])
        if self.improves(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best:
                params = trainer.parameters
                if self.best_params is None:
                    self.best_params = {k: v.copy() for k, v in params.items()}
                else:  # reuse the buffers: no allocation per improvement
                    for k, v in params.items():
                        np.copyto(self.best_params[k], v)
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.stop_training = True
            self.stopped_epoch = epoch
            if self.restore_best and self.best_params is not None:
                trainer.set_parameters(self.best_params)

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "wait": self.wait,
            "stopped_epoch": self.stopped_epoch,
            "best_params": self.best_params,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.best_epoch = float(state["best"]), int(state["best_epoch"])
        self.wait, self.stopped_epoch = int(state["wait"]), int(state["stopped_epoch"])
        bp = state["best_params"]
        self.best_params = None if bp is None else {k: np.array(v) for k, v in bp.items()}


def as_callback(callback: Callback | Callable[[TrainerView, int, Mapping[str, Any]], Any]) -> Callback:
    """``callback`` itself, or a plain function ``fn(trainer, epoch, logs)`` as a :class:`Callback`
    called at the end of each epoch."""
    return callback if isinstance(callback, Callback) else _EpochEndFunction(callback)
