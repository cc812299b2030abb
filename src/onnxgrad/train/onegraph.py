"""The training step of :class:`onnxgrad.train.Trainer` as one onnxruntime run.

:class:`OneGraphStep` turns the gradient graphs of a :class:`~onnxgrad.ForwardBackward` into the
step graph that :func:`onnxgrad.artifacts.generate` writes too
(:func:`onnxgrad.artifacts.step.build_train_step`: forward, loss, backward and the optimizer update
in one ONNX graph) and runs it in place of ``forward`` + ``backward`` + ``optimizer.step``. The
numpy optimizer stays the owner of everything: its ``lr`` schedule, ``iterations`` and per-parameter
state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``step``) are read before and written
after each step, and the new parameter values are copied into the live buffers of
``fb.parameters``. So checkpoints, callbacks, ``set_parameters`` and ``EarlyStopping`` see what the
two-session path would show them, and a trainer can switch between the paths at any step.

:func:`one_graph_step` returns ``None`` (and says why in a debug log) when the model or the
optimizer needs the two-session path: PythonOp or other non-standard ops, Dropout or
BatchNormalization (training-mode switches and running statistics), an optimizer
other than :class:`SGD`, :class:`Adam` and :class:`AdamW` (subclasses included), a
:class:`ForwardBackward` whose other outputs also take a gradient.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..artifacts.step import build_train_step
from ..runtime.runner import make_session
from .optim import OPTIMIZERS, Optimizer

__all__ = ["OneGraphStep", "one_graph_step"]

log = logging.getLogger(__name__)


def _hyper(opt: Optimizer) -> tuple[str, dict[str, Any]] | None:
    """(name, hyperparameters) of a registry optimizer (SGD, Adam, AdamW), None for any other."""
    if type(opt) not in OPTIMIZERS.values():
        return None
    return opt.definition.name, dict(opt.hyperparameters)


def one_graph_step(fb: Any, optimizer: Optimizer, loss_name: str) -> OneGraphStep | None:
    """A :class:`OneGraphStep` for ``fb`` and ``optimizer``, or ``None`` (logged at debug level)
    when the two-session path must run instead."""
    why = _unsupported(fb, optimizer, loss_name)
    if why is None:
        try:
            step = OneGraphStep(fb, optimizer, loss_name)
            log.debug(
                "one-graph training step used: %s on %d parameters, %d nodes",
                type(optimizer).__name__, len(step.params), len(step.model.graph.node),
            )  # fmt: skip
            return step
        except Exception as exc:  # whatever the step builder or onnxruntime refuses: fall back
            why = f"the step graph could not be built: {exc}"
    log.debug("one-graph training step not used, forward + backward + numpy optimizer instead: %s", why)
    return None


def _unsupported(fb: Any, optimizer: Optimizer, loss_name: str) -> str | None:
    if fb.follows_training:
        return "the model has Dropout or BatchNormalization (training-mode switches, running statistics)"
    graphs = fb.graphs
    if set(graphs.grad_inputs) != {loss_name}:
        return f"outputs other than the loss take a gradient ({sorted(graphs.grad_inputs)})"
    odd = sorted(
        {
            f"{n.domain}.{n.op_type}"
            for g in (graphs.forward, graphs.backward)
            for n in g.graph.node
            if n.domain not in ("", "ai.onnx")
        }
    )
    if odd:
        return f"the model needs ops outside the standard domain ({odd}, PythonOp included)"
    if _hyper(optimizer) is None:
        return f"the optimizer is {type(optimizer).__name__}, not SGD, Adam or AdamW"
    if set(optimizer.params) != set(fb.parameters):
        return "the optimizer does not hold exactly the trainable parameters"
    return None


def _shape_proto(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An initializer proto carrying only the name, type and shape (what the step builder reads)."""
    t = onnx.TensorProto()
    t.name = name
    t.data_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    t.dims.extend(array.shape)
    return t


