"""Training on ONNX models: loss graphs appended to a model, and in-place numpy optimizers."""

from .losses import LOSSES, add_loss, remove_loss
from .optim import SGD, Adam, Optimizer

__all__ = ["LOSSES", "SGD", "Adam", "Optimizer", "add_loss", "remove_loss"]
