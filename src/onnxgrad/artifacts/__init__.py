"""One-graph training steps that run on any stock onnxruntime (Python, Node, the browser).

:func:`generate` writes a folder: ``train_step.onnx`` (forward, loss, backward and optimizer update
in one plain ONNX graph), ``eval_step.onnx``, ``inference.onnx``, ``state.safetensors`` (the starting
parameters and optimizer state) and ``manifest.json``. :class:`Runner` trains from such a folder
with onnxruntime alone; the ``js/`` package of the repository does the same in JavaScript.
"""

from .generate import FORMAT, Artifacts, generate
from .runner import Runner

__all__ = ["FORMAT", "Artifacts", "Runner", "generate"]
