"""Sessions and runners: the one place onnxgrad makes onnxruntime sessions, and the runner base.

* :func:`make_session` makes every onnxruntime session of onnxgrad (the forward and backward of a
  :class:`Runner`, the stages of a PythonOp graph, the one-graph step, the artifacts runner...):
  same options policy (:mod:`.options`: idle pool threads do not spin, quantized products computed
  as differentiated), same errors.
* :class:`BaseRunner` builds the feeds of both graphs of a :class:`GradientGraphs` and what the
  forward hands to the backward; :class:`Runner` runs each graph as one session. Graphs that need
  another runner (those holding PythonOp nodes) get it from a factory registered with
  :func:`register_runner` by the layer that knows them (:mod:`onnxgrad.pythonop`, when imported):
  :func:`make_runner` asks the factories, newest first, and falls back to :class:`Runner`.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnx.external_data_helper import _get_all_tensors, load_external_data_for_model

from ..autodiff.engine import GradientGraphs
from ..autodiff.recompute import runs_in_graph_order
from ..deps import require_onnxruntime
from ..errors import OnnxGradRuntimeError
from ..model.graph import ValueInfo, ir_version_for, to_array, value_info_from_proto
from ..storage import PROTOBUF_LIMIT
from .blocked_conv import blocked_convs
from .options import (
    NBITS_ACCURACY_KEY,
    SESSION_FIELDS,
    copy_options,
    default_options,
    exact_nbits_options,
    fuses_blocked_dequantize,
    nbits_accuracy_set,
    options_from_state,
    options_state,
    session_options_for,
)
from .values import C, OrtValueLike, run

__all__ = [
    "NBITS_ACCURACY_KEY",
    "SESSION_FIELDS",
    "BaseRunner",
    "Runner",
    "copy_options",
    "default_options",
    "exact_nbits_options",
    "fuses_blocked_dequantize",
    "make_runner",
    "make_session",
    "nbits_accuracy_set",
    "newest_opset",
    "options_from_state",
    "options_state",
    "register_runner",
    "session_options_for",
    "split_forward",
]


def make_session(
    model: onnx.ModelProto | str | os.PathLike,
    providers: list[Any],
    options: ort.SessionOptions | None = None,
    *,
    label: str | None = None,
) -> ort.InferenceSession:
    """An onnxruntime session for ``model`` (a proto, or the path of a file); failures become
    :class:`OnnxGradRuntimeError` ("onnxruntime cannot load ``label``: ...", by default the graph's
    name).

    The options are those of :func:`~.options.session_options_for` (onnxgrad's policy): without
    ``options``, the pool threads do not spin after a run (a training step alternates a forward and
    a backward session, and the idle pool's spinning threads would take the cores of the one
    running; measured: the mlp step 8.9 ms with spinning, 4.2 ms without), and a model whose
    blocked 4-bit ``DequantizeLinear -> MatMul`` onnxruntime would fuse into an
    activation-quantizing ``MatMulNBits`` computes it in float, as differentiated.

    On CPU-only sessions, Convs fed their weight run on onnxruntime's blocked (NCHWc) kernels
    (:func:`~onnxgrad.runtime.blocked_conv.blocked_convs`). A file (the one-graph step of an
    artifacts folder) is read without its external data; only when that rewrites a Conv is it read
    whole (its external data from its folder) and the rewritten model handed over as bytes, and not
    where its tensors exceed one protobuf (2 GB): that file runs as it is, on the generic kernels.
    """
    require_onnxruntime()
    path = os.fspath(model) if isinstance(model, str | os.PathLike) else None
    if path is not None:
        model = onnx.load(path, load_external_data=False)  # the graph; its big tensors stay on disk
    options = session_options_for(model, options)
    blocked = blocked_convs(model, providers)  # Convs fed their weight: onnxruntime's fast kernels
    if runs_in_graph_order(model):  # recomputed activations
        options = copy_options(options)  # the caller's options stay as they are
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    source: str | bytes
    if path is None:
        source = blocked.SerializeToString()
    else:  # the file as it is, unless its Convs were rewritten
        full = _with_external_data(blocked, path) if blocked is not model else None
        source = path if full is None else full.SerializeToString()
    # onnxruntime's EliminateDropout removes a Dropout whose mask no one reads, training mode or not:
    # a training forward that does not keep the mask (nothing before it trains, or no backward)
    # would run without dropout
    kept = {"disabled_optimizers": ["EliminateDropout"]} if drops_in_training(model) else {}
    try:
        return ort.InferenceSession(source, sess_options=options, providers=providers, **kept)
    except Exception as exc:
        if label is None:
            label = f"the {path!r} file" if path is not None else f"the {model.graph.name!r} graph"
        raise OnnxGradRuntimeError(f"onnxruntime cannot load {label}: {exc}") from exc


def drops_in_training(model: onnx.ModelProto) -> bool:
    """Whether a Dropout of ``model``'s main graph runs in training mode: its ``training_mode`` input
    a constant (initializer or Constant node) holding true, or fed at run time."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consts = {
        n.output[0]: a.t for n in g.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"
    }
    for node in g.node:
        if node.op_type != "Dropout" or len(node.input) < 3 or not node.input[2]:
            continue
        tensor = inits.get(node.input[2]) or consts.get(node.input[2])
        if tensor is None or tensor.data_location == onnx.TensorProto.EXTERNAL:
            return True
        if bool(numpy_helper.to_array(tensor).any()):
            return True
    return False


def _with_external_data(model: onnx.ModelProto, path: str) -> onnx.ModelProto | None:
    """``model`` (read from ``path`` without its external data, then rewritten) with its external
    tensors read from ``path``'s folder, to be handed to onnxruntime as bytes; None (run the file as
    it is) where they would not fit in one protobuf or cannot be read (onnxruntime then says why)."""
    external = [t for t in _get_all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return model
    size = sum(
        int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in external
    )
    if size + model.ByteSize() > PROTOBUF_LIMIT:
        return None
    try:
        load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
    except Exception:  # a missing or short data file, a location outside the folder
        return None
    return model


@functools.cache
def newest_opset() -> int:
    """The newest default-domain opset that the installed onnx defines and the installed onnxruntime
    loads (onnx 1.23 defines 28; onnxruntime 1.31 loads 26 at most): what a model onnxgrad writes from
    nothing stamps when no opset is asked for. Probed once per process on a one-node model."""
    for opset in range(onnx.defs.onnx_opset_version(), 17, -1):
        graph = onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])],
            "opset_probe",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
        imports = [onnx.helper.make_opsetid("", opset)]
        model = onnx.helper.make_model(graph, opset_imports=imports, ir_version=ir_version_for(imports))
        try:
            make_session(model, ["CPUExecutionProvider"], None, label=f"an opset {opset} probe")
        except OnnxGradRuntimeError:
            continue
        return opset
    return 17


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
