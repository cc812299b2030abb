"""Sessions and runners: the one place onnxgrad makes onnxruntime sessions, and the runner base.

* :func:`make_session` makes every onnxruntime session of onnxgrad (the forward and backward of a
  :class:`Runner`, the stages of a PythonOp graph, the artifacts runner...): same options (idle pool
  threads do not spin), same errors.
* :class:`BaseRunner` builds the feeds of both graphs of a :class:`GradientGraphs` and what the
  forward hands to the backward; :class:`Runner` runs each graph as one session. Graphs that need
  another runner (those holding PythonOp nodes) get it from a factory registered with
  :func:`register_runner` by the layer that knows them (:mod:`onnxgrad.pythonop`, when imported):
  :func:`make_runner` asks the factories, newest first, and falls back to :class:`Runner`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ..autodiff.engine import GradientGraphs
from ..autodiff.recompute import runs_in_graph_order
from ..deps import require_onnxruntime
from ..errors import OnnxGradRuntimeError
from ..model.graph import ValueInfo, to_array, value_info_from_proto
from .blocked_conv import blocked_convs
from .values import C, OrtValueLike, run

__all__ = [
    "BaseRunner",
    "Runner",
    "copy_options",
    "default_options",
    "exact_nbits_options",
    "fuses_blocked_dequantize",
    "make_runner",
    "make_session",
    "nbits_accuracy_set",
    "options_from_state",
    "options_state",
    "register_runner",
    "split_forward",
]


def make_session(
    model: onnx.ModelProto | str,
    providers: list[Any],
    options: ort.SessionOptions | None = None,
    *,
    label: str | None = None,
) -> ort.InferenceSession:
    """An onnxruntime session for ``model`` (a proto, or the path of a file); failures become
    :class:`OnnxGradRuntimeError` ("onnxruntime cannot load ``label``: ...", by default the graph's
    name).

    Without ``options``, the pool threads do not spin after a run: a training step alternates a
    forward and a backward session, and the idle pool's spinning threads would take the cores of
    the one running (measured: the mlp step 8.9 ms with spinning, 4.2 ms without).

    On CPU-only sessions, Convs fed their weight run on onnxruntime's blocked (NCHWc) kernels
    (:func:`~onnxgrad.runtime.blocked_conv.blocked_convs`).
    """
    require_onnxruntime()
    if options is None:
        options = default_options()
    if isinstance(model, onnx.ModelProto):
        model = blocked_convs(model, providers)  # Convs fed their weight: onnxruntime's fast kernels
    if not isinstance(model, str) and runs_in_graph_order(model):  # recomputed activations
        options = copy_options(options)  # the caller's options stay as they are
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    source = model if isinstance(model, str) else model.SerializeToString()
    try:
        return ort.InferenceSession(source, sess_options=options, providers=providers)
    except Exception as exc:
        if label is None:
            label = f"the {model!r} file" if isinstance(model, str) else f"the {model.graph.name!r} graph"
        raise OnnxGradRuntimeError(f"onnxruntime cannot load {label}: {exc}") from exc


def default_options() -> ort.SessionOptions:
    """Session options onnxgrad uses unless given others: no spinning of idle pool threads."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


# onnxruntime fuses DequantizeLinear(blocked int4/int8) -> MatMul into MatMulNBits and, by default,
# runs it at accuracy level 4 (x quantized to int8 per block): not the float graph differentiated.
NBITS_ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"


def fuses_blocked_dequantize(model: onnx.ModelProto) -> bool:
    """Whether onnxruntime fuses a ``DequantizeLinear -> MatMul`` of ``model`` into ``MatMulNBits``
    (and then, by default, quantizes the activations): a blocked DequantizeLinear (``block_size``
    set) of an initializer, read by a MatMul or Gemm (the main graph; what
    ``MatMulNBitsQuantizer(quant_format=QDQ)`` writes)."""
    inits = {t.name for t in model.graph.initializer}
    blocked = {
        node.output[0]
        for node in model.graph.node
        if node.op_type == "DequantizeLinear"
        and node.input[0] in inits
        and any(a.name == "block_size" and a.i > 0 for a in node.attribute)
    }
    return any(
        node.op_type in ("MatMul", "Gemm") and blocked.intersection(node.input) for node in model.graph.node
    )


def nbits_accuracy_set(options: ort.SessionOptions) -> bool:
    """Whether ``options`` set the accuracy level of the fused MatMulNBits (to any level)."""
    try:
        return bool(options.get_session_config_entry(NBITS_ACCURACY_KEY))
    except RuntimeError:  # not set
        return False


