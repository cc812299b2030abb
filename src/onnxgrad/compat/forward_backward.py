"""The compat factory :class:`OrtGradientForwardBackward`: the model, the weights, the device; it
builds the graphs and sessions once and makes the class whose instances run them."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from ..autodiff.engine import GradientGraphs, check_graphs
from ..autodiff.prepare import prepare
from ..deps import C
from ..errors import InputError
from ..model.graph import FLOAT_TYPES, ValueInfo, onnx_dtype, to_array, value_info_from_proto
from ..model.load import CheckedModel, load_model
from ..pythonop import make_runner
from ..runtime.runner import options_from_state, options_state
from .devices import resolve_device
from .function import OrtGradientForwardBackwardFunction


class OrtGradientForwardBackward:
    """Forward and backward of an ONNX graph, as a class with ``forward`` and ``backward``.

    :param onnx_model: the model (``ModelProto``, path or bytes)
    :param weights_to_train: initializers to train, in any order; ``None`` selects the model's
        parameters, initializers that hold one parameter trained as one (see
        :meth:`_select_initializer_names`); named initializers are trained apart
    :param input_names: the model inputs in the order ``forward`` receives them (``None``: the
        graph's order); every input must be listed
    :param output_names: the outputs ``forward`` returns and ``backward`` takes gradients for
        (``None``: every output)
    :param class_name: name of the class created in :attr:`cls_type_`
    :param sess_options: onnxruntime ``SessionOptions`` for both sessions
    :param providers: ``None`` / ``'cpu'``, ``'cuda'``, ``'cuda:N'``, ``'gpu'``, a ``torch.device``,
        or a list of those (or of execution provider names) all designating one device
    :param provider_options: options of the execution provider (a dict, or one per input)
    :param run_options: accepted for compatibility, unused
    :param graph_builder_config: onnxruntime-training configuration, accepted and ignored
    :param device_index: CUDA device when ``providers`` does not say (``'cuda'``, ``'gpu'``)
    :param enable_logging: log the set-up (info) and every call (debug) on logger
        ``onnxgrad.compat``
    :param debug: check both graphs with the ONNX checker and the device of every input
    """

    def __init__(
        self,
        onnx_model: onnx.ModelProto | str | os.PathLike | bytes,
        weights_to_train: Sequence[str] | None = None,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        class_name: str | None = None,
        sess_options: ort.SessionOptions | None = None,
        providers: Any = None,
        provider_options: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        run_options: ort.RunOptions | None = None,
        graph_builder_config: Any = None,
        device_index: int = 0,
        enable_logging: bool = False,
        debug: bool = False,
    ) -> None:
        prepared = prepare(onnx_model, modes=False)  # the one validation; modes as the file says
        model = prepared.checked.proto
        self.onnx_model = model
        self._prepared_ = prepared  # dropped when pickled: an unpickled model is checked again
        self.weights_to_train = self._weights(prepared.checked, weights_to_train)
        _ignore_builder_config(graph_builder_config)
        inits = {i.name for i in model.graph.initializer}
        graph_inputs = [i.name for i in model.graph.input if i.name not in inits]
        self.input_names = _ordered("input_names", input_names, graph_inputs, exact=True)
        self.output_names = _ordered(
            "output_names", output_names, [o.name for o in model.graph.output], exact=False
        )
        self.class_name = class_name or f"OrtGradientForwardBackwardFunction_{id(self)}"
        self.sess_options = sess_options
        self.providers = providers
        self.provider_options = provider_options
        self.run_options = run_options
        self.graph_builder_config = None
        self.device_index = device_index
        self.enable_logging = enable_logging
        self.debug = debug
        self._init_next()

    @classmethod
    def _weights(cls, checked: CheckedModel, weights_to_train: Sequence[str] | str | None) -> list[str]:
        """``weights_to_train`` checked (``None``: :meth:`_select_initializer_names`)."""
        if weights_to_train is None:
            weights_to_train = cls._select_initializer_names(checked)
        if isinstance(weights_to_train, str):
            weights_to_train = [weights_to_train]
        weights = list(weights_to_train)
        if not weights:
            raise InputError("weights_to_train is empty: there is nothing to train")
        if len(set(weights)) != len(weights):
            raise InputError(f"weights_to_train lists a name twice: {weights}")
        return weights

    @staticmethod
    def _select_initializer_names(onnx_model: CheckedModel | onnx.ModelProto) -> list[str]:
        """The original's default: every FLOAT16/FLOAT/DOUBLE/BFLOAT16 initializer, in graph order
        (onnxgrad's own front ends choose by use instead, see
        :func:`onnxgrad.autodiff.params.select_parameters`). Integer initializers (shapes, axes)
        are never trained. Raises :class:`InputError` when there is none.
        """
        model = load_model(onnx_model)
        names = [i.name for i in model.graph.initializer if i.data_type in FLOAT_TYPES]
        if names:
            return names
        hint = ""
        if any(n.domain == "ai.onnx.ml" for n in model.graph.node):
            # skl2onnx stores LinearRegressor / LinearClassifier coefficients as node attributes
            hint = (
                " Weights stored as attributes of ai.onnx.ml nodes cannot be trained: convert "
                "with skl2onnx's black_op={'LinearRegressor'} (or 'LinearClassifier') to get "
                "them as initializers."
            )
        raise InputError(
            "unable to guess the weights to train: the model has no floating-point initializer "
            f"(initializers: {[i.name for i in model.graph.initializer]}).{hint}"
        )

    @staticmethod
    def _provider_name_to_device_type(provider_name: str | tuple[str, Any]) -> int:
        """The onnxruntime device type of a provider: ``OrtDevice.cpu()`` or ``.cuda()``."""
        name = provider_name[0] if isinstance(provider_name, tuple) else provider_name
        if name == "CPUExecutionProvider":
            return C.OrtDevice.cpu()
        if name == "CUDAExecutionProvider":
            return C.OrtDevice.cuda()
        raise InputError(f"unexpected provider name {provider_name!r}")

    @staticmethod
    def _repr_helper_(obj: Any, indent: int = 0) -> str:
        """Public attributes of ``obj`` as ``Class(a=..., b=...)``, for logging messages."""
        if obj is None:
            return "None"
        rows = []
        for name in sorted(dir(obj)):
            if name.startswith("_"):
                continue
            try:
                value = getattr(obj, name)
            except Exception:  # a property may fail on an unset object
                continue
            if not callable(value):
                rows.append(f"{name}={value!r}")
        if indent == 0:
            return f"{type(obj).__name__}({', '.join(rows)})"
        sep = "\n" + " " * indent
        return f"{type(obj).__name__}({sep}{sep.join(rows)})"

    # ---- building ------------------------------------------------------------------------------
    def _init_next(self) -> None:
        """Resolve the device, build both graphs and sessions, create :attr:`cls_type_`."""
        self._logger = logging.getLogger("onnxgrad.compat") if self.enable_logging else None
        self.ort_providers_, self.device_ = resolve_device(
            self.providers, self.provider_options, self.device_index
        )
        attributes = self._create_onnx_graphs()
        attributes["__doc__"] = "Inherits from OrtGradientForwardBackwardFunction."
        attributes["__module__"] = OrtGradientForwardBackwardFunction.__module__
        self.cls_type_ = type(self.class_name, (OrtGradientForwardBackwardFunction,), attributes)

    def _create_onnx_graphs(self) -> dict[str, Any]:
        """Build the forward and gradient graphs and the attributes of the new class.

        * ``_optimized_pre_grad_model``: forward graph (weights as inputs, it also returns what the
          backward needs), ``_trained_onnx``: gradient graph, ``_graphs``: both, with their names;
        * ``_runner``: the onnxruntime sessions, ``_sess_eval``: the forward session;
        * ``_input_names``, ``_weights_to_train``, ``_grad_input_names`` (inputs then weights, the
          order of ``forward``), ``_output_names``, ``_bw_fetches_names`` (the gradient of each
          forward input, ``None`` for non-float inputs), ``_onx_inp`` / ``_onx_out``: the values
          the gradient graph differentiates and their gradients, pairwise, in onnxcustom's order
          (the forward's inputs, then the weights: ``_onx_out[i]`` is the gradient of
          ``_onx_inp[i]``, the two lists of one length, as onnxcustom checks); the gradient
          graph's own inputs are ``_trained_onnx.graph.input`` (saved values, output gradients);
        * ``_devices`` (one per forward input), ``_bw_outputs_device_info`` (one per output
          gradient), ``_logger``, ``_debug``, ``_run_options``.
        """
        self._log_setup()
        graphs = self._gradient_graphs()
        runner = make_runner(graphs, self.ort_providers_, self.sess_options)
        grad_input_names = [*self.input_names, *self.weights_to_train]
        differentiated = [n for n in grad_input_names if graphs.grad_outputs.get(n) is not None]
        device = ort.OrtDevice.make(*self.device_)
        if self._logger is not None:
            self._logger.info("[OrtGradientForwardBackward] instantiate dynamic class %r", self.class_name)
        return {
            "_graphs": graphs,
            "_runner": runner,
            "_sess_eval": runner.fwd,
            "_optimized_pre_grad_model": graphs.forward,
            "_trained_onnx": graphs.backward,
            "_input_names": list(self.input_names),
            "_weights_to_train": list(self.weights_to_train),
            "_grad_input_names": grad_input_names,
            "_output_names": list(self.output_names),
            "_bw_fetches_names": [graphs.grad_outputs.get(n) for n in grad_input_names],
            "_onx_inp": differentiated,
            "_onx_out": [graphs.grad_outputs[n] for n in differentiated],
            "_input_specs": self._input_specs(runner),
            "_output_specs": self._output_specs(),
            "_devices": [device] * len(grad_input_names),
            "_bw_outputs_device_info": [device] * len(self.output_names),
            "_logger": self._logger,
            "_debug": self.debug,
            "_run_options": self.run_options,
        }

    def _log_setup(self) -> None:
        """Log the names and providers (info) when logging is enabled."""
        log = self._logger
        if log is None:
            return
        log.info("[OrtGradientForwardBackward] input_names=%r", self.input_names)
        log.info("[OrtGradientForwardBackward] output_names=%r", self.output_names)
        log.info("[OrtGradientForwardBackward] weights_to_train=%r", self.weights_to_train)
        log.info("[OrtGradientForwardBackward] providers=%r", self.ort_providers_)

    def _types(self) -> dict[str, ValueInfo | None]:
        """Declared types of the model's inputs and outputs, by name."""
        graph = self.onnx_model.graph
        return {vi.name: value_info_from_proto(vi) for vi in [*graph.input, *graph.output]}

    def _gradient_graphs(self) -> GradientGraphs:
        """The gradients of the float outputs with respect to the weights and the float inputs; the
        listed weights trained each on its own, as the original did."""
        types = self._types()

        def floats(names: Sequence[str]) -> list[str]:
            return [n for n in names if (info := types.get(n)) is not None and info.is_float]

        prepared = getattr(self, "_prepared_", None)
        if prepared is None or prepared.checked.proto is not self.onnx_model:
            prepared = prepare(self.onnx_model, modes=False)  # unpickled: checked again
        graphs = prepared.gradient_graphs(
            trainable=self.weights_to_train,
            inputs_requiring_grad=floats(self.input_names),
            outputs=floats(self.output_names),
            tie_weights=False,
        )
        if self.debug:
            check_graphs(graphs)
        return graphs

    def _input_specs(self, runner: Any) -> list[ValueInfo | None]:
        """The expected type of each value ``forward`` takes: the inputs, then the weights."""
        specs: list[ValueInfo | None] = [runner.inputs.get(n) for n in self.input_names]
        for w in self.weights_to_train:
            value = runner.initial_values[w]
            specs.append(ValueInfo(w, onnx_dtype(value.dtype), value.shape))
        return specs

    def _output_specs(self) -> list[ValueInfo]:
        """The type of each output; one without a declared type is taken as float (onnxruntime
        checks its gradient)."""
        types = self._types()
        return [types.get(o) or ValueInfo(o, TensorProto.FLOAT, None) for o in self.output_names]

    # ---- public API ----------------------------------------------------------------------------
    def new_instance(self) -> OrtGradientForwardBackwardFunction:
        """A new instance of :attr:`cls_type_`: it implements ``forward`` and ``backward``."""
        return self.cls_type_()

    def get_initializer(self, name: str, exc: bool = True) -> np.ndarray | None:
        """Initializer ``name`` as a numpy array (``None`` when missing and not ``exc``)."""
        for init in self.onnx_model.graph.initializer:
            if init.name == name:
                return np.array(to_array(init), copy=True)
        if exc:
            names = [i.name for i in self.onnx_model.graph.initializer]
            raise InputError(f"no initializer named {name!r} (initializers: {names})")
        return None

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the onnxruntime objects (sessions, options) and the dynamic class."""
        state = {
            k: v
            for k, v in self.__dict__.items()
            if not k.endswith("_") and k not in ("_logger", "run_options", "sess_options")
        }
        state["run_options"] = None
        options = self.sess_options
        state["sess_options"] = None if options is None else options_state(options)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the attributes, then rebuild graphs, sessions and :attr:`cls_type_`."""
        state = dict(state)
        options = state.get("sess_options")
        state["sess_options"] = None if options is None else options_from_state(options)
        self.__dict__.update(state)
        self._init_next()

    def __repr__(self) -> str:
        kind, index = getattr(self, "device_", ("?", 0))  # unset when __init__ failed
        device = kind if kind != "cuda" else f"cuda:{index}"
        return (
            f"{type(self).__name__}(class_name={self.class_name!r}, "
            f"input_names={self.input_names!r}, weights_to_train={self.weights_to_train!r}, "
            f"output_names={self.output_names!r}, device={device!r})"
        )


def _ordered(what: str, given: Sequence[str] | None, names: list[str], exact: bool) -> list[str]:
    """``given`` checked against the model's ``names`` (all of them when ``exact``)."""
    if given is None:
        return list(names)
    chosen = [given] if isinstance(given, str) else list(given)
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise InputError(f"{what}: {unknown} not in the model (it has {names})")
    if len(set(chosen)) != len(chosen):
        raise InputError(f"{what} lists a name twice: {chosen}")
    if exact and set(chosen) != set(names):
        raise InputError(f"{what} must list every input of the model: {names}, got {chosen}")
    if not chosen:
        raise InputError(f"{what} is empty")
    return chosen


def _ignore_builder_config(config: Any) -> None:
    """Warn that ``graph_builder_config`` (onnxruntime-training's) has no effect here."""
    if config is not None:
        warnings.warn(
            "graph_builder_config configures onnxruntime-training, which onnxgrad does not "
            "use: it is ignored",
            UserWarning,
            stacklevel=3,
        )
