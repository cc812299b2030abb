"""Running forward and backward graphs on stock onnxruntime.

What the forward hands to the backward never leaves onnxruntime: the forward's outputs are bound
with IO binding and come back as ``OrtValue``s, which the backward binds as inputs directly. Inputs
and parameters are wrapped around the caller's numpy buffers without copies, and outputs are
returned as numpy views of onnxruntime's buffers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..autodiff.engine import GradientGraphs
from ..autodiff.params import untie
from ..autodiff.prepare import ModelLike, PreparedModel, prepare
from ..autodiff.trainable import record_trainable
from ..errors import InputError, OnnxGradRuntimeError
from ..model.graph import ValueInfo, inputs_read_only_in_branches, np_dtype, to_array
from ..model.load import CheckedModel
from .providers import resolve_providers
from .runner import BaseRunner, make_runner
from .values import check_dims_agree, coerce, contiguous, from_numpy, to_numpy

Feeds = Mapping[str, Any]


class ForwardResult:
    """The outputs of one forward pass, and the means to run its backward exactly once."""

    def __init__(
        self,
        owner: ForwardBackward,
        outputs: list[np.ndarray],
        saved: dict[str, ort.OrtValue] | None,
    ) -> None:
        self.outputs = outputs
        self._owner = owner
        self._saved = saved
        self._training = saved is not None
        self._lock = threading.Lock()

    def backward(
        self, grad_outputs: Mapping[str, Any] | Sequence[Any] | None = None
    ) -> dict[str, np.ndarray]:
        """Gradients (name -> array) of every trainable value and input that requires grad.

        ``grad_outputs``: ``None`` for ones on every output that takes a gradient, a mapping
        output name -> array (missing outputs count as zero) or a sequence aligned with outputs.
        """
        if not self._training:
            raise OnnxGradRuntimeError(
                "this forward ran with training=False, which keeps nothing for a backward; "
                "run forward(feeds, training=True)"
            )
        feeds = self._owner._grad_feeds(grad_outputs, self.outputs)  # validate before consuming
        with self._lock:
            saved, self._saved = self._saved, None
        if saved is None:
            raise OnnxGradRuntimeError("backward already ran for this forward result; run forward again")
        return self._owner._backward(saved, feeds)


# the products of a quantized model (for the hint when it has nothing float to train)
_QUANTIZED_OPS = frozenset(
    {"DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "MatMulNBits", "QGemm"}
)


class ForwardBackward:
    """Forward and backward of an ONNX model on onnxruntime, numpy in and numpy out.

    ``model_or_graphs``: a model (proto, path or bytes, a :class:`PreparedModel`) or the
    :class:`GradientGraphs` of one.
    ``trainable`` / ``frozen`` / ``tie_weights``: the parameters, chosen as every front end chooses
    them (``build_gradient``, :func:`onnxgrad.autodiff.params.select_parameters`): ``None`` the
    model's parameters, less the ``frozen`` names (any copy of a tied parameter freezes it).
    Several forwards may be alive at once, and forwards/backwards may run from several threads.
    ``recompute``: activations rebuilt in the backward instead of kept (see ``build_gradient``).
    ``quantized``: the gradient through quantization ops, ``"ste"``, ``"zero"`` or ``"refuse"`` (see
    ``build_gradient``).
    """

    def __init__(
        self,
        model_or_graphs: GradientGraphs | PreparedModel | ModelLike,
        *,
        trainable: Iterable[str] | None = None,
        inputs_requiring_grad: Iterable[str] = (),
        outputs: Iterable[str] | None = None,
        providers: str | Sequence[Any] | None = None,
        session_options: ort.SessionOptions | None = None,
        tie_weights: bool = True,
        recompute: Any = None,
        quantized: str = "ste",
        frozen: Iterable[str] = (),
    ) -> None:
        # Dropout / BatchNormalization follow `training`: the model's training and inference variants
        self._prepared: PreparedModel | None = None
        if isinstance(model_or_graphs, GradientGraphs):
            if trainable is not None or frozen:
                raise InputError(
                    "trainable= and frozen= need a model: GradientGraphs have their parameters chosen"
                )
            graphs = model_or_graphs
            user_outputs = list(graphs.outputs)
        else:
            prepared = prepare(model_or_graphs)  # the one validation of this model
            user_outputs = prepared.output_names
            # running statistics are buffers, left out of the default set by how they are used
            graphs = prepared.gradient_graphs(
                trainable=trainable,
                frozen=frozen,
                inputs_requiring_grad=inputs_requiring_grad,
                outputs=outputs,
                tie_weights=tie_weights,
                recompute=recompute,
                quantized=quantized,
            )
            if prepared.follows_training:
                self._prepared = prepared
        self._running_stats = self._prepared.running_stats if self._prepared is not None else {}
        if not graphs.wrt:
            ops = {n.op_type for n in graphs.forward.graph.node}
            quantized = any(op in _QUANTIZED_OPS or op.startswith("QLinear") for op in ops)
            hint = (
                " (a quantized model's weights are integers: name the float ones to train with "
                "trainable=[...], its scales or biases, or add float adapters beside the quantized "
                "weights with onnxgrad.lora.add_adapters)"
                if quantized
                else ""
            )
            raise InputError(
                "nothing to differentiate: the model has no floating-point initializer to train and "
                f"no input was named in inputs_requiring_grad{hint}"
            )
        self.graphs = graphs
        self.output_names = user_outputs
        self.providers = resolve_providers(providers)
        self._options = session_options
        self._runner = make_runner(graphs, self.providers, session_options)
        self._eval_runner: BaseRunner | None = None  # inference-mode graphs, made on first use
        self._inputs = {k: v for k, v in self._runner.inputs.items() if k not in self._stat_names()}
        # the declarations whose symbolic dimensions the given arrays must agree on
        branch_only = inputs_read_only_in_branches(graphs.forward.graph)
        self._agreeing = {k: v for k, v in self._inputs.items() if k not in branch_only}
        self._params: dict[str, np.ndarray] = self._runner.initial_values
        self._param_values = {k: from_numpy(v) for k, v in self._params.items()}
        inits = {i.name: i for i in graphs.forward.graph.initializer}
        self._buffers = {k: np.array(to_array(inits[k]), copy=True) for k in self._stat_names()}
        self._buffer_values = {k: from_numpy(v) for k, v in self._buffers.items()}

    def __repr__(self) -> str:
        n_values = sum(p.size for p in self._params.values())
        inputs = ", ".join(
            f"{k}: {_fmt_shape(v.shape) if v.shape is not None else '?'}" for k, v in self._inputs.items()
        )
        return (
            f"ForwardBackward(inputs=({inputs}), outputs={self.output_names}, parameters={len(self._params)} "
            f"tensors ({n_values:,} values), inputs_requiring_grad={self.graphs.inputs_requiring_grad})"
        )

    def _stat_names(self) -> list[str]:
        return list(self._running_stats)

    def _runner_for(self, training: bool) -> BaseRunner:
        if training or self._prepared is None:
            return self._runner
        if self._eval_runner is None:
            graphs = self._prepared.eval_graphs(self.graphs)
            self._eval_runner = make_runner(graphs, self.providers, self._options)
        return self._eval_runner

    @property
    def follows_training(self) -> bool:
        """Whether Dropout and BatchNormalization follow ``forward(training=...)`` (the model has
        a training and an inference variant)."""
        return self._prepared is not None

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        """Running statistics of BatchNormalization (live buffers, updated by training forwards)."""
        return dict(self._buffers)

    # ---- parameters --------------------------------------------------------------------------
    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """Trainable values by name. These are the live buffers: updating them in place is seen by
        the next forward without any copy (this is how the optimizers work)."""
        return dict(self._params)

    @property
    def input_names(self) -> list[str]:
        return list(self._inputs)

    def set_parameters(self, mapping: Mapping[str, Any]) -> None:
        """Replace parameter values (same shapes and dtypes as before)."""
        for name, value in mapping.items():
            if name not in self._params:
                raise InputError(f"{name!r} is not a trainable parameter (have {list(self._params)})")
            old = self._params[name]
            arr = np.asarray(value)
            if arr.shape != old.shape:
                raise InputError(f"parameter {name!r} has shape {old.shape}, got {arr.shape}")
            arr = contiguous(arr, old.dtype)
            if arr is value:  # never alias a caller's array we do not own
                arr = arr.copy()
            self._params[name] = arr
            self._param_values[name] = from_numpy(arr)

    def to_onnx(self) -> onnx.ModelProto:
        """The inference model (user outputs only, Dropout and BatchNormalization in inference
        mode) carrying the current parameter and running-statistics values."""
        graphs = self._runner_for(False).graphs
        model = untie(inference_model(graphs, {**self._params, **self._buffers}), graphs.ties)
        if self._prepared is not None:  # running statistics back to plain initializers
            inputs = [i for i in model.graph.input if i.name not in self._buffers]
            del model.graph.input[:]
            model.graph.input.extend(inputs)
        outputs = [o for o in model.graph.output if o.name in self.output_names]
        del model.graph.output[:]
        model.graph.output.extend(outputs)
        # a model that names its trainable set (LoRA adapters) names what trained: the adapters and
        # the weights given to trainable= beside them, which lora.save_adapters then keeps
        return record_trainable(model, self._params)

    # ---- running -----------------------------------------------------------------------------
    def forward(self, feeds: Feeds, *, training: bool = True) -> ForwardResult:
        """Run the forward graph. With ``training`` the result keeps what its backward needs."""
        bound = self._check_feeds(feeds)
        values = {name: from_numpy(arr) for name, arr in bound.items()}
        values.update(self._param_values)
        values.update(self._buffer_values)
        runner = self._runner_for(training)
        outs, saved = runner.forward(values, training)
        by_name = dict(zip(runner.graphs.outputs, outs))
        if training and self._running_stats:  # keep the running statistics running
            for stat, out in self._running_stats.items():
                np.copyto(self._buffers[stat], to_numpy(by_name[out]))
        if saved is None:
            return ForwardResult(self, [to_numpy(by_name[o]) for o in self.output_names], None)
        # OrtValues do not own numpy buffers: keep the fed arrays and the parameter arrays of
        # this step alive until the backward (set_parameters may replace them meanwhile)
        saved["__inputs__"] = (bound, dict(self._params))  # type: ignore[assignment]
        # an output's array shares its OrtValue's buffer: where the backward saved that value too,
        # the caller gets a copy, so that changing the array in place cannot change the gradient
        outputs = [to_numpy(by_name[o]) for o in self.output_names]
        outputs = [a.copy() if o in saved else a for o, a in zip(self.output_names, outputs)]
        return ForwardResult(self, outputs, saved)

    def _backward(self, saved: dict[str, Any], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = {out: from_numpy(arr) for out, arr in grads.items()}
        return {w: to_numpy(ov) for w, ov in zip(self._runner.wrt, self._runner.backward(saved, values))}

    # ---- validation --------------------------------------------------------------------------
    def _check_feeds(self, feeds: Feeds) -> dict[str, np.ndarray]:
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a mapping input name -> array, got {type(feeds).__name__}")
        unknown = [k for k in feeds if k not in self._inputs]
        if unknown:
            raise InputError(f"unknown input name(s) {unknown}; the model's inputs are {list(self._inputs)}")
        missing = [k for k in self._inputs if k not in feeds]
        if missing:
            raise InputError(f"missing input(s) {missing}; the model's inputs are {list(self._inputs)}")
        arrays = {name: check_array(name, feeds[name], self._inputs[name]) for name in self._inputs}
        check_dims_agree({k: a.shape for k, a in arrays.items()}, self._agreeing)
        return arrays

    def _grad_feeds(self, grad_outputs: Any, outputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        by_name = dict(zip(self.output_names, outputs))
        if grad_outputs is None:
            given: dict[str, Any] = {o: None for o in self.graphs.grad_inputs}
        elif isinstance(grad_outputs, Mapping):
            unknown = [k for k in grad_outputs if k not in self.graphs.grad_inputs]
            if unknown:
                raise InputError(
                    f"no gradient can be given for {unknown}; outputs that take one: "
                    f"{list(self.graphs.grad_inputs)}"
                )
            given = dict(grad_outputs)
        else:
            seq = list(grad_outputs)
            if len(seq) != len(self.output_names):
                raise InputError(
                    f"expected {len(self.output_names)} output gradients (one per output), got {len(seq)}"
                )
            given = {o: g for o, g in zip(self.output_names, seq) if o in self.graphs.grad_inputs}
        feeds = {}
        for out in self.graphs.grad_inputs:
            ref = by_name[out]
            if grad_outputs is None:
                feeds[out] = np.ones_like(ref)
            elif given.get(out) is None:
                feeds[out] = np.zeros_like(ref)
            else:
                arr = np.asarray(given[out])
                if not isinstance(given[out], np.ndarray):
                    arr = arr.astype(ref.dtype)
                if arr.dtype != ref.dtype:
                    raise InputError(
                        f"gradient of output {out!r} has dtype {arr.dtype}, expected {ref.dtype}"
                    )
                if arr.shape != ref.shape:
                    raise InputError(
                        f"gradient of output {out!r} has shape {arr.shape}, the output has {ref.shape}"
                    )
                feeds[out] = contiguous(arr)
        return feeds


def check_array(name: str, value: Any, info: ValueInfo) -> np.ndarray:
    """``value`` as a contiguous array of ``info``'s dtype (cast under the input contract,
    :func:`onnxgrad.runtime.values.coerce`) and shape, or :class:`InputError`."""
    arr = coerce(f"input {name!r}", value, np_dtype(info.dtype))
    if info.shape is not None:
        if arr.ndim != len(info.shape):
            raise InputError(
                f"input {name!r} has rank {arr.ndim} (shape {arr.shape}), the model expects rank "
                f"{len(info.shape)} (shape {_fmt_shape(info.shape)})"
            )
        for i, (d, want) in enumerate(zip(arr.shape, info.shape)):
            if isinstance(want, int) and d != want:
                raise InputError(
                    f"input {name!r} has shape {arr.shape}, the model expects "
                    f"{_fmt_shape(info.shape)} (dimension {i} must be {want})"
                )
    return contiguous(arr)


def _fmt_shape(shape: tuple) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def inference_model(graphs: GradientGraphs, params: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The forward graph reduced to the user outputs, with ``params`` as its initializers."""
    model = onnx.ModelProto()
    model.CopyFrom(graphs.forward)
    g = model.graph
    outputs = [o for o in g.output if o.name in set(graphs.outputs)]
    del g.output[:]
    g.output.extend(outputs)
    trainable = set(graphs.trainable)
    inputs = [i for i in g.input if i.name not in trainable]
    del g.input[:]
    g.input.extend(inputs)
    inits = []
    for init in g.initializer:
        if init.name in params:
            inits.append(numpy_helper.from_array(np.asarray(params[init.name]), init.name))
        else:
            inits.append(init)
    del g.initializer[:]
    g.initializer.extend(inits)
    # drop what only the backward needed: extra nodes and extra outputs of kept nodes
    needed = {o.name for o in g.output}
    keep = []
    for node in reversed(list(g.node)):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    keep.reverse()
    del g.node[:]
    g.node.extend(keep)
    model.producer_name = "onnxgrad"
    return model


