"""The plain-ONNX graphs behind ``onnxgrad.compat.training``.

Everything starts from a *loss model*: the user's model with the loss appended (onnxblock), every
parameter an initializer. From it:

* :func:`training_graph`: forward, loss and backward in one graph. Inputs: the user inputs (the
  model's, then the targets), then every checkpoint parameter (trainable and frozen, in initializer
  order). Outputs: the loss outputs, the gradient of each trainable parameter and the updated
  running statistics of BatchNormalization (frozen parameters updated after each step, as
  onnxruntime-training does: momentum and the biased batch variance, ONNX's formula). Gradients
  are accumulated by :class:`~onnxgrad.compat.training.api.Module`, not in the graph.
* :func:`eval_graph`: the forward and loss in inference mode, parameters as inputs.
* :func:`optimizer_graph`: one update of every trainable parameter by onnxruntime-training's
  formulas (``AdamWOptimizer`` with ``adam_mode=1``, ``SGDOptimizerV2``).

A folder written by onnxruntime-training 1.19.2 holds the same loss model as its
``eval_model.onnx`` (parameters as inputs, fed from the checkpoint): :func:`loss_model_from_eval`
puts them back as initializers.

A model whose parameters reach ``checkpoint_file.EXTERNAL_DATA_THRESHOLD`` (1800 MB: a model over
2 GB) is built with every parameter a graph input from the start (trained ones differentiated as
inputs): its weights are never copied nor serialized, as no protobuf can hold them. The graphs are
the same (``tests/compat_training/test_big.py`` compares the numbers).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...artifacts.optim import Param, emit_program
from ...autodiff.compose import compose
from ...autodiff.engine import build_gradient
from ...autodiff.prepare import prepare
from ...errors import InputError
from ...model.emit import Emitter
from ...model.graph import check_model, ir_version_for, opset_of, unique_name, without_weights
from ...model.load import CheckedModel
from ...storage import PROTOBUF_LIMIT, _nbytes
from ...train.losses import keep_outputs
from ...train.optimizers import ORT, definition
from . import checkpoint_file
from .opset import lower_opset

__all__ = [
    "META_KEY",
    "TrainingGraph",
    "class_labels",
    "eval_graph",
    "inference_graph",
    "loss_model_from_eval",
    "mark",
    "optimizer_graph",
    "read_meta",
    "set_outputs",
    "training_graph",
]

META_KEY = "onnxgrad.compat.training"  # metadata_props entry of the files onnxgrad writes


@dataclass
class TrainingGraph:
    """A training graph and what its inputs and outputs mean."""

    model: onnx.ModelProto
    user_inputs: list[str]
    parameters: list[str]  # every parameter input, in graph order
    loss_outputs: list[str]  # what Module.__call__ returns
    grads: dict[str, str] = field(default_factory=dict)  # trainable parameter -> gradient output
    stats: dict[str, str] = field(default_factory=dict)  # running statistic -> updated value
    input_grads: dict[str, str] = field(default_factory=dict)  # graph input -> gradient output
    # class-label input -> {"classes": C or None, "ignore_index": value or None} (class_labels)
    labels: dict[str, dict] = field(default_factory=dict)

    def meta(self) -> dict:
        """What :func:`mark` stores in the file: everything but the model."""
        return {k: v for k, v in vars(self).items() if k != "model"}


def mark(model: onnx.ModelProto, meta: Mapping) -> None:
    """Store ``meta`` (JSON) in the model's metadata: the file is onnxgrad's."""
    kept = [p for p in model.metadata_props if p.key != META_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=META_KEY, value=json.dumps(dict(meta)))


def read_meta(model: onnx.ModelProto) -> dict | None:
    """The onnxgrad metadata of a file this package wrote, ``None`` for any other file."""
    for p in model.metadata_props:
        if p.key == META_KEY:
            return json.loads(p.value)
    return None


_CLASS_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def class_labels(model: onnx.ModelProto) -> dict[str, dict]:
    """The class labels of ``model`` that a caller feeds: for each ``SoftmaxCrossEntropyLoss`` (or
    ``NegativeLogLikelihoodLoss``) whose labels are a graph input, ``{label input: {"classes": C,
    "ignore_index": value}}``. ``C`` is dimension 1 of the scores (``None`` when not known), and
    ``ignore_index`` the node's attribute (``None`` without it). What the steps check labels
    against before a run (:func:`onnxgrad.train.check_labels`, and ``checkClassLabels`` in
    JavaScript): onnxruntime reads a label -1 as class C - 1, and fails inside GatherElements on
    a label >= C."""
    inputs = {i.name for i in model.graph.input} - {i.name for i in model.graph.initializer}
    nodes = [
        n
        for n in model.graph.node
        if n.op_type in _CLASS_LOSSES
        and n.domain in ("", "ai.onnx")
        and len(n.input) > 1
        and n.input[1] in inputs
    ]
    if not nodes:
        return {}
    inferred = onnx.shape_inference.infer_shapes(without_weights(model))
    infos = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input)}
    labels: dict[str, dict] = {}
    for n in nodes:
        classes = None
        info = infos.get(n.input[0])
        if info is not None and info.type.tensor_type.HasField("shape"):
            dims = info.type.tensor_type.shape.dim
            if len(dims) > 1 and dims[1].HasField("dim_value"):
                classes = int(dims[1].dim_value)
        ignore = next((int(a.i) for a in n.attribute if a.name == "ignore_index"), None)
        labels[n.input[1]] = {"classes": classes, "ignore_index": ignore}
    return labels


def set_outputs(model: onnx.ModelProto, names: list[str]) -> None:
    """Make ``names`` the graph outputs, in place (onnxruntime-training keeps only the loss
    outputs and the additional ones)."""
    inferred = onnx.shape_inference.infer_shapes(without_weights(model))  # no 2 GB protobuf
    infos = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input)}
    missing = [n for n in names if n not in infos]
    if missing:
        raise InputError(f"no value named {missing} in the model to output (a loss returns value names)")
    del model.graph.output[:]
    model.graph.output.extend(infos[n] for n in names)


def _params_as_inputs(model: onnx.ModelProto, names: Iterable[str]) -> None:
    """Turn the initializers ``names`` into graph inputs (in the order given), in place."""
    g = model.graph
    names = list(names)
    inits = {i.name: i for i in g.initializer}
    missing = [n for n in names if n not in inits]
    if missing:
        raise InputError(f"{missing} are not initializers of the model")
    declared = {i.name for i in g.input}
    g.input.extend(
        helper.make_tensor_value_info(n, inits[n].data_type, list(inits[n].dims))
        for n in names
        if n not in declared
    )
    kept = [i for i in g.initializer if i.name not in set(names)]
    del g.initializer[:]
    g.initializer.extend(kept)


def _is_big(model: onnx.ModelProto, params: list[str]) -> bool:
    """Whether the parameters ``params`` of ``model`` reach the external-data threshold: the graphs
    are then built with them as inputs from the start (see :func:`training_graph`)."""
    chosen = set(params)
    total = sum(_nbytes(i) for i in model.graph.initializer if i.name in chosen)
    return total >= checkpoint_file.EXTERNAL_DATA_THRESHOLD


def _inputs_last(model: onnx.ModelProto, names: list[str]) -> None:
    """Move the graph inputs ``names`` after the others, in the order given, in place."""
    g = model.graph
    by_name = {i.name: i for i in g.input}
    ordered = [i for i in g.input if i.name not in set(names)] + [by_name[n] for n in names]
    del g.input[:]
    g.input.extend(ordered)


def _params_as_declared_inputs(model: onnx.ModelProto, params: set[str]) -> onnx.ModelProto:
    """``model`` with the initializers ``params`` turned into graph inputs, their data not copied
    (:func:`~onnxgrad.model.graph.without_weights`, whose other large initializers keep theirs)."""
    skeleton = without_weights(model)
    g = skeleton.graph
    declared = {i.name for i in model.graph.input}
    moved = {i.name for i in g.input} - declared
    inits = {i.name: i for i in model.graph.initializer}
    kept = [i for i in g.initializer if i.name not in params]
    small = [i for i in g.initializer if i.name in params]  # small parameters: inputs too
    del g.initializer[:]
    g.initializer.extend(kept)
    g.initializer.extend(inits[n] for n in moved if n not in params and n in inits)  # constants
    inputs = [i for i in g.input if i.name in declared or i.name in params]
    del g.input[:]
    g.input.extend(inputs)
    g.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in small
        if t.name not in declared
    )
    skeleton.metadata_props.extend(model.metadata_props)
    return skeleton


def _finish(model: onnx.ModelProto) -> onnx.ModelProto:
    """Checked, at the lowest IR version its opsets allow (what older runtimes load)."""
    model.ir_version = ir_version_for(model.opset_import)
    check_model(model)
    return model


def training_graph(
    loss_model: onnx.ModelProto,
    trainable: list[str],
    frozen: list[str],
    loss_outputs: list[str],
    inputs_requiring_grad: Iterable[str] = (),
) -> TrainingGraph:
    """Forward, loss and backward of ``loss_model`` (see the module docstring). Gradients start
    from the first of ``loss_outputs`` (onnxruntime-training's rule). ``inputs_requiring_grad``:
    graph inputs whose gradient ``<input>_grad`` is an output too (after the loss outputs, before
    the parameters' gradients: 1.19.2's order). With nothing to differentiate the training model
    is the forward and loss in training mode (Dropout on, BatchNormalization's statistics updated),
    with no gradient: 1.19.2 builds that too."""
    inputs_requiring_grad = list(inputs_requiring_grad)
    known = {i.name for i in loss_model.graph.initializer}
    unknown = [n for n in [*trainable, *frozen] if n not in known]
    if unknown:
        raise InputError(f"{unknown} are not initializers of the model")
    declared_inputs = {i.name for i in loss_model.graph.input}
    not_inputs = [n for n in inputs_requiring_grad if n not in declared_inputs]
    if not_inputs:
        raise InputError(f"{not_inputs} are neither initializers nor graph inputs of the model")
    params = [i.name for i in loss_model.graph.initializer if i.name in set(trainable) | set(frozen)]
    big = _is_big(loss_model, params)
    if big:
        # a model over 2 GB: every parameter an input from the start, its data never copied nor
        # serialized (the checkpoint holds it); the trained ones are differentiated as inputs
        overridable = _params_as_declared_inputs(loss_model, set(params))
        rest = sum(_nbytes(i) for i in loss_model.graph.initializer if i.name not in set(params))
        if rest >= PROTOBUF_LIMIT:
            raise InputError(
                f"the initializers that are neither trained nor frozen hold {rest} bytes, more than one "
                "protobuf can (2 GB): list the large ones in frozen_params, so that the checkpoint holds them"
            )
    else:
        # frozen parameters become inputs before anything folds them: their values are fed per call
        overridable = onnx.ModelProto()
        overridable.CopyFrom(loss_model)
        declared = {i.name for i in overridable.graph.input}
        inits = {i.name: i for i in overridable.graph.initializer}
        overridable.graph.input.extend(
            helper.make_tensor_value_info(n, inits[n].data_type, list(inits[n].dims))
            for n in frozen
            if n in inits and n not in declared
        )
    prepared = prepare(overridable)
    train = prepared.training.proto
    stats = {s: o for s, o in prepared.running_stats.items() if s in set(frozen)}
    infos = {o.name: o for o in train.graph.output}
    if trainable or inputs_requiring_grad:
        model, grad_outputs = _with_gradients(
            prepared.training, trainable, inputs_requiring_grad, loss_outputs[0], big, infos
        )
    else:  # nothing to differentiate: the forward and loss in training mode
        model = keep_outputs(prepared.training, [*loss_outputs, *stats.values()])
        model.graph.name = "training_model"
        grad_outputs = {}
    g = model.graph
    declared = {o.name for o in g.output}
    g.output.extend(infos[o] for o in [*loss_outputs[1:], *stats.values()] if o not in declared)
    order = [o.name for o in g.output]
    wanted = [
        *loss_outputs,
        *(grad_outputs[n] for n in inputs_requiring_grad),
        *(grad_outputs[p] for p in trainable),
        *stats.values(),
    ]
    by_name = {o.name: o for o in g.output}
    del g.output[:]
    g.output.extend(by_name[n] for n in wanted if n in order)
    if big:  # the parameters are inputs already: after the user inputs, in initializer order
        _inputs_last(model, params)
    else:
        # trainable values were fed by compose as initializers: every parameter becomes an input
        for name in params:
            if name not in {i.name for i in g.initializer}:  # dropped as unused: put it back
                src = next(i for i in loss_model.graph.initializer if i.name == name)
                g.initializer.append(src)
        _params_as_inputs(model, params)
    # an input with an initializer (a running statistic that is no checkpoint parameter) keeps
    # that value unless fed: no user input. It stays an input: onnxruntime's optimizer folds a
    # training-mode BatchNormalization on constant statistics wrongly
    defaults = {i.name for i in g.initializer}
    user_inputs = [i.name for i in g.input if i.name not in set(params) and i.name not in defaults]
    result = TrainingGraph(
        model,
        user_inputs,
        params,
        list(loss_outputs),
        {p: grad_outputs[p] for p in trainable},
        stats,
        {n: grad_outputs[n] for n in inputs_requiring_grad},
        {n: spec for n, spec in class_labels(loss_model).items() if n in user_inputs},
    )
    _at_base_opset(result, loss_model)
    mark(result.model, result.meta())
    _finish(result.model)
    return result


def _at_base_opset(result: TrainingGraph, loss_model: onnx.ModelProto) -> None:
    """The training model written at the base model's opset, as 1.19.2 did, when every node means
    the same there (:func:`~onnxgrad.compat.training.opset.lower_opset`, opset 13 and up); else
    kept at the backward's, with a :class:`UserWarning` saying why."""
    base = opset_of(loss_model)
    lowered = lower_opset(result.model, base)
    if isinstance(lowered, onnx.ModelProto):
        result.model = lowered
        return
    warnings.warn(
        f"the training model is written at opset {opset_of(result.model)}, above the base model's "
        f"opset {base}: {lowered}. onnxruntime-training 1.19.2 kept the base opset; a runtime that "
        f"reads opset {opset_of(result.model)} runs it",
        UserWarning,
        stacklevel=4,
    )


def _with_gradients(
    train: CheckedModel,
    trainable: list[str],
    inputs_requiring_grad: list[str],
    loss: str,
    big: bool,
    infos: Mapping[str, onnx.ValueInfoProto],
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The forward, loss and backward of ``train`` from ``loss`` (seeded with ones shaped like
    it), and the gradient output of each differentiated value."""
    if big:  # the parameters are graph inputs: differentiated as inputs
        graphs = build_gradient(
            train, trainable=[], inputs_requiring_grad=[*trainable, *inputs_requiring_grad], outputs=[loss]
        )
    else:
        graphs = build_gradient(
            train, trainable=trainable, inputs_requiring_grad=inputs_requiring_grad, outputs=[loss]
        )
    model = compose(graphs, name="training_model")
    g = model.graph
    seed = graphs.grad_inputs[loss]
    # the gradient seed: ones shaped like the loss (a [1]-shaped custom loss included)
    inputs = [i for i in g.input if i.name != seed]
    del g.input[:]
    g.input.extend(inputs)
    taken = {n.name for n in g.node} | {o for n in g.node for o in n.output}
    shape = unique_name(f"{loss}/shape", taken)
    elem = infos[loss].type.tensor_type.elem_type
    one = numpy_helper.from_array(np.ones(1, helper.tensor_dtype_to_np_dtype(elem)))
    seed_nodes = [
        helper.make_node("Shape", [loss], [shape], name=unique_name("seed/shape", taken)),
        helper.make_node("ConstantOfShape", [shape], [seed], name=unique_name("seed", taken), value=one),
    ]
    nodes = list(g.node)
    at = next(k for k, n in enumerate(nodes) if loss in n.output) + 1  # right after the loss
    del g.node[:]
    g.node.extend([*nodes[:at], *seed_nodes, *nodes[at:]])
    return model, dict(graphs.grad_outputs)


def eval_graph(loss_model: onnx.ModelProto, params: list[str], loss_outputs: list[str]) -> onnx.ModelProto:
    """The forward and loss in inference mode, the parameters ``params`` as inputs."""
    known = {i.name for i in loss_model.graph.initializer}
    present = [p for p in params if p in known]
    if _is_big(loss_model, present):
        model = keep_outputs(
            prepare(_params_as_declared_inputs(loss_model, set(present))).given_inference, loss_outputs
        )
        _inputs_last(model, [p for p in present if p in {i.name for i in model.graph.input}])
        _dropout_mode_empty(model, loss_model)
        return _finish(model)
    prepared = prepare(loss_model)
    model = keep_outputs(prepared.given_inference, loss_outputs)
    _params_as_inputs(model, [p for p in params if p in {i.name for i in model.graph.initializer}])
    _dropout_mode_empty(model, loss_model)
    return _finish(model)


def _dropout_mode_empty(model: onnx.ModelProto, given: onnx.ModelProto) -> None:
    """Leave the ``training_mode`` input of each Dropout of the eval ``model`` empty (inference,
    ONNX's default), as onnxruntime-training 1.19.2 writes it, in place: the node keeps the inputs
    it had in ``given``, the constant that switched it off goes."""
    arity = {n.output[0]: len(n.input) for n in given.graph.node if n.op_type == "Dropout"}
    g = model.graph
    flags = set()
    for node in g.node:
        if node.op_type == "Dropout" and len(node.input) > 2:
            flags.add(node.input[2])
            node.input[2] = ""
            keep = max(arity.get(node.output[0], 3), 1)
            while len(node.input) > keep and not node.input[-1]:
                del node.input[-1]
    read = {i for n in g.node for i in n.input}
    kept = [i for i in g.initializer if i.name not in flags or i.name in read]
    del g.initializer[:]
    g.initializer.extend(kept)


def inference_graph(
    loss_model: onnx.ModelProto, values: Mapping[str, np.ndarray], outputs: list[str]
) -> onnx.ModelProto:
    """The model in inference mode computing ``outputs`` from the parameter ``values``: they
    replace the initializers of those names, and become initializers where ``loss_model`` takes
    them as inputs (a model over 2 GB: nothing is copied before the graph is cut down)."""
    model = onnx.ModelProto()
    model.CopyFrom(prepare(loss_model).given_inference.proto)
    g = model.graph
    replaced = [
        numpy_helper.from_array(np.asarray(values[i.name]), i.name) if i.name in values else i
        for i in g.initializer
    ]
    del g.initializer[:]
    g.initializer.extend(replaced)
    known = {o.name for o in g.output}
    if any(o not in known for o in outputs):  # inner values may be asked for too
        inferred = onnx.shape_inference.infer_shapes(without_weights(model))
        infos = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output)}
        missing = [o for o in outputs if o not in infos]
        if missing:
            raise InputError(f"the model has no value named {missing} to output")
        g.output.extend(infos[o] for o in outputs if o not in known)
    model = keep_outputs(CheckedModel(model), outputs)
    g = model.graph
    fed = [i.name for i in g.input if i.name in values]
    if fed:
        kept = [i for i in g.input if i.name not in values]
        del g.input[:]
        g.input.extend(kept)
        g.initializer.extend(numpy_helper.from_array(np.asarray(values[n]), n) for n in fed)
    return _finish(model)


def loss_model_from_eval(eval_model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """An eval model whose parameter inputs are fed (``values``) turned back into the loss model."""
    model = onnx.ModelProto()
    model.CopyFrom(eval_model)
    g = model.graph
    inputs = [i for i in g.input if i.name not in values]
    fed = [i.name for i in g.input if i.name in values]
    del g.input[:]
    g.input.extend(inputs)
    old = [i for i in g.initializer if i.name not in values]
    del g.initializer[:]
    g.initializer.extend(numpy_helper.from_array(np.asarray(values[n]), n) for n in fed)
    g.initializer.extend(old)
    return model


# ---- optimizers ------------------------------------------------------------------------------------
ADAMW, SGD = "AdamWOptimizer", "SGDOptimizerV2"
LEARNING_RATE, STEP = "learning_rate", "step"
PARAMS, GRADIENTS = "params", "gradients"
MOMENTS = ("first_order_moments", "second_order_moments")  # AdamW's momentum0 and momentum1 slots
FLAGS = {ADAMW: "adamw.updated_flag", SGD: "sgd.updated_flag"}


def updated(name: str) -> str:
    """The output that carries the new value of the sequence input ``name``."""
    return f"updated_{name}"


def sequences(kind: str) -> list[str]:
    """The sequence inputs of the optimizer model of ``kind``, in order."""
    return [PARAMS, GRADIENTS, *(MOMENTS if kind == ADAMW else ())]


def optimizer_graph(
    kind: str,
    attrs: Mapping,
    params: Mapping[str, tuple[int, list[int]]],
    max_norm: float | None = None,
    *,
    sequences: bool = False,
) -> onnx.ModelProto:
    """One update of every parameter of ``params`` (name -> (ONNX type, shape)) on standard ops:
    the registry's onnxruntime-training formula (:mod:`onnxgrad.train.optimizers`),
    ``AdamWOptimizer`` with ``adam_mode=1`` or ``SGDOptimizerV2``. ``max_norm``: the gradients are
    first scaled by ``min(1, max_norm / (‖g‖ + 1e-6))``, ``‖g‖`` the L2 norm of all of them
    together (``ClipGradNorm``, :func:`clip_sequence`).

    ``sequences=True``: the layout of onnxruntime-training 1.19.2's optimizer model. Inputs
    ``learning_rate`` (float32, shape [1]), for AdamW ``step`` (int64, [1]: the index of this
    update, 1 for the first, as 1.19.2 feeds it), then the sequences ``params``, ``gradients`` and
    for AdamW ``first_order_moments``, ``second_order_moments`` (one tensor per parameter, in the
    order of ``params``). Outputs: the updated flag (int64 [1], always 1) and
    ``updated_<sequence>`` for the parameters and moments (1.19.2 updates its inputs in place).

    ``sequences=False``: one tensor per input, which every onnxruntime runs (onnxruntime-web and
    -node take no sequences): ``learning_rate`` (float32 scalar), ``step`` (int64 scalar: the
    updates already made), then per parameter ``p``, ``p/grad`` and for AdamW ``p/momentum0``,
    ``p/momentum1``; outputs ``new/<input>`` for the parameter and moments, then the updated flag. The file
    ``generate_artifacts`` writes, and what :class:`~onnxgrad.compat.training.api.Optimizer` runs.
    """
    if kind not in (ADAMW, SGD):
        raise InputError(f"unsupported optimizer {kind!r}; onnxgrad runs AdamW and SGD")
    spec = definition(kind, ORT)
    hyper = spec.resolve({k: v for k, v in attrs.items() if k in spec.defaults})
    if max_norm is not None and not float(max_norm) > 0:
        raise InputError(f"max_norm must be > 0, got {max_norm}")
    bad = [n for n, (elem, _) in params.items() if elem != TensorProto.FLOAT]
    if bad:
        raise InputError(f"parameters {bad}: the optimizer updates float32 parameters only")
    slots = spec.slots(hyper)
    graph = helper.make_graph([], "optimizer", [], [])
    e = Emitter(graph, 17, TensorProto.FLOAT, "opt")
    if sequences:
        lr, step, items = _sequence_inputs(e, kind, params, max_norm)
    else:
        lr, step, items = _tensor_inputs(e, kind, params, max_norm)
    state = {(p, slot): items[seq][i] for i, p in enumerate(params) for slot, seq in zip(slots, MOMENTS)}
    plist = [Param(p, items[GRADIENTS][i], TensorProto.FLOAT) for i, p in enumerate(params)]
    new_params, new_state = emit_program(
        e, spec, hyper, plist, state, lr, step, TensorProto.FLOAT, TensorProto.FLOAT, step_base=int(sequences)
    )
    news = {PARAMS: [new_params[p] for p in params]}
    news.update({seq: [new_state[(p, slot)] for p in params] for slot, seq in zip(slots, MOMENTS)})
    if sequences:
        _sequence_outputs(e, kind, news)
    else:
        for seq, values in news.items():
            for (_, shape), source, value in zip(params.values(), items[seq], values):
                out = f"new/{source}"
                graph.node.append(helper.make_node("Identity", [value], [out], name=e.fresh("out")))
                graph.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, shape))
        _flag(e, kind)  # last: a model without parameters still has an output
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    meta = {"optimizer": kind, "attributes": dict(attrs)}
    if max_norm is not None:
        meta["max_norm"] = float(max_norm)
    mark(model, meta)
    check_model(model)
    return model


def _tensor_inputs(
    e: Emitter, kind: str, params: Mapping[str, tuple[int, list[int]]], max_norm: float | None
) -> tuple[str, str, dict[str, list[str]]]:
    """The inputs of the one-tensor-per-input layout: (lr, step, sequence name -> the values)."""
    graph = e.graph
    graph.input.extend(
        [
            helper.make_tensor_value_info(LEARNING_RATE, TensorProto.FLOAT, []),
            helper.make_tensor_value_info(STEP, TensorProto.INT64, []),
        ]
    )
    moments = ["momentum0", "momentum1"] if kind == ADAMW else []
    items: dict[str, list[str]] = {PARAMS: list(params), GRADIENTS: [f"{p}/grad" for p in params]}
    items.update({seq: [f"{p}/{m}" for p in params] for seq, m in zip(MOMENTS, moments)})
    for p, (elem, shape) in params.items():
        names = [p, f"{p}/grad", *(f"{p}/{m}" for m in moments)]
        graph.input.extend(helper.make_tensor_value_info(n, elem, shape) for n in names)
    e.taken |= {LEARNING_RATE, STEP, *(n for values in items.values() for n in values)}
    e.taken |= {f"new/{n}" for values in items.values() for n in values} | {FLAGS[kind]}
    if max_norm is not None and params:
        together = e.op("SequenceConstruct", *items[GRADIENTS])
        clipped = clip_sequence(e, together, float(max_norm))
        items[GRADIENTS] = [
            e.op("SequenceAt", clipped, e.const(i, TensorProto.INT64)) for i in range(len(params))
        ]
    return LEARNING_RATE, STEP, items


def _sequence_inputs(
    e: Emitter, kind: str, params: Mapping[str, tuple[int, list[int]]], max_norm: float | None
) -> tuple[str, str, dict[str, list[str]]]:
    """The inputs of 1.19.2's layout: (lr, step, sequence name -> its tensors, read one by one)."""
    graph = e.graph
    names = sequences(kind)
    scalars = [LEARNING_RATE, *([STEP] if kind == ADAMW else [])]
    graph.input.extend(
        helper.make_tensor_value_info(n, TensorProto.INT64 if n == STEP else TensorProto.FLOAT, [1])
        for n in scalars
    )
    graph.input.extend(helper.make_tensor_sequence_value_info(n, TensorProto.FLOAT, None) for n in names)
    e.taken |= {*scalars, *names, FLAGS[kind], *map(updated, names), *params}
    as_scalar = e.const(np.zeros(0, np.int64), TensorProto.INT64)  # Reshape to shape []
    lr = e.op("Reshape", LEARNING_RATE, as_scalar)
    step = e.op("Reshape", STEP, as_scalar) if kind == ADAMW else ""
    read = dict(zip(names, names))
    if max_norm is not None and params:
        read[GRADIENTS] = clip_sequence(e, GRADIENTS, float(max_norm))
    items = {
        n: [e.op("SequenceAt", read[n], e.const(i, TensorProto.INT64)) for i in range(len(params))]
        for n in names
    }
    for value, p in zip(items[PARAMS], params):  # the program reads each parameter by its name
        graph.node.append(helper.make_node("Identity", [value], [p], name=e.fresh("param")))
    items[PARAMS] = list(params)
    return lr, step, items


def _flag(e: Emitter, kind: str) -> None:
    """The updated-flag output: int64 [1], always 1 (the update is never skipped)."""
    e.op("Constant", out=FLAGS[kind], value=numpy_helper.from_array(np.ones(1, np.int64)))
    e.graph.output.append(helper.make_tensor_value_info(FLAGS[kind], TensorProto.INT64, [1]))


def _sequence_outputs(e: Emitter, kind: str, news: Mapping[str, list[str]]) -> None:
    """The outputs of 1.19.2's layout: the updated flag, then each updated sequence."""
    graph = e.graph
    _flag(e, kind)
    for n, values in news.items():
        out = updated(n)
        if values:
            graph.node.append(helper.make_node("SequenceConstruct", values, [out], name=e.fresh("seq")))
        else:
            graph.node.append(helper.make_node("Identity", [n], [out], name=e.fresh("seq")))
        graph.output.append(helper.make_tensor_sequence_value_info(out, TensorProto.FLOAT, None))


def clip_sequence(e: Emitter, gradients: str, max_norm: float) -> str:
    """The float32 tensor sequence ``gradients`` scaled by ``min(1, max_norm / (‖g‖ + 1e-6))``,
    ``‖g‖`` the L2 norm of all its tensors together (onnxruntime-training's ``InplaceClipGradNorm``,
    the rule of ``torch.nn.utils.clip_grad_norm_``), on standard ops (``SequenceMap``, opset 17)."""

    def body(
        name: str, nodes: list[onnx.NodeProto], extra: list[onnx.ValueInfoProto], out_shape
    ) -> onnx.GraphProto:
        g_in = helper.make_tensor_value_info("g", TensorProto.FLOAT, None)
        out = helper.make_tensor_value_info("out", TensorProto.FLOAT, out_shape)
        return helper.make_graph(nodes, name, [g_in, *extra], [out])

    square = body("square", [helper.make_node("ReduceSumSquare", ["g"], ["out"], keepdims=0)], [], [])
    squares = e.op("SequenceMap", gradients, body=square)
    total = e.op("ReduceSum", e.op("ConcatFromSequence", squares, axis=0, new_axis=1), keepdims=0)
    norm = e.op("Add", e.op("Sqrt", total), e.const(1e-6))
    coef = e.op("Min", e.op("Div", e.const(max_norm), norm), e.const(1.0))
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [])
    scale = body("scale", [helper.make_node("Mul", ["g", "c"], ["out"])], [c], None)
    return e.op("SequenceMap", gradients, coef, body=scale)
