"""OrtValues in and out of the compat interface: checks, :class:`OrtValueVector`, output caches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from ..deps import C
from ..errors import InputError, InputTypeError
from ..model.graph import ValueInfo
from ..runtime.ortvaluevector import copy_into_ortvaluevector


def ort_type(dtype: int) -> str:
    """The element type as onnxruntime spells it (``OrtValue.data_type()``): 'tensor(float)'."""
    return f"tensor({TensorProto.DataType.Name(dtype).lower()})"


def check_value(kind: str, position: int, info: ValueInfo | None, value: Any) -> None:
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


def c_value(value: Any) -> Any:
    """The ``C.OrtValue`` (``onnxruntime.capi._pybind_state.OrtValue``) of a public
    ``onnxruntime.OrtValue`` or of a C-level one."""
    if isinstance(value, C.OrtValue):
        return value
    if isinstance(value, ort.OrtValue):
        return value._ortvalue
    raise InputTypeError(
        f"an OrtValueVector holds OrtValues, not {type(value).__name__}: wrap an array with "
        "onnxruntime.OrtValue.ortvalue_from_numpy, or pass the arrays in a list"
    )


class OrtValueVector(C.OrtValueVector):
    """onnxruntime's ``OrtValueVector``, what the original ``forward``, ``backward`` and
    ``input_to_ort`` returned, that also behaves like the Python list earlier onnxgrad versions
    returned.

    It is a real ``C.OrtValueVector`` (``isinstance`` holds; ``push_back``, ``to_dlpacks``,
    ``dlpack_at``, ``element_type_at`` work), and on the Python side: ``len``, iteration,
    unpacking, negative indices and slices (a slice is a ``list``). Items read back are what the
    original's vector gave: ``onnxruntime.capi._pybind_state.OrtValue`` (the C object that
    ``C.SessionIOBinding.bind_ortvalue_input`` and the other C-level functions take; ``.numpy()``,
    ``.shape()``, ``.data_type()`` work as on the public ``onnxruntime.OrtValue``). The vector keeps
    alive the buffers its values borrow (a numpy array given to
    :meth:`~OrtGradientForwardBackwardFunction.input_to_ort`), which the bare C++ vector does not.
    ``None`` (the gradient of a non-float feature) is stored in the C++ vector as an empty float
    tensor and reads back as ``None``.
    """

    def __init__(self, values: Iterable[Any] = (), keep: Iterable[Any] = ()) -> None:
        super().__init__()
        self._items: list[Any] = []
        self._keep: list[Any] = list(keep)  # owners of the buffers the values borrow
        self._native = True  # whether the C++ storage holds what ``_items`` holds
        for v in values:
            self.append(v)

    def append(self, value: Any) -> None:
        """Add an ``OrtValue`` (public or ``C.OrtValue``) or ``None``."""
        if value is None:
            self._push(empty_placeholder())
        else:
            if isinstance(value, ort.OrtValue):
                self._keep.append(value)  # it may hold the numpy array it borrows
            value = c_value(value)
            self._push(value)
        self._items.append(value)

    def push_back(self, value: Any) -> None:
        """Add an ``OrtValue`` (public or ``C.OrtValue``), as :meth:`append` does, or a DLPack
        capsule (onnxruntime's second form, the value taking over the capsule's buffer): the
        Python side sees it too (onnxruntime's own method stores it in the C++ vector only)."""
        if value is None or isinstance(value, ort.OrtValue | C.OrtValue):
            self.append(value)
            return
        if isinstance(value, np.ndarray):
            c_value(value)  # the error that says what to do
        holder = C.OrtValueVector()
        try:
            holder.push_back(value)  # a DLPack capsule; onnxruntime judges anything else
        except TypeError as exc:
            raise InputTypeError(
                f"an OrtValueVector holds OrtValues or DLPack capsules, not {type(value).__name__} ({exc})"
            ) from None
        self._keep.append(holder)
        self.append(C.OrtValueVector.__getitem__(holder, 0))

    def push_back_batch(self, *args: Any, **kwargs: Any) -> None:
        """Not available: add the values one by one (:meth:`append`), so that the Python side
        sees them."""
        raise InputTypeError("OrtValueVector.push_back_batch is not supported: append the values one by one")

    def _push(self, value: Any) -> None:
        if self._native:
            C.OrtValueVector.push_back(self, value)

    def assign(self, values: list[Any]) -> None:
        """Replace the content by ``values``, as the original's agents overwrote an output cache.

        The C++ storage is rewritten in place when it holds as many CPU tensors of the same types
        and shapes (:func:`onnxgrad.runtime.ortvaluevector.copy_into_ortvaluevector`: the buffers
        receive the new data). Otherwise (the last, smaller batch of an epoch) only the Python side
        can change: ``len``, indexing, iteration and the DLPack methods then read the new values,
        and the C++ storage, which no Python call can empty, is no longer used by them.
        """
        new = [None if v is None else c_value(v) for v in values]
        keep = [v for v in values if isinstance(v, ort.OrtValue)]
        stored = [empty_placeholder() if v is None else v for v in new]
        if self._native and copy_into_ortvaluevector(stored, self):
            new = [None if v is None else C.OrtValueVector.__getitem__(self, i) for i, v in enumerate(new)]
        elif self._native and len(self._items) == 0:
            for v in stored:
                C.OrtValueVector.push_back(self, v)
        else:
            self._native = False
        self._items = new
        self._keep = keep

    def to_dlpacks(self, to_tensor: Any) -> list[Any]:
        """Each value as a DLPack capsule passed through ``to_tensor`` (as onnxruntime's)."""
        if self._native:
            return super().to_dlpacks(to_tensor)
        return [to_tensor(self._stored(i).to_dlpack()) for i in range(len(self))]

    def dlpack_at(self, index: int) -> Any:
        """Value ``index`` as a DLPack capsule."""
        return super().dlpack_at(index) if self._native else self._stored(index).to_dlpack()

    def element_type_at(self, index: int) -> int:
        """The ONNX element type of value ``index``."""
        return super().element_type_at(index) if self._native else int(self._stored(index).element_type())

    def _stored(self, index: int) -> Any:
        value = self._items[index]
        return empty_placeholder() if value is None else value

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __repr__(self) -> str:
        shapes = [None if v is None else tuple(v.shape()) for v in self._items]
        return f"OrtValueVector({len(self)} values, shapes={shapes})"


def owned_ortvalue(arr: np.ndarray) -> ort.OrtValue:
    """An ``OrtValue`` holding a copy of ``arr`` in memory onnxruntime owns: ``.numpy()`` of it
    stays valid after the ``OrtValue`` is dropped (an ``OrtValue.ortvalue_from_numpy`` of a
    temporary array would leave that view on freed memory, read as garbage)."""
    arr = np.asarray(arr, order="C")  # a 0-d array stays 0-d (ascontiguousarray makes it 1-d)
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(arr.shape), arr.dtype)
    value.update_inplace(arr)
    return value


