"""Custom ``torch.autograd.Function``s inside ONNX graphs: ``com.microsoft`` PythonOp / PythonOpGrad.

A plug-in above the runtime: the lower layers know nothing of it.

* :mod:`onnxgrad.model.pythonop_spec` / :mod:`~onnxgrad.model.pythonop_schemas` (the model layer)
  read the nodes' attributes and register both ops with ``onnx.defs``;
* :mod:`.gradient` differentiates PythonOp into PythonOpGrad (the Function's own backward), and
  registers that rule with the autodiff registry when this package is imported;
* :mod:`.registry` holds the Functions allowed to run and the ctx of calls awaiting a backward;
* :mod:`.executor` runs such graphs on stock onnxruntime, partitioned around the Python nodes;
  :func:`python_runner` registers it with :func:`onnxgrad.runtime.runner.make_runner`.

``import onnxgrad`` imports this package. It does not import torch; :func:`make_runner` does, only
for graphs that hold Python nodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..model.pythonop_spec import MS_DOMAIN, PYTHON_OP, PYTHON_OP_GRAD, has_python_nodes, is_python_node
from ..runtime.runner import BaseRunner, make_runner, register_runner
from . import gradient  # noqa: F401  (registers the PythonOp rule with the autodiff registry)
from .registry import (
    FIRST_HANDLE,
    contexts,
    qualified_name,
    register_function,
    registered_functions,
    resolve_function,
    unregister_function,
)

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


@register_runner
def python_runner(
    graphs: Any,
    providers: list[Any],
    session_options: Any = None,
    *,
    functions: Any = None,
    allow_import: bool | Iterable[str] = False,
) -> BaseRunner | None:
    """The runner of graphs holding PythonOp or PythonOpGrad nodes (None for the others), which
    :func:`onnxgrad.runtime.runner.make_runner` asks first: a
    :class:`~onnxgrad.pythonop.executor.PythonOpRunner`, which resolves every Function the graphs
    name (``functions``: extra classes allowed for these graphs; ``allow_import``: module prefixes
    from which classes may be imported)."""
    if not has_python_nodes(graphs.forward, graphs.backward):
        return None
    from .executor import PythonOpRunner  # imports torch

    return PythonOpRunner(graphs, providers, session_options, functions=functions, allow_import=allow_import)
