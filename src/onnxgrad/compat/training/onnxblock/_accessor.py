"""The model that blocks build on: :func:`base` and :func:`empty_base`, as in onnxruntime-training."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import onnx
from onnx import helper

from ....errors import InputError
from ....runtime.runner import newest_opset

__all__ = ["ModelAccessor", "base", "current", "custom_op_library", "empty_base", "generate_graph_name"]

_counter = itertools.count()


def generate_graph_name(hint: str) -> str:
    """A fresh value name ``onnx::<hint>::<n>`` (onnxruntime-training's naming)."""
    return f"onnx::{hint}::{next(_counter)}"


class ModelAccessor:
    """Holds the model the blocks of a ``with base(...)`` block edit in place."""

    def __init__(self, model: onnx.ModelProto, model_path: str | None = None) -> None:
        self.model = model
        self.model_path = model_path

    @property
    def has_path(self) -> bool:
        return self.model_path is not None


_GLOBAL_ACCESSOR: ModelAccessor | None = None


def current() -> ModelAccessor:
    """The accessor of the enclosing ``with base(...)``; a clear error outside one."""
    if _GLOBAL_ACCESSOR is None:
        raise InputError(
            "blocks build on a model: call them inside 'with onnxblock.base(model):' or "
            "'with onnxblock.empty_base():'"
        )
    return _GLOBAL_ACCESSOR


@contextlib.contextmanager
def base(model: onnx.ModelProto, model_path: str | None = None) -> Iterator[ModelAccessor]:
    """Build blocks on ``model`` (edited in place, as onnxruntime-training does)."""
    global _GLOBAL_ACCESSOR
    if not isinstance(model, onnx.ModelProto):
        raise InputError(f"onnxblock.base takes an onnx.ModelProto, got {type(model).__name__}")
    previous, _GLOBAL_ACCESSOR = _GLOBAL_ACCESSOR, ModelAccessor(model, model_path)
    try:
        yield _GLOBAL_ACCESSOR
    finally:
        _GLOBAL_ACCESSOR = previous


@contextlib.contextmanager
def empty_base(opset_version: int | None = None) -> Iterator[ModelAccessor]:
    """Build blocks on an empty model (opset ``opset_version``; by default onnx's current one, as
    1.19.2, but at most what the installed onnxruntime loads:
    :func:`~onnxgrad.runtime.runner.newest_opset`)."""
    opset = opset_version or newest_opset()
    model = helper.make_model(
        helper.make_graph([], "empty", [], []),
        opset_imports=[helper.make_opsetid("", opset)],
        ir_version=min(onnx.IR_VERSION, 10),
    )
    with base(model) as accessor:
        yield accessor


@contextlib.contextmanager
def custom_op_library(path: str | None) -> Iterator[None]:
    """Refused: stock onnxruntime and onnxgrad's gradients cover only standard ops."""
    raise InputError(
        "custom_op_library is not supported: onnxgrad trains plain ONNX with stock onnxruntime, and "
        "has no gradient for ops of a custom library"
    )
    yield  # pragma: no cover
