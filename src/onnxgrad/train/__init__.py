"""Training ONNX models with onnxruntime alone: losses appended as ONNX nodes, in-place numpy
optimizers and learning-rate schedules, data loading, and a trainer with callbacks and checkpoints.
"""

from .amp import LossScaler, MixedPrecision
from .callbacks import Callback, EarlyStopping, HistoryFile, accuracy_metric
from .data import BatchLoader, as_feeds, load_dataset, split
from .history import History
from .losses import (
    LOSSES,
    LossSpec,
    add_loss,
    check_labels,
    keep_outputs,
    loss_spec,
    remove_loss,
    with_parameters,
)
from .optim import SGD, Adam, AdamW, Optimizer, clip_grad_norm, clip_grad_value
from .plot import plot_curves
from .schedules import Constant, Cosine, InverseScaling, LinearWarmup, ReduceLROnPlateau, Schedule, StepDecay
from .trainer import OPTIMIZERS, Trainer, make_optimizer

__all__ = [
    "LOSSES",
    "OPTIMIZERS",
    "SGD",
    "Adam",
    "AdamW",
    "BatchLoader",
    "Callback",
    "Constant",
    "Cosine",
    "EarlyStopping",
    "History",
    "HistoryFile",
    "InverseScaling",
    "LinearWarmup",
    "Optimizer",
    "ReduceLROnPlateau",
    "Schedule",
    "StepDecay",
    "Trainer",
    "accuracy_metric",
    "add_loss",
    "as_feeds",
    "clip_grad_norm",
    "clip_grad_value",
    "keep_outputs",
    "load_dataset",
    "make_optimizer",
    "plot_curves",
    "remove_loss",
    "split",
    "with_parameters",
]

# onnxcustom's 'optimal' learning rate and elastic penalty (docs/migrate_onnxcustom_optimizer.md)
from .optim import ElasticPenalty
from .schedules import Optimal

__all__ += ["ElasticPenalty", "Optimal"]

# mixed precision for float16 / bfloat16 models (docs/finetune_deployed.md)
__all__ += ["LossScaler", "MixedPrecision"]

# what add_loss appended, and the class labels it refuses, for loops of one's own (docs/finetune.md)
__all__ += ["LossSpec", "check_labels", "loss_spec"]
