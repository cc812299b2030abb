"""Tensor values crossing into and out of onnxruntime, without copies.

onnxruntime's Python wrapper classes cost tens of microseconds per call; the training step of a
small model is dominated by them. These helpers work with the C-level ``OrtValue`` (the object
the wrappers hold) and run sessions through ``run_with_ort_values``: one call per graph run. The
calls into onnxruntime and torch go through :mod:`onnxgrad.deps`, which picks the form the installed
releases speak.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..deps import C, ortvalue_from_numpy, ortvalue_to_numpy, run_with_ort_values, torch_interop
from ..errors import InputError, InputTypeError
from ..model.graph import ValueInfo, dtype_name

__all__ = [
    "C",
    "OrtValueLike",
    "check_dims_agree",
    "check_input",
    "coerce",
    "feed_dtype",
    "from_numpy",
    "from_torch",
    "run",
    "to_numpy",
    "to_torch",
    "unwrap",
]

OrtValueLike = Any  # a C-level OrtValue or the onnxruntime.OrtValue wrapper around one
_C_ORTVALUE = C.OrtValue

from_numpy = ortvalue_from_numpy
to_numpy = ortvalue_to_numpy
run = run_with_ort_values


def contiguous(value: Any, dtype: Any = None) -> np.ndarray:
    """``value`` as a C-contiguous array (itself when it already is one of ``dtype``).

    ``np.ascontiguousarray`` returns at least one dimension: a 0-d array (a scalar weight such as
    skl2onnx's ``unity``) would come back with shape ``(1,)``.
    """
    arr = np.asarray(value, dtype=dtype)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def unwrap(value: OrtValueLike) -> Any:
    """The C-level OrtValue of a wrapper (or the value itself)."""
    return getattr(value, "_ortvalue", value)


_to_ortvalue: Any = None
_to_tensor: Any = None


def _bind() -> None:
    """Bind the torch conversions on first use (module globals: a lookup each call)."""
    global _to_ortvalue, _to_tensor
    interop = torch_interop()
    _to_ortvalue, _to_tensor = interop.to_ortvalue, interop.to_tensor


def from_torch(t: Any) -> Any:
    """An OrtValue sharing a CPU torch tensor's buffer (a contiguous copy for a strided view).

    The value goes through a DLPack capsule, whose deleter holds the tensor: the OrtValue keeps
    the buffer alive by itself, however long onnxruntime holds it. ``t`` may require grad (the
    value only reads the buffer). About 0.5 µs, against 1.3 µs through ``t.numpy()``.
    """
    if _to_ortvalue is None:
        _bind()
    return _to_ortvalue(t)


def to_torch(value: OrtValueLike) -> Any:
    """A torch tensor sharing an OrtValue's buffer (the tensor keeps the value alive)."""
    if _to_tensor is None:
        _bind()
    if type(value) is not _C_ORTVALUE:  # cheaper than getattr with a default, which raises inside
        value = unwrap(value)
    return _to_tensor(value)


# The input contract, the same through every door (ForwardBackward, OnnxModule, Trainer and the
# command line, artifacts.Runner): what a given array's dtype kind may be fed as, by the declared
# dtype's kind. Casts keep values: numbers become the declared float type, integers any integer type
# whose range holds them, and floats holding whole numbers (class labels read from a CSV file)
# integers. Anything else is refused. Arrays that are no input of the model are refused by each door
# with the names it takes.
_FEEDS_AS = {"f": "fiub", "i": "iubf", "u": "iubf", "b": "b"}


def _kind(dtype: str) -> str:
    """numpy's kind letter of a dtype name; ``"f"`` for the float types numpy spells through
    ml_dtypes or torch (``"bfloat16"``), ``""`` for a name numpy does not know."""
    if dtype.startswith(("float", "bfloat")):  # ml_dtypes' types are of numpy's kind "V"
        return "f"
    try:
        return np.dtype(dtype).kind
    except TypeError:
        return ""


def feed_dtype(label: str, given: str, expected: str) -> str:
    """The dtype (numpy name) a value of dtype ``given`` is fed as where the model declares
    ``expected``: ``expected``, or :class:`InputTypeError` when the contract refuses the pair.

    ``label`` is how the error calls the value (``"input 'x'"``); ``given`` may be a torch dtype
    name (``"bfloat16"``).
    """
    kind = _kind(given)
    if given == expected or (kind and kind in _FEEDS_AS.get(_kind(expected), "")):
        return expected
    raise InputTypeError(f"{label} has dtype {given}, the model expects {expected}")


def coerce(label: str, value: Any, expected: np.dtype) -> np.ndarray:
    """``value`` as an array of ``expected`` under the input contract (:func:`feed_dtype`):
    numbers cast to a float type; integers, and floats holding whole numbers, to an integer type
    whose range holds them, else :class:`InputError` naming the first value that does not fit.
    An array that already has ``expected`` comes back as it is. ``label``: how errors call it."""
    try:
        arr = np.asarray(value)
        if arr.dtype.kind not in "fiub" and not isinstance(value, np.ndarray):
            arr = np.asarray(value, dtype=expected)  # Python objects that numpy converts
    except (TypeError, ValueError) as exc:
        raise InputTypeError(f"{label} cannot be converted to {expected}: {exc}") from exc
    if arr.dtype == expected:
        return arr
    feed_dtype(label, arr.dtype.name, np.dtype(expected).name)
    if expected.kind in "iu" and arr.size:
        if arr.dtype.kind == "f":
            integral = np.isfinite(arr) & (arr == np.round(arr))
            if not integral.all():
                bad = arr[~integral].flat[0]
                raise InputError(
                    f"{label} expects integers ({expected}), the data has non-integers such as {float(bad):g}"
                )
        bounds = np.iinfo(expected)
        lo, hi = arr.min(), arr.max()
        if lo < bounds.min or hi > bounds.max:
            raise InputError(
                f"{label} holds {lo if lo < bounds.min else hi}, outside the range of {expected}"
            )
    return arr.astype(expected)


def check_input(name: str, dtype: str, shape: Sequence[int], info: ValueInfo) -> None:
    """:class:`InputError` unless a value of ``dtype`` (a numpy or torch dtype name: ``"float32"``)
    and ``shape`` can be fed as input ``name`` declared as ``info`` (after the contract's cast,
    :func:`feed_dtype`)."""
    feed_dtype(f"input {name!r}", dtype, dtype_name(info.dtype))
    if info.shape is None:
        return
    shape = tuple(shape)
    want = "(" + ", ".join("?" if d is None else str(d) for d in info.shape) + ")"
    if len(shape) != len(info.shape):
        raise InputError(
            f"input {name!r} has rank {len(shape)} (shape {shape}), the model expects rank "
            f"{len(info.shape)} (shape {want})"
        )
    for i, (d, w) in enumerate(zip(shape, info.shape)):
        if isinstance(w, int) and d != w:
            raise InputError(
                f"input {name!r} has shape {shape}, the model expects {want} (dimension {i} must be {w})"
            )


def check_dims_agree(shapes: Mapping[str, Sequence[int]], infos: Mapping[str, ValueInfo]) -> None:
    """:class:`InputError` when inputs whose declared shapes share a symbolic dimension (the batch
    ``N`` of the features and of the target) are given different sizes for it; ``shapes``: input
    name -> the given shape, ``infos``: input name -> its declaration (ranks already checked)."""
    seen: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        info = infos.get(name)
        if info is None or info.shape is None or len(info.shape) != len(shape):
            continue
        for d, want in zip(shape, info.shape):
            if not isinstance(want, str) or not want:
                continue
            if want in seen and seen[want][1] != d:
                other, size, other_shape = seen[want]
                raise InputError(
                    f"inputs {other!r} and {name!r} disagree on dimension {want!r}: {other!r} has {size} "
                    f"(shape {other_shape}), {name!r} has {d} (shape {tuple(shape)})"
                )
            seen.setdefault(want, (name, int(d), tuple(shape)))