class OneGraphStep:
    """Runs the one-graph training step for a :class:`ForwardBackward` and its numpy optimizer."""

    def __init__(self, fb: Any, optimizer: Optimizer, loss_name: str) -> None:
        name, hyper = _hyper(optimizer)  # type: ignore[misc]
        params = fb.parameters
        inits = {n: _shape_proto(n, a) for n, a in params.items()}
        step = build_train_step(fb.graphs, inits, {}, name, hyper, loss_name)
        model = step.model
        self.model, self.optimizer_name = model, name
        self.fb, self.optimizer, self.loss_name = fb, optimizer, loss_name
        self.batch_names: list[str] = list(step.batch)
        self.state_names: dict[tuple[str, str], str] = dict(step.state)  # (param, key) -> input
        self.params = list(fb.graphs.trainable)
        outputs = [o.name for o in model.graph.output]
        feedback = step.feedback  # output -> input
        by_input = {v: k for k, v in feedback.items()}
        self.output_names = [loss_name, *[by_input[p] for p in self.params]]
        self.output_names += [by_input[s] for s in self.state_names.values()]
        assert set(self.output_names) == set(outputs)
        options = getattr(fb, "_options", None)  # the policy of every session: make_session's
        self.session = make_session(model, fb.providers, options, label="the one-graph training step")
        self._lr = np.zeros((), np.float64)
        self._step = np.zeros((), np.int64)
        self._loss = np.zeros((), np.dtype(onnx.helper.tensor_dtype_to_np_dtype(_elem(model, loss_name))))
        self._zeros: dict[str, np.ndarray] = {}
        # onnxruntime writes the new parameters into scratch buffers (copied into the live ones),
        # the new optimizer state into the one of two buffers the optimizer does not hold now
        self._scratch = {p: np.empty_like(a) for p, a in params.items()}
        self._spare: dict[tuple[str, str], list[np.ndarray]] = {
            k: [np.empty_like(params[k[0]]), np.empty_like(params[k[0]])] for k in self.state_names
        }
        self._param_outputs = [by_input[p] for p in self.params]
        self._state_outputs = [by_input[s] for s in self.state_names.values()]
        # three bindings: steady phase k reads the state from spare buffers k and writes it into
        # spares 1 - k (everything but the batch stays bound); "general" binds what it is given
        self._bindings = [self._new_binding() for _ in range(3)]
        for k in (0, 1):
            b = self._bindings[k]
            for (key, name), out in zip(self.state_names.items(), self._state_outputs):
                b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(self._spare[key][k]))
                b.bind_ortvalue_output(out, ort.OrtValue.ortvalue_from_numpy(self._spare[key][1 - k]))
        self._bound_params: list[dict[str, np.ndarray]] = [{}, {}, {}]

    def _new_binding(self) -> Any:
        b = self.session.io_binding()
        b.bind_ortvalue_input("lr", ort.OrtValue.ortvalue_from_numpy(self._lr))
        b.bind_ortvalue_input("step", ort.OrtValue.ortvalue_from_numpy(self._step))
        b.bind_ortvalue_output(self.loss_name, ort.OrtValue.ortvalue_from_numpy(self._loss))
        for out, p in zip(self._param_outputs, self.params):
            b.bind_ortvalue_output(out, ort.OrtValue.ortvalue_from_numpy(self._scratch[p]))
        return b

    def _state(self, param: str, key: str, like: np.ndarray) -> np.ndarray:
        value = self.optimizer.state[param].get(key)
        if value is None:  # no update made yet: the graph starts from zeros (or the gradient)
            value = self._zeros.get(param)
            if value is None or value.shape != like.shape or value.dtype != like.dtype:
                value = self._zeros[param] = np.zeros_like(like)
        return value

    def _phase(self) -> int | None:
        """k when the optimizer holds spare buffers k as its whole state, else None."""
        state = self.optimizer.state
        for k in (0, 1):
            if all(state[p].get(key) is self._spare[(p, key)][k] for p, key in self.state_names):
                return k
        return None

    def run(self, batch: Mapping[str, np.ndarray]) -> tuple[float, bool]:
        """One update on ``batch``; returns the loss (computed before the update) and whether the
        update was applied: a non-finite loss leaves parameters and optimizer state untouched."""
        opt = self.optimizer
        lr = opt._scheduled_lr()
        self._lr[...] = lr
        self._step[...] = opt.iterations
        params = self.fb.parameters
        phase = self._phase() if self.state_names else 0
        k = 2 if phase is None else phase
        b = self._bindings[k]
        bound = self._bound_params[k]
        for p in self.params:  # parameters stay bound while the live arrays stay the same
            if bound.get(p) is not params[p]:
                b.bind_ortvalue_input(p, ort.OrtValue.ortvalue_from_numpy(params[p]))
                bound[p] = params[p]
        targets = []
        for (p, key), name, out in zip(self.state_names, self.state_names.values(), self._state_outputs):
            spare = self._spare[(p, key)]
            if phase is None:
                current = self._state(p, key, params[p])
                b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(current))
                target = spare[1] if spare[0] is current else spare[0]
                b.bind_ortvalue_output(out, ort.OrtValue.ortvalue_from_numpy(target))
            else:
                target = spare[1 - phase]
            targets.append(target)
        keep = [np.ascontiguousarray(batch[name]) for name in self.batch_names]
        for name, arr in zip(self.batch_names, keep):
            b.bind_cpu_input(name, arr)
        self.session.run_with_iobinding(b)
        loss = float(self._loss)
        if not math.isfinite(loss):
            return loss, False
        for p in self.params:
            np.copyto(params[p], self._scratch[p])
        for (p, key), target in zip(self.state_names, targets):
            opt.state[p][key] = target  # the buffer onnxruntime just wrote becomes the state
        if self.optimizer_name != "sgd":
            for p in self.params:
                opt.state[p]["step"] = opt.state[p].get("step", 0) + 1
        opt.lr = lr
        opt.iterations += 1
        return loss, True


def _elem(model: onnx.ModelProto, name: str) -> int:
    return next(o.type.tensor_type.elem_type for o in model.graph.output if o.name == name)
