"""Kept for imports of ``onnxgrad.autodiff.fold``: the folding lives in :mod:`onnxgrad.model.fold`."""

from ..model.fold import *  # noqa: F403
