"""Loading a model once, at the boundary: what comes out has been validated and need not be again.

Every front end (``ForwardBackward``, ``OnnxModule``, ``build_gradient``, ``gradients``, the compat
classes, the trainer...) calls :func:`load_checked` on what the user gave it (most through
:func:`onnxgrad.autodiff.prepare.prepare`) and hands the :class:`CheckedModel` inward;
:func:`load_model` of a :class:`CheckedModel` returns its proto without running the checks again
(they cost a pass over the file and a shape inference).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnx

from .validate import load_untrusted

ModelSource = onnx.ModelProto | str | os.PathLike | bytes


@dataclass(frozen=True, eq=False)
class CheckedModel:
    """A model that passed :func:`onnxgrad.model.validate.validate_model`.

    Made by :func:`load_checked`, and by onnxgrad's own rewrites of a checked model (which add
    nothing the checks refuse). Lower layers take it as it is; a plain ``ModelProto`` they check.
    """

    proto: onnx.ModelProto


def load_checked(model: ModelSource | CheckedModel) -> CheckedModel:
    """``model`` (a path, bytes, a ``ModelProto``) loaded and checked as untrusted input
    (:func:`onnxgrad.model.validate.load_untrusted`); a :class:`CheckedModel` as it is.
    :class:`~onnxgrad.errors.ModelError` if it is not ONNX or unsafe."""
    if isinstance(model, CheckedModel):
        return model
    return CheckedModel(load_untrusted(model))


def load_model(model: ModelSource | CheckedModel) -> onnx.ModelProto:
    """The ``ModelProto`` of :func:`load_checked` (checked once: a :class:`CheckedModel` is not
    checked again)."""
    return load_checked(model).proto