_PLACEHOLDER: list[Any] = []


def empty_placeholder() -> Any:
    """A ``C.OrtValue`` of shape (0,), owned by this module (stands for ``None`` in the C++ vector)."""
    if not _PLACEHOLDER:
        arr = np.empty(0, np.float32)
        _PLACEHOLDER.extend([arr, ort.OrtValue.ortvalue_from_numpy(arr)._ortvalue])
    return _PLACEHOLDER[1]


def fill(cache: Any, values: list[Any]) -> Any:
    """Put ``values`` into a caller's cache and return it, replacing what it held, as the original
    overwrote ``forward_outputs_cache`` / ``backward_outputs_cache``; without a cache, a new
    :class:`OrtValueVector`.

    A ``list`` gets the values; an :class:`OrtValueVector` is rewritten (:meth:`~OrtValueVector.assign`);
    an onnxruntime ``C.OrtValueVector`` (what onnxcustom's own loop passed) is filled when empty,
    and overwritten in place when it holds as many tensors of the same types and shapes (the
    original's agents wrote into it the same way). Any other C vector cannot be rewritten from
    Python: :class:`~onnxgrad.errors.InputError` says so. Written in place, the old values' buffers
    receive the new data: arrays read from them before with ``.numpy()`` (which share them) change
    too, as they did with the original; copy them to keep them.
    """
    if cache is None:
        return OrtValueVector(values)
    if isinstance(cache, OrtValueVector):
        cache.assign(values)
        return cache
    if isinstance(cache, list):
        cache[:] = [None if v is None else c_value(v) for v in values]
        return cache
    if isinstance(cache, C.OrtValueVector):  # a bare onnxruntime vector, as the original used
        stored = [empty_placeholder() if v is None else c_value(v) for v in values]
        if len(cache) == 0:
            for v in stored:
                cache.push_back(v)
            return cache
        if copy_into_ortvaluevector(stored, cache):
            return cache
        old = [(cache[i].data_type(), tuple(cache[i].shape())) for i in range(len(cache))]
        new = [(v.data_type(), tuple(v.shape())) for v in stored]
        raise InputError(
            f"the output cache, an onnxruntime OrtValueVector holding {old}, cannot receive {new}: "
            "onnxruntime's vector cannot be emptied or resized from Python, only rewritten in place "
            "with values of the same types and shapes. Pass an empty vector, a list or an "
            "onnxgrad.compat.OrtValueVector (which any values may overwrite) as the cache"
        )
    raise InputTypeError(f"an output cache must be a list or an OrtValueVector, not {type(cache)}")
