"""Shared set-up of the PythonOp tests: torch is required, and ``no_leaks`` checks that every
``ctx`` a test creates is released."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("torch")

import onnxgrad.pythonop.gradient  # noqa: F401  (registers the PythonOp rule)
from onnxgrad.pythonop import contexts


@pytest.fixture
def no_leaks():
    """Asserts that every ctx of the test was released by its end."""
    gc.collect()
    before = set(contexts.handles())
    yield
    gc.collect()
    assert set(contexts.handles()) - before == set()
