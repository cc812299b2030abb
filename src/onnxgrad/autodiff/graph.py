"""What the rules and older imports read as ``autodiff.graph``: the model layer's helpers.

They live in :mod:`onnxgrad.model` (:mod:`~onnxgrad.model.graph`, :mod:`~onnxgrad.model.infer`,
:mod:`~onnxgrad.model.load`); this module re-exports them so that ``from ..graph import ...`` in a
rule file keeps working.
"""

from ..model.graph import *  # noqa: F403
from ..model.graph import Dim  # noqa: F401
from ..model.infer import infer_value_infos  # noqa: F401
from ..model.load import CheckedModel, load_checked, load_model  # noqa: F401
