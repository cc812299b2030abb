"""Gradient rules by op family; importing this package registers all of them."""

from . import elementwise, linalg, ml, nn, nondiff, reduce, shape  # noqa: F401
