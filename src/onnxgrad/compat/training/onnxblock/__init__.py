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

__all__ = ["Block", "base", "blocks", "custom_op_library", "empty_base", "loss", "optim"]
