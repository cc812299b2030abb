"""Shared set-up of the PythonOp tests.

Until ``runtime/session.py`` and ``torch/module.py`` build their runner with
:func:`onnxgrad.pythonop.make_runner`, the ``python_runners`` fixture routes them there (a no-op once
they do).
"""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("torch")

import onnxgrad.pythonop.gradient  # noqa: F401  (registers the PythonOp rule)
from onnxgrad.pythonop import contexts, has_python_nodes


@pytest.fixture(autouse=True)
def python_runners(monkeypatch):
    from onnxgrad.pythonop.executor import PythonOpRunner
    from onnxgrad.runtime import session
    from onnxgrad.torch import module

    plain = session.Runner

    def factory(graphs, providers, session_options=None):
        if has_python_nodes(graphs.forward, graphs.backward):
            return PythonOpRunner(graphs, providers, session_options)
        return plain(graphs, providers, session_options)

    if getattr(plain, "__name__", "") == "Runner":
        monkeypatch.setattr(session, "Runner", factory)
    if getattr(getattr(module, "Runner", None), "__name__", "") == "Runner":
        monkeypatch.setattr(module, "Runner", factory)
    yield


@pytest.fixture
def no_leaks():
    """Asserts that every ctx of the test was released by its end."""
    gc.collect()
    before = set(contexts.handles())
    yield
    gc.collect()
    assert set(contexts.handles()) - before == set()
