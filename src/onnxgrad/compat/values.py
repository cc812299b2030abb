"""OrtValues in and out of the compat interface: checks, :class:`OrtValueVector`, output caches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from ..deps import C
from ..errors import InputError
from ..model.graph import ValueInfo


def ort_type(dtype: int) -> str:
    """The element type as onnxruntime spells it (``OrtValue.data_type()``): 'tensor(float)'."""
    return f"tensor({TensorProto.DataType.Name(dtype).lower()})"


def check_value(kind: str, position: int, info: ValueInfo | None, value: ort.OrtValue) -> None:
    """Raise :class:`InputError` when ``value`` does not have ``info``'s type and shape."""
    if info is None:  # the model does not declare its type: onnxruntime will judge
        return
    want, got = ort_type(info.dtype), value.data_type()
    if got != want:
        raise InputError(f"{kind} {position} ({info.name!r}) has type {got}, expected {want}")
    if info.shape is None:
        return
    shape = tuple(value.shape())
    ok = len(shape) == len(info.shape) and all(
        not isinstance(w, int) or w == d for d, w in zip(shape, info.shape)
    )
    if not ok:
        expected = tuple("?" if not isinstance(d, int) else d for d in info.shape)
        raise InputError(f"{kind} {position} ({info.name!r}) has shape {shape}, expected {expected}")


class OrtValueVector(C.OrtValueVector):
    """onnxruntime's ``OrtValueVector``, what the original ``forward``, ``backward`` and
    ``input_to_ort`` returned, that also behaves like the Python list earlier onnxgrad versions
    returned.

    It is a real ``C.OrtValueVector`` (``isinstance`` holds; ``push_back``, ``to_dlpacks``,
    ``dlpack_at``, ``element_type_at`` work), and on the Python side: ``len``, iteration,
    unpacking, negative indices and slices (a slice is a ``list``). Items read back are the
    public ``onnxruntime.OrtValue``; each keeps the buffer it borrows (a numpy array given to
    :meth:`~OrtGradientForwardBackwardFunction.input_to_ort`) alive, which the bare C++ vector
    does not. ``None`` (the gradient of a non-float feature) is stored in the C++ vector as an
    empty float tensor and reads back as ``None``.
    """

    def __init__(self, values: Iterable[Any] = ()) -> None:
        super().__init__()
        self._items: list[ort.OrtValue | None] = []
        for v in values:
            self.append(v)

    def append(self, value: Any) -> None:
        """Add an ``OrtValue`` (public or ``C.OrtValue``) or ``None``."""
        if value is None:
            self.push_back(empty_placeholder())
        elif isinstance(value, ort.OrtValue):
            self.push_back(value._ortvalue)
        elif isinstance(value, C.OrtValue):
            self.push_back(value)
            value = ort.OrtValue(value)
        else:
            raise TypeError(f"an OrtValueVector holds OrtValues, not {type(value).__name__}")
        self._items.append(value)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __repr__(self) -> str:
        shapes = [None if v is None else tuple(v.shape()) for v in self._items]
        return f"OrtValueVector({len(self)} values, shapes={shapes})"


_PLACEHOLDER: list[Any] = []


def empty_placeholder() -> Any:
    """A ``C.OrtValue`` of shape (0,), owned by this module (stands for ``None`` in the C++ vector)."""
    if not _PLACEHOLDER:
        arr = np.empty(0, np.float32)
        _PLACEHOLDER.extend([arr, ort.OrtValue.ortvalue_from_numpy(arr)._ortvalue])
    return _PLACEHOLDER[1]


def fill(cache: Any, values: list[Any]) -> Any:
    """Put ``values`` into a caller's cache (list or OrtValueVector) and return it; without a
    cache, a new :class:`OrtValueVector`."""
    if cache is None:
        return OrtValueVector(values)
    if isinstance(cache, OrtValueVector):
        for v in values:
            cache.append(v)
        return cache
    if isinstance(cache, list):
        cache[:] = values
        return cache
    if hasattr(cache, "push_back"):  # an (empty) C.OrtValueVector, as the original used
        for v in values:
            if v is None:  # no gradient (a non-float feature): the empty placeholder
                v = empty_placeholder()
            cache.push_back(v._ortvalue if isinstance(v, ort.OrtValue) else v)
        return cache
    raise TypeError(f"an output cache must be a list or an OrtValueVector, not {type(cache)}")
