"""The bottom layer: reading, checking and describing ONNX models (no autodiff, no runtime).

* :mod:`.load`: :func:`~.load.load_model` reads and validates a model once, at the boundary, and
  :class:`~.load.CheckedModel` carries the checked model inward so that no layer checks it again;
* :mod:`.validate`: the checks of untrusted models (sizes, external data, PythonOp constants),
  within the :mod:`.limits` (:class:`Limits`);
* :mod:`.graph`: types and shapes of values, versions, names, subgraphs, the ONNX checker;
* :mod:`.infer`: shape inference (helped by :mod:`.fold`, which folds what constants fix);
* :mod:`.pythonop_spec` / :mod:`.pythonop_schemas`: the attributes and ``onnx.defs`` schemas of the
  ``com.microsoft`` PythonOp / PythonOpGrad nodes (registered when this package is imported, so that
  the checker and shape inference accept them). Running them is :mod:`onnxgrad.pythonop`'s business.
"""

from . import pythonop_schemas  # noqa: F401  (registers the com.microsoft schemas)
from .limits import Limits, default_limits
from .load import CheckedModel, load_checked, load_model
from .validate import check_model_safety, load_untrusted, validate_model

__all__ = [
    "CheckedModel",
    "Limits",
    "check_model_safety",
    "default_limits",
    "load_checked",
    "load_model",
    "load_untrusted",
    "validate_model",
]
