"""onnxgrad: trainable ONNX graphs.

Autodiff on ONNX (:func:`build_gradient`), forward/backward on stock onnxruntime
(:class:`ForwardBackward`, :func:`gradients`), and, under :mod:`onnxgrad.torch`, a PyTorch bridge.
Importing this package never imports torch.
"""

from __future__ import annotations

from typing import Any

from . import errors, pythonop  # noqa: F401  (pythonop registers the com.microsoft schemas; no torch)
from ._version import __version__
from .autodiff import GradientGraphs, build_gradient, supported_ops
from .runtime import ForwardBackward, gradients
from .storage import save_model

__all__ = [
    "ForwardBackward",
    "GradientGraphs",
    "__version__",
    "build_gradient",
    "errors",
    "gradients",
    "save_model",
    "supported_ops",
]


def __getattr__(name: str) -> Any:
    # torch-dependent entry points load torch only when asked for.
    if name in ("export", "register_function"):
        from . import torch as _torch

        return getattr(_torch, name)
    raise AttributeError(f"module 'onnxgrad' has no attribute {name!r}")