def exact_nbits_options(options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """``options`` (or :func:`default_options`), changed in place so that the fused
    ``DequantizeLinear -> MatMul`` computes in float (accuracy level 1): the graph onnxgrad
    differentiates, instead of activations quantized to int8 per block."""
    options = default_options() if options is None else options
    options.add_session_config_entry(NBITS_ACCURACY_KEY, "1")
    return options


# SessionOptions can be neither copied nor pickled: these settings are carried field by field.
SESSION_FIELDS = (
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
# the config entries a copy carries (onnxruntime cannot list those set)
_CONFIG_KEYS = (
    "session.intra_op.allow_spinning",
    "session.inter_op.allow_spinning",
    "session.set_denormal_as_zero",
    "session.use_env_allocators",
    "session.disable_prepacking",
    "session.use_device_allocator_for_initializers",
    NBITS_ACCURACY_KEY,
)


def options_state(options: ort.SessionOptions) -> dict[str, Any]:
    """The settings of ``options`` named in :data:`SESSION_FIELDS`, as a plain (picklable) dict."""
    return {f: getattr(options, f) for f in SESSION_FIELDS if hasattr(options, f)}


def options_from_state(state: Mapping[str, Any]) -> ort.SessionOptions:
    """New ``SessionOptions`` with the settings of :func:`options_state`."""
    options = ort.SessionOptions()
    for name, value in state.items():
        setattr(options, name, value)
    return options


def copy_options(options: ort.SessionOptions) -> ort.SessionOptions:
    """A copy of ``options``: its :data:`SESSION_FIELDS` and the usual config entries (custom op
    libraries, initializers and free dimension overrides added to ``options`` are not carried)."""
    copy = options_from_state(options_state(options))
    for key in _CONFIG_KEYS:
        try:
            value = options.get_session_config_entry(key)
        except RuntimeError:  # not set
            continue
        copy.add_session_config_entry(key, value)
    return copy


def split_forward(
    graphs: GradientGraphs,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, ValueInfo]]:
    """The forward graph without its trainable initializers (the caller holds and feeds them),
    their initial values, and the types of the inputs the caller feeds."""
    trainable = set(graphs.trainable)
    fwd = onnx.ModelProto()
    fwd.CopyFrom(graphs.forward)
    initial = {
        i.name: np.array(to_array(i), copy=True, order="C")
        for i in fwd.graph.initializer
        if i.name in trainable
    }
    kept = [i for i in fwd.graph.initializer if i.name not in trainable]
    del fwd.graph.initializer[:]
    fwd.graph.initializer.extend(kept)
    inits = {i.name for i in kept}
    inputs = {}
    for vi in fwd.graph.input:
        info = value_info_from_proto(vi)
        if vi.name not in trainable and vi.name not in inits and info is not None:
            inputs[vi.name] = info
    return fwd, initial, inputs


class BaseRunner:
    """The runner interface, and the feeds of both graphs of a :class:`GradientGraphs`.

    Values go in and come out as ``OrtValue``s (see :mod:`.values`); this is the layer both the
    numpy runtime and the PyTorch bridge sit on. Trainable initializers are stripped from the
    forward graph (their values are bound at each call), so weights are held once, by the caller.
    A subclass calls :meth:`_setup` first, which returns the forward graph to run (not kept: its
    non-trainable initializers would be held twice), then runs the graphs in :meth:`_run_forward`
    and :meth:`_run_backward` (``graphs.backward``), each returning the wanted values by name.
    """

    graphs: GradientGraphs
    initial_values: dict[str, np.ndarray]  # trainable name -> its value in the model
    inputs: dict[str, ValueInfo]  # what the caller feeds, besides the trainable values
    fwd_outputs: list[str]
    wrt: list[str]  # the names of the backward's results, in order

    def _setup(self, graphs: GradientGraphs) -> onnx.ModelProto:
        """Set the attributes above; returns the forward graph without the trainable initializers."""
        self.graphs = graphs
        forward, self.initial_values, self.inputs = split_forward(graphs)
        self.fwd_outputs = [o.name for o in forward.graph.output]
        self.wrt = list(graphs.grad_outputs)
        return forward

    def forward(
        self, values: Mapping[str, OrtValueLike], training: bool
    ) -> tuple[list[C.OrtValue], dict[str, OrtValueLike] | None]:
        """Run the forward on inputs and parameters: (user outputs, saved values or None)."""
        graphs = self.graphs
        wanted = self.fwd_outputs if training else graphs.outputs
        env = self._run_forward(values, wanted, training)
        outputs = [env[o] for o in graphs.outputs]
        if not training:
            return outputs, None
        return outputs, {s: env[s] if s in env else values[s] for s in graphs.saved}

    def backward(
        self, saved: Mapping[str, OrtValueLike], grads: Mapping[str, OrtValueLike]
    ) -> list[C.OrtValue]:
        """Run the backward: one gradient per name of ``self.wrt``. ``grads`` by user output name."""
        graphs = self.graphs
        feeds = {name: saved[name] for name in graphs.saved}
        for out, name in graphs.grad_inputs.items():
            feeds[name] = grads[out]
        wanted = [graphs.grad_outputs[w] for w in self.wrt]
        env = self._run_backward(feeds, wanted)
        return [env[name] for name in wanted]

    def _run_forward(
        self, values: Mapping[str, OrtValueLike], wanted: list[str], training: bool
    ) -> Mapping[str, C.OrtValue]:
        raise NotImplementedError

    def _run_backward(self, feeds: Mapping[str, OrtValueLike], wanted: list[str]) -> Mapping[str, C.OrtValue]:
        raise NotImplementedError


# what a failed run of either graph says (OnnxGradRuntimeError), before onnxruntime's own message;
# also said by the callers that run a Runner's sessions directly (onnxgrad.torch.OnnxModule)
FORWARD_FAILED = "the forward graph failed in onnxruntime"
BACKWARD_FAILED = "the backward graph failed in onnxruntime"


class Runner(BaseRunner):
    """The two onnxruntime sessions of a :class:`GradientGraphs` (the backward made on first use)."""

    def __init__(
        self,
        graphs: GradientGraphs,
        providers: list[Any],
        session_options: ort.SessionOptions | None = None,
    ) -> None:
        self.fwd = make_session(self._setup(graphs), providers, session_options)
        self._bwd: ort.InferenceSession | None = None  # made on the first backward
        self._providers, self._options = providers, session_options
        self._lock = threading.Lock()

    def _run_forward(
        self, values: Mapping[str, OrtValueLike], wanted: list[str], training: bool
    ) -> Mapping[str, C.OrtValue]:
        try:
            return dict(zip(wanted, run(self.fwd, values, wanted)))
        except Exception as exc:
            raise OnnxGradRuntimeError(f"{FORWARD_FAILED}: {exc}") from exc

    def backward_session(self) -> ort.InferenceSession:
        """The backward session, made on first use (inference-only users never pay for it)."""
        with self._lock:
            if self._bwd is None:
                backward = blocked_convs(
                    self.graphs.backward, self._providers, shapes_from=self.graphs.forward
                )
                self._bwd = make_session(backward, self._providers, self._options)
        return self._bwd

    def _run_backward(self, feeds: Mapping[str, OrtValueLike], wanted: list[str]) -> Mapping[str, C.OrtValue]:
        session = self._bwd if self._bwd is not None else self.backward_session()  # lock: first use only
        try:
            return dict(zip(wanted, run(session, feeds, wanted)))
        except Exception as exc:
            raise OnnxGradRuntimeError(f"{BACKWARD_FAILED}: {exc}") from exc


# A factory returns a runner for the graphs it knows how to run, None for the others.
RunnerFactory = Callable[..., "BaseRunner | None"]
_FACTORIES: list[RunnerFactory] = []


def register_runner(factory: RunnerFactory) -> RunnerFactory:
    """Register ``factory(graphs, providers, session_options, **options) -> runner or None``,
    asked before :class:`Runner` (and before the factories registered earlier) by
    :func:`make_runner`. Registering the same factory again does nothing."""
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)
    return factory


def make_runner(
    graphs: GradientGraphs,
    providers: list[Any],
    session_options: ort.SessionOptions | None = None,
    **options: Any,
) -> BaseRunner:
    """The runner for ``graphs``: the first registered factory that takes them, else a
    :class:`Runner`. ``options`` go to the factories (e.g. ``functions`` and ``allow_import`` for
    graphs with PythonOp nodes); a plain :class:`Runner` has no use for them."""
    for factory in reversed(_FACTORIES):
        runner = factory(graphs, providers, session_options, **options)
        if runner is not None:
            return runner
    return Runner(graphs, providers, session_options)
