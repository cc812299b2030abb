"""The exceptions onnxgrad raises.

Every error derives from :class:`OnnxGradError`, and also from the builtin exception a caller would
naturally catch (``ValueError`` for bad input, ``TypeError`` for an argument of the wrong type,
``KeyError`` for a name that is not there, ``RuntimeError`` for a failed run,
``NotImplementedError`` for a missing gradient rule), so ``except ValueError`` keeps working for
code that does not know onnxgrad. Every error onnxgrad raises is one of these classes.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = [
    "DependencyError",
    "GradientNotImplementedError",
    "GradientWarning",
    "InputError",
    "InputTypeError",
    "ModelError",
    "NotFoundError",
    "OnnxGradError",
    "OnnxGradRuntimeError",
    "PathNotFoundError",
    "PythonOpError",
    "renamed_argument",
]


class OnnxGradError(Exception):
    """Base class of every onnxgrad error."""


class ModelError(OnnxGradError, ValueError):
    """The model itself is unusable: not ONNX, truncated, a cycle, a value used but never defined."""


class GradientNotImplementedError(OnnxGradError, NotImplementedError):
    """A node on the path from a trainable value to an output has no gradient rule."""


class InputError(OnnxGradError, ValueError):
    """An argument given to onnxgrad is wrong: unknown names, shapes or dtypes that do not match."""


class InputTypeError(InputError, TypeError):
    """An argument given to onnxgrad is of the wrong type (``except TypeError`` catches it too)."""


class NotFoundError(InputError, KeyError):
    """A name asked for is not there: a key of a history, a parameter of a checkpoint
    (``except KeyError`` catches it too)."""


class PathNotFoundError(InputError, FileNotFoundError):
    """A file or folder given to onnxgrad does not exist (``except FileNotFoundError`` catches it
    too)."""


class PythonOpError(OnnxGradError, RuntimeError):
    """A com.microsoft PythonOp / PythonOpGrad node cannot run (unregistered class, failure inside it)."""


class OnnxGradRuntimeError(OnnxGradError, RuntimeError):
    """Running a graph failed, or the forward/backward protocol was not followed."""


class DependencyError(OnnxGradError, ImportError):
    """An installed onnxruntime or torch is outside the supported range, or lacks an API onnxgrad needs."""


class GradientWarning(UserWarning):
    """A gradient onnxgrad computed is not what the caller may expect: a trainable value whose every
    path to the outputs is cut by an op without a gradient (it gets zeros), or a gradient that an
    estimator stands in for."""


def renamed_argument(new: Any, old: Any, *, new_name: str, old_name: str, stacklevel: int = 3) -> Any:
    """The value of a keyword argument renamed from ``old_name`` to ``new_name`` (``None``: not
    given): ``new`` when the caller used the new name, ``old`` with a ``DeprecationWarning`` when it
    used the old one, an :class:`InputError` when both. ``stacklevel`` 3 points the warning at the
    caller of the function that calls this."""
    if old is None:
        return new
    if new is not None:
        raise InputError(f"{old_name}= is the old name of {new_name}=: pass {new_name}= only")
    warnings.warn(f"{old_name}= is deprecated, use {new_name}=", DeprecationWarning, stacklevel=stacklevel)
    return old
