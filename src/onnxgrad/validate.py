"""Deprecated: import the checks of untrusted models from :mod:`onnxgrad.model`.

``onnxgrad.validate`` was their public home in 0.1 (SECURITY.md named it); the model layer now
exports them (``from onnxgrad.model import Limits, check_model_safety, load_untrusted``). Importing
this module warns once and gives the same objects; it will be removed in a later release.
"""

import warnings

from .model.validate import *  # noqa: F403
from .model.validate import __all__  # noqa: F401

warnings.warn(
    "onnxgrad.validate is deprecated: import Limits, check_model_safety and load_untrusted from "
    "onnxgrad.model",
    DeprecationWarning,
    stacklevel=2,
)
