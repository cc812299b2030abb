"""``onnxruntime.training.onnxblock`` on onnxgrad: building blocks for custom losses.

::

    from onnxgrad.compat.training import onnxblock

    class MyLoss(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.mse = onnxblock.loss.MSELoss()
            self.l1 = onnxblock.loss.L1Loss()
            self.add = onnxblock.blocks.Add()

        def build(self, output_name):
            return self.add(self.mse(output_name), self.l1(output_name))

Pass an instance as ``generate_artifacts(..., loss=MyLoss())``, or build on a model yourself with
``with onnxblock.base(model): MyLoss()("output")``.
"""

from . import blocks, loss, optim
from ._accessor import base, custom_op_library, empty_base
from .blocks import Block
from .training import ForwardBlock, TrainingBlock, load_checkpoint_to_model, save_checkpoint

__all__ = [
    "Block",
    "ForwardBlock",
    "TrainingBlock",
    "base",
    "blocks",
    "custom_op_library",
    "empty_base",
    "load_checkpoint_to_model",
    "loss",
    "optim",
    "save_checkpoint",
]
