"""Kept for imports of ``onnxgrad.validate``: the checks live in :mod:`onnxgrad.model.validate`."""

from .model.validate import *  # noqa: F403
from .model.validate import __all__  # noqa: F401
