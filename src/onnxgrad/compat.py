"""``onnxcustom.training.ortgradient`` rebuilt on onnxgrad: the same classes, on stock onnxruntime.

onnxcustom's :class:`OrtGradientForwardBackward` relied on onnxruntime-training's private graph
builder, which no published onnxruntime ships any more. This module keeps its interface and runs it
on onnxgrad's engine (:func:`~onnxgrad.autodiff.engine.build_gradient`) and runtime
(:class:`~onnxgrad.runtime.runner.Runner`)::

    from onnxgrad.compat import OrtGradientForwardBackward

    fb = OrtGradientForwardBackward(onx, weights_to_train=["coef", "intercept"])
    fn = fb.new_instance()
    outputs = fn.forward([X, coef, intercept], training=True)  # features, then weights
    grads = fn.backward([grad_of_output])  # gradients of X, coef, intercept

Differences with the original:

* the weights may be listed in any order (the original required them sorted alphabetically and in
  initializer order); inputs and gradients follow the order given;
* ``providers`` accepts ``'cpu'``, ``'cuda'``, ``'cuda:N'``, ``'gpu'`` and a ``torch.device``; CUDA
  is checked for availability and anything else is a :class:`ValueError`;
* ``graph_builder_config`` (an onnxruntime-training object) and ``run_options`` are accepted and
  ignored; pickling keeps the usual ``SessionOptions`` settings but not its config entries;
* errors are onnxgrad's: :class:`~onnxgrad.errors.InputError` (a ``ValueError``) for bad
  arguments, :class:`~onnxgrad.errors.OnnxGradRuntimeError` (a ``RuntimeError``) for the protocol.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from .autodiff.engine import GradientGraphs, build_gradient, check_graphs
from .deps import C
from .errors import InputError, OnnxGradRuntimeError
from .model.graph import FLOAT_TYPES, ValueInfo, np_dtype, onnx_dtype, to_array, value_info_from_proto
from .model.load import CheckedModel, load_checked, load_model
from .pythonop import make_runner
from .runtime.runner import Runner
from .runtime.session import resolve_providers
from .runtime.values import contiguous

__all__ = ["OrtGradientForwardBackward", "OrtGradientForwardBackwardFunction", "OrtValueVector"]

Device = tuple[str, int]  # ("cpu" | "cuda", index)

# SessionOptions cannot be pickled: these settings are copied field by field instead.
_SESSION_FIELDS = (
    "enable_cpu_mem_arena",
    "enable_mem_pattern",
    "enable_mem_reuse",
    "enable_profiling",
    "execution_mode",
    "execution_order",
    "graph_optimization_level",
    "inter_op_num_threads",
    "intra_op_num_threads",
    "log_severity_level",
    "log_verbosity_level",
    "logid",
    "optimized_model_filepath",
    "profile_file_prefix",
    "use_deterministic_compute",
    "use_per_session_threads",
)


# ---- devices and providers -------------------------------------------------------------------
def _parse_device(device: Any, default_index: int = 0) -> Device:
    """``("cpu" | "cuda", index)`` for any way users name a device.

    Accepted: ``None``, strings (``'cpu'``, ``'Cpu'``, ``'cuda'``, ``'cuda:1'``, ``'gpu'``,
    ``'Gpu'``), an ``OrtDevice`` (public or ``_pybind_state``), an ``OrtValue`` (its device) and a
    ``torch.device`` (recognised by its attributes, so torch is never imported).
    """
    if device is None:
        return "cpu", 0
    if isinstance(device, str):
        low = device.strip().lower()
        if low == "cpu":
            return "cpu", 0
        if low in ("cuda", "gpu"):
            return "cuda", default_index
        head, _, index = low.partition(":")
        if head in ("cuda", "gpu") and index.isdigit():
            return "cuda", int(index)
        raise InputError(
            f"unknown device {device!r}: expected 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device"
        )
    if callable(getattr(device, "device_type", None)):  # OrtDevice
        kind = device.device_type()
        if kind == C.OrtDevice.cpu():
            return "cpu", 0
        if kind == C.OrtDevice.cuda():
            return "cuda", int(device.device_id())
        raise InputError(f"unsupported OrtDevice type {kind!r}: only CPU and CUDA are supported")
    if callable(getattr(device, "device_name", None)):  # OrtValue
        return _parse_device(device.device_name(), default_index)
    kind, index = getattr(device, "type", None), getattr(device, "index", -1)
    if isinstance(kind, str) and index != -1:  # torch.device
        if kind not in ("cpu", "cuda"):
            raise InputError(f"unsupported torch device {device!r}: only cpu and cuda work")
        return _parse_device(kind if index is None else f"{kind}:{index}", default_index)
    raise InputError(f"unknown device {device!r}: expected 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device")


def _provider_device(provider: Any, device_index: int) -> Device:
    """The device one entry of ``providers`` designates (execution provider names included)."""
    if provider == "CPUExecutionProvider":
        return "cpu", 0
    if provider == "CUDAExecutionProvider":
        return "cuda", device_index
    try:
        return _parse_device(provider, device_index)
    except InputError:
        raise InputError(
            f"unexpected providers {provider!r}: expected None, 'cpu', 'cuda', 'cuda:N', 'gpu', "
            "a torch.device, or a list of 'CPUExecutionProvider' / 'CUDAExecutionProvider'"
        ) from None


def _resolve_device(providers: Any, provider_options: Any, device_index: int) -> tuple[list[Any], Device]:
    """onnxruntime providers and the device for the ``providers`` argument of the original."""
    if isinstance(providers, list | tuple):
        # the original took one provider per input: they must all designate the same device
        devices = {_provider_device(p, device_index) for p in providers}
        if len(devices) != 1:
            raise InputError(f"providers {providers!r} must all designate one device")
        device = devices.pop()
    else:
        device = _provider_device(providers, device_index)
    if isinstance(provider_options, list | tuple):  # one dict per input in the original
        provider_options = next((o for o in provider_options if o), None)
    if provider_options and "device_id" in provider_options and device[0] == "cuda":
        device = ("cuda", int(provider_options["device_id"]))
    # resolve_providers checks that the provider is available (ValueError otherwise)
    ort_providers = resolve_providers("cpu" if device[0] == "cpu" else f"cuda:{device[1]}")
    if provider_options:
        first = ort_providers[0]
        name, base = first if isinstance(first, tuple) else (first, {})
        ort_providers[0] = (name, {**base, **dict(provider_options)})
    return ort_providers, device


def _session_state(options: ort.SessionOptions | None) -> dict[str, Any] | None:
    if options is None:
        return None
    return {f: getattr(options, f) for f in _SESSION_FIELDS if hasattr(options, f)}


def _session_from_state(state: dict[str, Any] | None) -> ort.SessionOptions | None:
    if state is None:
        return None
    options = ort.SessionOptions()
    for field, value in state.items():
        setattr(options, field, value)
    return options


def _ort_type(dtype: int) -> str:
    """The element type as onnxruntime spells it (``OrtValue.data_type()``): 'tensor(float)'."""
    return f"tensor({TensorProto.DataType.Name(dtype).lower()})"


def _check_value(kind: str, position: int, info: ValueInfo | None, value: ort.OrtValue) -> None:
    """Raise :class:`InputError` when ``value`` does not have ``info``'s type and shape."""
    if info is None:  # the model does not declare its type: onnxruntime will judge
        return
    want, got = _ort_type(info.dtype), value.data_type()
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
            self.push_back(_empty_placeholder())
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


