"""Kept for imports of ``onnxgrad.pythonop.schemas``: see :mod:`onnxgrad.model.pythonop_schemas`."""

from ..model.pythonop_schemas import register_schemas  # noqa: F401
