"""Kept for imports of ``onnxgrad.pythonop.spec``: see :mod:`onnxgrad.model.pythonop_spec`."""

from ..model.pythonop_spec import *  # noqa: F403
