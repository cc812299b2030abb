"""Custom ``torch.autograd.Function``s inside ONNX graphs: ``com.microsoft`` PythonOp / PythonOpGrad.

* :mod:`.schemas` registers both ops with ``onnx.defs`` (checker and shape inference accept them);
* :mod:`.gradient` differentiates PythonOp into PythonOpGrad (the Function's own backward);
* :mod:`.registry` holds the Functions allowed to run and the ctx of calls awaiting a backward;
* :mod:`.executor` runs such graphs on stock onnxruntime, partitioned around the Python nodes.

Importing this package does not import torch; :func:`make_runner` does, only for graphs that hold
Python nodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import schemas  # noqa: F401  (registers the schemas)
from .registry import (
    FIRST_HANDLE,
    contexts,
    qualified_name,
    register_function,
    registered_functions,
    resolve_function,
    unregister_function,
)
from .spec import MS_DOMAIN, PYTHON_OP, PYTHON_OP_GRAD, has_python_nodes, is_python_node

__all__ = [
    "FIRST_HANDLE",
    "MS_DOMAIN",
    "PYTHON_OP",
    "PYTHON_OP_GRAD",
    "contexts",
    "has_python_nodes",
    "is_python_node",
    "make_runner",
    "qualified_name",
    "register_function",
    "registered_functions",
    "resolve_function",
    "unregister_function",
]


def make_runner(
    graphs: Any,
    providers: list[Any],
    session_options: Any = None,
    *,
    functions: Any = None,
    allow_import: bool | Iterable[str] = False,
) -> Any:
    """The runner for a :class:`~onnxgrad.autodiff.engine.GradientGraphs`.

    A plain :class:`~onnxgrad.runtime.session.Runner` when neither graph holds a PythonOp or
    PythonOpGrad node; otherwise a :class:`~onnxgrad.pythonop.executor.PythonOpRunner` (same
    interface), which resolves every Function the graphs name (``functions``: extra classes allowed
    for these graphs; ``allow_import``: module prefixes from which classes may be imported).
    """
    if has_python_nodes(graphs.forward, graphs.backward):
        from .executor import PythonOpRunner

        return PythonOpRunner(
            graphs, providers, session_options, functions=functions, allow_import=allow_import
        )
    from ..runtime.session import Runner

    return Runner(graphs, providers, session_options)
