"""Writing into an onnxruntime ``OrtValueVector`` in place (what :mod:`onnxgrad.compat`'s output
caches need): the C++ vector cannot be resized from Python, so new values are copied into its
buffers by an Identity session, made like every other session by :func:`~.runner.make_session`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
import onnxruntime as ort

from ..deps import CPU, C
from .options import default_options
from .runner import make_session

__all__ = ["copy_into_ortvaluevector"]

_COPY_SESSIONS: dict[tuple[int, ...], ort.InferenceSession] = {}


def _copy_session(types: tuple[int, ...]) -> ort.InferenceSession:
    """A CPU session of Identity nodes ``x{i} -> y{i}``, one per element type in ``types``, made by
    :func:`~.runner.make_session` (onnxgrad's session-option policy), quiet."""
    sess = _COPY_SESSIONS.get(types)
    if sess is None:
        helper = onnx.helper
        graph = helper.make_graph(
            [helper.make_node("Identity", [f"x{i}"], [f"y{i}"]) for i in range(len(types))],
            "copy_into",
            [helper.make_tensor_value_info(f"x{i}", t, None) for i, t in enumerate(types)],
            [helper.make_tensor_value_info(f"y{i}", t, None) for i, t in enumerate(types)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        options = default_options()
        options.log_severity_level = 4
        sess = make_session(model, ["CPUExecutionProvider"], options)
        _COPY_SESSIONS[types] = sess
    return sess


def copy_into_ortvaluevector(values: Sequence[Any], target: Any) -> bool:
    """Overwrite the values a ``C.OrtValueVector`` holds with ``values`` (C-level OrtValues), in
    place, as onnxruntime-training's agents filled a caller's vector: their buffers receive the new
    data, so ``target`` reads the new values from Python and from C++ alike.

    The C++ vector cannot be emptied or resized from Python: this works when ``target`` holds as
    many CPU tensors as ``values``, with the same element types and shapes (onnxruntime writes the
    outputs of an Identity graph into them as pre-allocated outputs). Returns ``False``, writing
    nothing, otherwise.
    """
    n = len(values)
    if len(target) != n or not hasattr(C.InferenceSession, "run_with_ortvaluevector"):
        return False
    old = [target[i] for i in range(n)]
    for a, b in zip(old, values):
        if not (a.is_tensor() and b.is_tensor()):
            return False
        if a.device_name().lower() != "cpu" or b.device_name().lower() != "cpu":
            return False
        if a.element_type() != b.element_type() or list(a.shape()) != list(b.shape()):
            return False
    if n == 0:
        return True
    feeds = C.OrtValueVector()
    for v in values:
        feeds.push_back(v)
    sess = _copy_session(tuple(int(v.element_type()) for v in values))
    sess._sess.run_with_ortvaluevector(
        ort.RunOptions(),
        [f"x{i}" for i in range(n)],
        feeds,
        [f"y{i}" for i in range(n)],
        target,
        [CPU] * n,
    )
    return True
