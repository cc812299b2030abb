"""Tensor values crossing into and out of onnxruntime, without copies.

onnxruntime's Python wrapper classes cost tens of microseconds per call; the training step of a
small model is dominated by them. These helpers work with the C-level ``OrtValue`` (the object
the wrappers hold) and run sessions through ``run_with_ort_values``: one call per graph run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

CPU = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
OrtValueLike = Any  # a C-level OrtValue or the onnxruntime.OrtValue wrapper around one


def from_numpy(arr: np.ndarray) -> C.OrtValue:
    """An OrtValue sharing ``arr``'s buffer (``arr`` must be C-contiguous and kept alive)."""
    return C.OrtValue.ortvalue_from_numpy(arr, CPU)


def unwrap(value: OrtValueLike) -> C.OrtValue:
    """The C-level OrtValue of a wrapper (or the value itself)."""
    return getattr(value, "_ortvalue", value)


def run(
    sess: ort.InferenceSession,
    feeds: Mapping[str, OrtValueLike],
    outputs: Sequence[str],
    run_options: ort.RunOptions | None = None,
) -> list[C.OrtValue]:
    """Run ``sess`` on OrtValues; the outputs are OrtValues allocated by onnxruntime."""
    c_feeds = {k: unwrap(v) for k, v in feeds.items()}
    result = sess._sess.run_with_ort_values(c_feeds, list(outputs), run_options)
    return [result[i] for i in range(len(outputs))]


def from_torch(t: Any) -> C.OrtValue:
    """An OrtValue sharing a CPU torch tensor's buffer.

    The tensor must be contiguous, and the caller must keep it alive while the value is in use:
    the OrtValue holds no reference to it (that is what makes it cheap).
    """
    try:
        return C.OrtValue.ortvalue_from_numpy(t.numpy(), CPU)  # the faster path
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        return C.OrtValue.from_dlpack(t.__dlpack__(), t.dtype is _torch_bool())


def to_torch(value: OrtValueLike) -> Any:
    """A torch tensor sharing an OrtValue's buffer."""
    import torch

    value = unwrap(value)
    t = torch.from_dlpack(value.to_dlpack())
    if value.data_type() == "tensor(bool)" and t.dtype != torch.bool:
        t = t.view(torch.bool)  # older DLPack versions carry bool as uint8
    return t


def _torch_bool() -> Any:
    import torch

    return torch.bool
