"""``Optimizer``: onnxruntime-training's AdamW (Hugging Face variant) and SGD updates, run as a
plain ONNX graph (:func:`onnxgrad.compat.training.graphs.optimizer_graph`)."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import helper

from ....errors import InputError
from ....runtime.runner import make_session
from ....train.optimizers import check_lr
from .. import graphs
from .module import Module, _nominal_message

__all__ = ["Optimizer"]

_MOMENTS = ("momentum0", "momentum1")  # the checkpoint's names of AdamW's moments


def _kind(model: onnx.ModelProto) -> tuple[str, dict, float | None]:
    """(optimizer, attributes, gradient clipping norm) of an optimizer file of onnxgrad or of
    onnxruntime-training."""
    meta = graphs.read_meta(model)
    if meta is not None and "optimizer" in meta:
        return meta["optimizer"], dict(meta["attributes"]), meta.get("max_norm")
    found, max_norm = None, None
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in (graphs.ADAMW, graphs.SGD):
            found = node.op_type, attrs
        elif node.op_type == "InplaceClipGradNorm":
            max_norm = float(attrs.get("max_norm", 1.0))
    if found is None:
        ops = sorted({n.op_type for n in model.graph.node})
        raise InputError(f"no AdamWOptimizer or SGDOptimizerV2 in the optimizer model (ops: {ops})")
    return (*found, max_norm)


class Optimizer:
    """Updates the trainable parameters of ``module`` from their accumulated gradients.

    The learning rate starts at the checkpoint's initial learning rate (1e-3 for a new one); the
    step count and moments live in the module's :class:`CheckpointState` and are saved with
    ``save_checkpoint(..., include_optimizer_state=True)``. The update runs the optimizer model
    of :func:`onnxgrad.compat.training.graphs.optimizer_graph` (gradient clipping included when
    the file asks for it).
    """

    def __init__(self, optimizer_uri: str | os.PathLike, module: Module) -> None:
        if not isinstance(module, Module):
            raise InputError(f"Optimizer takes an api.Module, got {type(module).__name__}")
        path = os.fspath(optimizer_uri)
        if not os.path.isfile(path):
            raise InputError(f"no optimizer model at {path!r}")
        self._kind, self._attrs, max_norm = _kind(onnx.load(path))
        self._module = module
        state = module._state
        self._group = state._group()
        self._lr = float(self._group.initial_lr)
        values = state._values()
        self._params = [p for p in module._graph.parameters if p in module._graph.grads]
        specs = {
            p: (helper.np_dtype_to_tensor_dtype(values[p].dtype), list(values[p].shape)) for p in self._params
        }
        model = graphs.optimizer_graph(self._kind, self._attrs, specs, max_norm)
        # nothing to train: steps only count
        self._session = (
            make_session(model, module._providers, module._options, label="optimizer model")
            if self._params
            else None
        )
        self._outputs = [o.name for o in model.graph.output]

    def step(self) -> None:
        """Update every trainable parameter (and the moments) from its accumulated gradient."""
        state, group = self._module._state, self._group
        state._check_loaded(_nominal_message("Cannot fetch named parameters from a nominal checkpoint state"))
        values = state._values()
        feeds = {
            graphs.LEARNING_RATE: np.array(self._lr, np.float32),
            graphs.STEP: np.array(group.step, np.int64),  # the updates already made
        }
        for p in self._params:
            feeds[p] = values[p]
            feeds[f"{p}/grad"] = state._grads.get(p, np.zeros_like(values[p]))
            if self._kind == graphs.ADAMW:
                moments = group.states.setdefault(p, {})
                for m in _MOMENTS:
                    feeds[f"{p}/{m}"] = moments.setdefault(m, np.zeros_like(values[p]))
        runs = self._session.run(self._outputs, feeds) if self._session is not None else []
        results = dict(zip(self._outputs, runs))
        for p in self._params:
            state._set(p, results[f"new/{p}"])
            if self._kind == graphs.ADAMW:
                for m in _MOMENTS:
                    group.states[p][m] = results[f"new/{p}/{m}"]
        group.step += 1

    def set_learning_rate(self, learning_rate: float) -> None:
        """The learning rate of the next steps."""
        self._lr = check_lr(learning_rate)

    def get_learning_rate(self) -> float:
        """The current learning rate (as the float32 the update uses)."""
        return float(np.float32(self._lr))
