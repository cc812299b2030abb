"""Gradient rules by op family; importing this package registers all of them."""

from . import control_flow, elementwise, linalg, losses, ml, nn, nondiff, norm, reduce, sequence, shape  # noqa: F401
