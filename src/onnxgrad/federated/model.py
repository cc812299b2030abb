"""What the server and the nodes of a federated run agree on: the trainable parameters of the model.

A model is an ONNX model (proto, path or bytes) or an artifacts folder written by
:func:`onnxgrad.artifacts.generate`. Its trainable parameters, chosen as every front end chooses them
(:meth:`onnxgrad.autodiff.prepare.PreparedModel.select` for a model, the manifest for a folder), are
the arrays that travel; the frozen ones stay where they are. :class:`Spec` checks what a node sends
back against them before a strategy aggregates it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ..artifacts import Runner
from ..autodiff.prepare import prepare
from ..errors import InputError
from ..train.losses import with_parameters

__all__ = ["GlobalModel", "Spec", "is_artifacts_folder"]

ModelSource = onnx.ModelProto | str | os.PathLike | bytes


def is_artifacts_folder(model: Any) -> bool:
    """Whether ``model`` names a folder written by :func:`onnxgrad.artifacts.generate`."""
    return isinstance(model, str | os.PathLike) and os.path.isdir(model)


@dataclass(frozen=True)
class Spec:
    """Name -> (shape, dtype) of the arrays that travel."""

    arrays: dict[str, tuple[tuple[int, ...], np.dtype]]

    @classmethod
    def of(cls, values: Mapping[str, np.ndarray]) -> Spec:
        return cls({n: (tuple(v.shape), np.dtype(v.dtype)) for n, v in values.items()})

    def problem(self, values: Mapping[str, np.ndarray]) -> str | None:
        """Why ``values`` cannot be aggregated into the global model, or ``None`` when they can:
        other names, another shape or dtype, a value that is not finite."""
        unknown = sorted(set(values) - set(self.arrays))
        if unknown:
            return f"unknown arrays {unknown}"
        missing = sorted(set(self.arrays) - set(values))
        if missing:
            return f"missing arrays {missing}"
        for name, (shape, dtype) in self.arrays.items():
            value = values[name]
            if tuple(value.shape) != shape:
                return f"array {name!r} has shape {list(value.shape)}, the model's is {list(shape)}"
            if value.dtype != dtype:
                return f"array {name!r} has dtype {value.dtype}, the model's is {dtype}"
            if value.dtype.kind in "fc" and not np.isfinite(value).all():
                return f"array {name!r} holds NaN or infinite values"
        return None


class GlobalModel:
    """The model the server holds: the initial trainable parameters, and the model file written
    with any values of them (``trainable`` / ``frozen`` as every front end takes them)."""

    def __init__(
        self, model: ModelSource, *, trainable: Iterable[str] | None = None, frozen: Iterable[str] = ()
    ):
        self.folder = str(model) if is_artifacts_folder(model) else None
        if self.folder is not None:
            if trainable is not None or frozen:
                raise InputError(
                    "trainable= and frozen= were chosen when the artifacts folder was generated; "
                    "do not pass them with a folder"
                )
            self._runner: Runner | None = Runner(self.folder)
            self.initial = self._runner.parameters
            self.proto: onnx.ModelProto | None = None
        else:
            self._runner = None
            selection = prepare(model).select(trainable, frozen=frozen).selection
            assert selection is not None  # select() always records its choice
            self.proto = selection.model
            inits = {t.name: t for t in self.proto.graph.initializer}
            self.initial = {n: onnx.numpy_helper.to_array(inits[n]) for n in selection.trainable}
        self.spec = Spec.of(self.initial)

    def to_onnx(self, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
        """The model (the inference model of a folder) holding ``values`` as its trainable parameters."""
        if self._runner is not None:
            self._runner.set_parameters(values)
            return self._runner.to_onnx()
        assert self.proto is not None
        return with_parameters(self.proto, values)