def _empty_placeholder() -> Any:
    """A ``C.OrtValue`` of shape (0,), owned by this module (stands for ``None`` in the C++ vector)."""
    if not _PLACEHOLDER:
        arr = np.empty(0, np.float32)
        _PLACEHOLDER.extend([arr, ort.OrtValue.ortvalue_from_numpy(arr)._ortvalue])
    return _PLACEHOLDER[1]


def _fill(cache: Any, values: list[Any]) -> Any:
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
                v = _empty_placeholder()
            cache.push_back(v._ortvalue if isinstance(v, ort.OrtValue) else v)
        return cache
    raise TypeError(f"an output cache must be a list or an OrtValueVector, not {type(cache)}")


# ---- the factory -------------------------------------------------------------------------------
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
        checked = load_checked(onnx_model)  # the one validation of this model
        model = checked.proto
        self._tie_weights = False  # the original trains every listed initializer on its own
        if weights_to_train is None:
            weights_to_train = self._select_initializer_names(checked)
        if isinstance(weights_to_train, str):
            weights_to_train = [weights_to_train]
        weights = list(weights_to_train)
        if not weights:
            raise InputError("weights_to_train is empty: there is nothing to train")
        if len(set(weights)) != len(weights):
            raise InputError(f"weights_to_train lists a name twice: {weights}")
        if graph_builder_config is not None:
            warnings.warn(
                "graph_builder_config configures onnxruntime-training, which onnxgrad does not "
                "use: it is ignored",
                UserWarning,
                stacklevel=2,
            )
        inits = {i.name for i in model.graph.initializer}
        graph_inputs = [i.name for i in model.graph.input if i.name not in inits]
        self.onnx_model = model
        self._checked_ = checked  # dropped when pickled: an unpickled model is checked again
        self.weights_to_train = weights
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
        self.ort_providers_, self.device_ = _resolve_device(
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
          forward input, ``None`` for non-float inputs), ``_onx_inp`` / ``_onx_out`` (inputs and
          outputs of the gradient graph);
        * ``_devices`` (one per forward input), ``_bw_outputs_device_info`` (one per output
          gradient), ``_logger``, ``_debug``, ``_run_options``.
        """
        model = self.onnx_model
        log = self._logger
        types = {vi.name: value_info_from_proto(vi) for vi in [*model.graph.input, *model.graph.output]}

        def is_float(name: str) -> bool:
            info = types.get(name)
            return info is not None and info.is_float

        if log is not None:
            log.info("[OrtGradientForwardBackward] input_names=%r", self.input_names)
            log.info("[OrtGradientForwardBackward] output_names=%r", self.output_names)
            log.info("[OrtGradientForwardBackward] weights_to_train=%r", self.weights_to_train)
            log.info("[OrtGradientForwardBackward] providers=%r", self.ort_providers_)
        checked = getattr(self, "_checked_", None)
        graphs: GradientGraphs = build_gradient(
            checked if checked is not None and checked.proto is model else model,
            trainable=self.weights_to_train,
            inputs_requiring_grad=[n for n in self.input_names if is_float(n)],
            outputs=[n for n in self.output_names if is_float(n)],
            tie_weights=getattr(self, "_tie_weights", False),
        )
        if self.debug:
            check_graphs(graphs)
        runner = make_runner(graphs, self.ort_providers_, self.sess_options)
        specs: list[ValueInfo | None] = [runner.inputs.get(n) for n in self.input_names]
        for w in self.weights_to_train:
            value = runner.initial_values[w]
            specs.append(ValueInfo(w, onnx_dtype(value.dtype), value.shape))
        # an output without a declared type is taken as float (its gradient is checked by ort)
        out_specs = [types.get(o) or ValueInfo(o, TensorProto.FLOAT, None) for o in self.output_names]
        grad_input_names = [*self.input_names, *self.weights_to_train]
        device = ort.OrtDevice.make(*self.device_)
        if log is not None:
            log.info("[OrtGradientForwardBackward] instantiate dynamic class %r", self.class_name)
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
            "_onx_inp": [i.name for i in graphs.backward.graph.input],
            "_onx_out": [o.name for o in graphs.backward.graph.output],
            "_input_specs": specs,
            "_output_specs": out_specs,
            "_devices": [device] * len(grad_input_names),
            "_bw_outputs_device_info": [device] * len(self.output_names),
            "_logger": log,
            "_debug": self.debug,
            "_run_options": self.run_options,
        }

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
        state["sess_options"] = _session_state(self.sess_options)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the attributes, then rebuild graphs, sessions and :attr:`cls_type_`."""
        state = dict(state)
        state["sess_options"] = _session_from_state(state.get("sess_options"))
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