def gradients(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes,
    feeds: Feeds,
    grad_outputs: Mapping[str, Any] | None = None,
    *,
    wrt: Iterable[str] | None = None,
    providers: str | Sequence[Any] | None = None,
    quantized: str = "ste",
) -> dict[str, np.ndarray]:
    """Gradients of the model's outputs at ``feeds``, in one call.

    ``grad_outputs``: output name -> array (``None``: ones for every floating-point output).
    ``wrt``: initializer and/or input names (``None``: the default trainable set, tied weights
    as one; named initializers each get their own gradient). ``quantized``: the gradient through
    quantization ops (see ``build_gradient``).
    """
    prepared = prepare(model, modes=False)  # the one validation of this model
    proto = prepared.checked.proto
    inits = {i.name for i in proto.graph.initializer}
    inputs = [i.name for i in proto.graph.input if i.name not in inits]
    if wrt is None:
        trainable, req = None, []
    else:
        wrt = [wrt] if isinstance(wrt, str) else list(wrt)
        bad = [w for w in wrt if w not in inits and w not in inputs]
        if bad:
            raise InputError(f"{bad} are neither initializers nor inputs of the model")
        trainable = [w for w in wrt if w in inits]
        req = [w for w in wrt if w in inputs]
    outputs = None if grad_outputs is None else list(grad_outputs)
    graphs = prepared.gradient_graphs(
        trainable=trainable,
        inputs_requiring_grad=req,
        outputs=outputs,
        tie_weights=wrt is None,
        quantized=quantized,
    )
    fb = ForwardBackward(graphs, providers=providers)
    result = fb.forward(feeds, training=True)
    grads = result.backward(grad_outputs)
    return {w: grads[w] for w in (wrt if wrt is not None else graphs.wrt)}


__all__ = ["ForwardBackward", "ForwardResult", "gradients", "inference_model", "resolve_providers"]
