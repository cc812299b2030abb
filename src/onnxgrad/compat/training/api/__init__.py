"""``onnxruntime.training.api`` on onnxgrad: CheckpointState, Module, Optimizer, LinearLRScheduler."""

from . import lr_scheduler
from .checkpoint_state import CheckpointState
from .lr_scheduler import LinearLRScheduler
from .module import Module
from .optimizer import Optimizer

__all__ = ["CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "lr_scheduler"]