# ---- what new_instance returns -------------------------------------------------------------------
@dataclass
class _Pending:
    """What one training forward keeps for its backward."""

    saved: dict[str, ort.OrtValue]  # values of the forward graph the gradient graph reads
    inputs: list[Any]  # the caller's inputs (saved_tensors); keeps their buffers alive too
    shapes: list[tuple[int, ...]]  # shape of each output, to check the output gradients


class OrtGradientForwardBackwardFunction:
    """Ancestor of the classes :class:`OrtGradientForwardBackward` creates (``cls_type_``).

    The graphs and sessions are class attributes, shared by every instance; an instance keeps a
    LIFO stack of pending training forwards (``states_``), so several forwards may run before their
    backwards, which then run in reverse order.
    """

    _runner: ClassVar[Runner]
    _graphs: ClassVar[GradientGraphs]
    _optimized_pre_grad_model: ClassVar[onnx.ModelProto]
    _trained_onnx: ClassVar[onnx.ModelProto]
    _grad_input_names: ClassVar[list[str]]
    _output_names: ClassVar[list[str]]
    _input_specs: ClassVar[list[ValueInfo | None]]
    _output_specs: ClassVar[list[ValueInfo]]
    _devices: ClassVar[list[Any]]
    _bw_outputs_device_info: ClassVar[list[Any]]
    _logger: ClassVar[logging.Logger | None]
    _debug: ClassVar[bool]

    def __init__(self) -> None:
        if not hasattr(type(self), "_runner"):
            raise OnnxGradRuntimeError(
                "OrtGradientForwardBackwardFunction is abstract: create instances with "
                "OrtGradientForwardBackward(model).new_instance()"
            )
        self.states_: list[_Pending] = []
        self.saved_tensors_: list[Any] | None = None

    @staticmethod
    def device_name(device: Any) -> str:
        """``'Cpu'`` or ``'Gpu'`` for a device (OrtDevice, OrtValue, string, torch.device)."""
        return "Cpu" if _parse_device(device)[0] == "cpu" else "Gpu"

    @staticmethod
    def input_to_ort(tensors: Iterable[Any], devices: Sequence[Any] | None, debug: bool) -> OrtValueVector:
        """Convert numpy arrays / OrtValues (or an ``OrtValueVector``) into an
        :class:`OrtValueVector`, as the original did (it also behaves as a list).

        Arrays are placed on ``devices[i]`` (the last device repeats, ``None`` means CPU); CPU
        arrays are wrapped without a copy when contiguous. With ``debug``, every value must
        already be on its device.
        """
        if isinstance(tensors, OrtValueVector) and not debug:
            return tensors  # as the original: a vector is already converted
        values: list[ort.OrtValue] = []
        devices = list(devices or [None])
        for i, t in enumerate(tensors):
            device = devices[min(i, len(devices) - 1)]
            if t is None:
                raise InputError(f"value {i} is None: every input and gradient must be given")
            if isinstance(t, ort.OrtValue):
                values.append(t)
            elif isinstance(t, C.OrtValue):
                values.append(ort.OrtValue(t))
            else:
                kind, index = _parse_device(device)
                arr = contiguous(t)
                values.append(ort.OrtValue.ortvalue_from_numpy(arr, kind, index))
            if debug and _parse_device(values[-1])[0] != _parse_device(device)[0]:
                raise InputError(
                    f"value {i} is on {values[-1].device_name()!r}, expected "
                    f"{OrtGradientForwardBackwardFunction.device_name(device)!r}"
                )
        return OrtValueVector(values)

    def save_for_backward(self, inputs: Iterable[Any]) -> None:
        """Keep ``inputs`` (a shallow copy of the list) for :attr:`saved_tensors`."""
        self.saved_tensors_ = list(inputs)

    @property
    def saved_tensors(self) -> list[Any]:
        """The inputs of the latest training forward whose backward has not run yet."""
        if self.saved_tensors_ is None:
            raise OnnxGradRuntimeError(
                "no tensor was saved: run forward(..., training=True) or save_for_backward first"
            )
        return self.saved_tensors_

    def forward(
        self, inputs: Sequence[Any], training: bool = False, forward_outputs_cache: Any = None
    ) -> OrtValueVector | list[ort.OrtValue]:
        """Run the model on ``inputs``: the features (``_input_names``) then the weights
        (``_weights_to_train``), as numpy arrays or OrtValues. Returns one OrtValue per output
        (``.numpy()`` gives the array) in an :class:`OrtValueVector`, as the original did, or in
        ``forward_outputs_cache`` when one is given (a list or an ``OrtValueVector``).

        With ``training``, what the backward needs is pushed on this instance's stack.
        """
        cls = type(self)
        items = list(inputs)
        if len(items) != len(cls._grad_input_names):
            raise InputError(
                f"forward expects {len(cls._grad_input_names)} values (inputs then weights: "
                f"{cls._grad_input_names}), got {len(items)}"
            )
        values = cls.input_to_ort(items, cls._devices, cls._debug)
        for i, (info, value) in enumerate(zip(cls._input_specs, values)):
            _check_value("input", i, info, value)
        if cls._logger is not None:
            cls._logger.debug("[%s.forward] training=%r", cls.__name__, training)
        outputs, saved = cls._runner.forward(dict(zip(cls._grad_input_names, values)), training)
        by_name = dict(zip(cls._graphs.outputs, outputs))
        result = [by_name[o] for o in cls._output_names]
        if training:
            assert saved is not None
            self.states_.append(_Pending(saved, items, [tuple(v.shape()) for v in result]))
            self.save_for_backward(items)
        return _fill(forward_outputs_cache, result)

    def backward(
        self, grad_outputs: Sequence[Any], backward_outputs_cache: Any = None
    ) -> OrtValueVector | list[ort.OrtValue | None]:
        """Gradients for the latest pending training forward (LIFO), given one gradient per
        output (``None`` counts as zeros). Returns an :class:`OrtValueVector` (as the original
        did; or ``backward_outputs_cache`` filled) with one OrtValue per forward input: the
        features first, then the weights (``None`` for a non-float feature).
        """
        cls = type(self)
        if not self.states_:
            raise OnnxGradRuntimeError(
                "backward needs a pending forward(..., training=True); none is left on this "
                "instance (a forward with training=False keeps nothing)"
            )
        pending = self.states_[-1]
        grads = list(grad_outputs)
        if len(grads) != len(cls._output_names):
            raise InputError(
                f"backward expects {len(cls._output_names)} gradients (one per output "
                f"{cls._output_names}), got {len(grads)}"
            )
        for i, (g, info, shape) in enumerate(zip(grads, cls._output_specs, pending.shapes)):
            if g is None:
                grads[i] = np.zeros(shape, dtype=np_dtype(info.dtype))
        values = cls.input_to_ort(grads, cls._bw_outputs_device_info, cls._debug)
        for i, (info, shape, value) in enumerate(zip(cls._output_specs, pending.shapes, values)):
            _check_value("gradient", i, ValueInfo(info.name, info.dtype, shape), value)
        self.states_.pop()  # consumed only once the gradients are known to be valid
        if cls._logger is not None:
            cls._logger.debug("[%s.backward] %d pending left", cls.__name__, len(self.states_))
        feeds = {o: v for o, v in zip(cls._output_names, values) if o in cls._graphs.grad_inputs}
        by_name = dict(zip(cls._runner.wrt, cls._runner.backward(pending.saved, feeds)))
        self.saved_tensors_ = self.states_[-1].inputs if self.states_ else None
        return _fill(backward_outputs_cache, [by_name.get(n) for n in cls._grad_input_names])

    @classmethod
    def save_onnx_graph(
        cls, folder: Any, prefix: str | None = None, suffix: str | None = None
    ) -> dict[str, str | bytes]:
        """Save the forward graph (``_optimized_pre_grad_model``) and the gradient graph
        (``_trained_onnx``) in ``folder`` (which must exist) as
        ``{prefix}{class name}{suffix}.{attribute}.onnx``, as the original named them; returns
        ``{attribute: path}``.

        When ``folder`` is not a path (the original passed ``bytes``), nothing is written and the
        result maps each attribute to the serialized model.
        """
        if not hasattr(cls, "_trained_onnx"):
            raise OnnxGradRuntimeError("save_onnx_graph needs a class made by new_instance()")
        models = {
            "_optimized_pre_grad_model": cls._optimized_pre_grad_model,
            "_trained_onnx": cls._trained_onnx,
        }
        if not isinstance(folder, str | os.PathLike):
            return {k: m.SerializeToString() for k, m in models.items()}
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"folder {os.fspath(folder)!r} does not exist")
        base = f"{prefix or ''}{cls.__name__}{suffix or ''}"
        saved: dict[str, str | bytes] = {}
        for attr, model in models.items():
            path = os.path.join(os.fspath(folder), f"{base}.{attr}.onnx")
            if os.path.exists(path):
                warnings.warn(f"{path!r} already exists: overwritten", UserWarning, stacklevel=2)
            onnx.save(model, path)
            saved[attr] = path
        return saved
