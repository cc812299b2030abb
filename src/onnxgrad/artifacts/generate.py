"""Training artifacts: one ONNX graph per training step, runnable on any stock onnxruntime.

:func:`generate` writes a folder that describes itself (``manifest.json``):

* ``train_step.onnx``: forward, loss, backward and optimizer update in one graph. Inputs: the batch
  (the model's inputs, the target, the optional sample weights), ``lr`` (double scalar), ``step``
  (int64 scalar: the number of updates already made), every trainable parameter, every optimizer
  state tensor and every running statistic (BatchNormalization). Outputs: ``loss``, then the new
  value of each parameter, state tensor and running statistic, named ``next/<input name>``.
* ``eval_step.onnx``: the loss and the model's outputs, parameters fed as inputs, no update.
* ``inference.onnx``: the model (inference mode) taking its trainable parameters and running
  statistics as inputs, so a runtime feeds the trained values without rewriting the file
  (onnxruntime-web and -node cannot feed initializers); :meth:`Runner.save` writes the usual
  self-contained model.
* ``state.safetensors``: the starting parameters, optimizer state and running statistics
  (see :mod:`onnxgrad.artifacts.tensors`); metadata ``step`` holds the update count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..autodiff.compose import compose
from ..autodiff.engine import build_gradient
from ..autodiff.params import declared_trainable
from ..autodiff.prepare import prepare
from ..errors import InputError
from ..model.graph import (
    FLOAT_TYPES,
    check_model,
    ir_version_for,
    np_dtype,
    opset_of,
    subgraphs,
    to_array,
    unique_name,
)
from ..model.load import CheckedModel
from ..train.losses import _Emitter, add_loss, keep_outputs
from ..train.optimizers import DEFAULT_OPTIMIZER
from ..train.optimizers import optimizer_options as optimizer_options_of
from . import tensors
from .optim import STATE_KEYS, Param, emit_updates, hyperparameters
from .targets import DEFAULT_TARGETS, check_targets
from .webgpu import WEBGPU, lower_for_webgpu

__all__ = ["FORMAT", "Artifacts", "generate"]

FORMAT = "onnxgrad.artifacts"
FORMAT_VERSION = 1
FILES = {
    "train_step": "train_step.onnx",
    "eval_step": "eval_step.onnx",
    "inference": "inference.onnx",
    "state": "state.safetensors",
    "manifest": "manifest.json",
}
LR, STEP = "lr", "step"
MAX_OPSET_FOR_OLD_RUNTIMES = 21  # onnxruntime 1.20 (and onnxruntime-web of its time) reads up to 21


@dataclass
class Artifacts:
    """The result of :func:`generate`: three models, the starting tensors and the manifest."""

    train_step: onnx.ModelProto
    eval_step: onnx.ModelProto
    inference: onnx.ModelProto
    state: dict[str, np.ndarray]  # parameters, optimizer state, running statistics by input name
    manifest: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | os.PathLike) -> str:
        """Write the folder (models, ``state.safetensors``, ``manifest.json``); returns its path."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        for key in ("train_step", "eval_step", "inference"):
            onnx.save(getattr(self, key), os.path.join(directory, FILES[key]))
        tensors.save(os.path.join(directory, FILES["state"]), self.state, {"format": FORMAT, STEP: "0"})
        with open(os.path.join(directory, FILES["manifest"]), "w") as f:
            json.dump(self.manifest, f, indent=1)
            f.write("\n")
        return directory


def generate(
    model: onnx.ModelProto | str | os.PathLike | bytes,
    requires_grad: Iterable[str] | None = None,
    frozen: Iterable[str] = (),
    *,
    loss: str | None,
    optimizer: str = DEFAULT_OPTIMIZER,
    out_dir: str | os.PathLike | None = None,
    lr: float = 1e-3,
    loss_options: Mapping[str, Any] | None = None,
    loss_name: str = "loss",
    target_name: str = "target",
    targets: Iterable[str] = DEFAULT_TARGETS,
    optimizer_options: Mapping[str, Any] | None = None,
    **legacy_options: Any,
) -> Artifacts:
    """Build (and with ``out_dir``, write) the training artifacts of ``model``.

    ``requires_grad``: the initializers to train (default: every floating-point initializer but the
    running statistics of BatchNormalization); ``frozen``: initializers left out of those.
    ``loss``: a kind of :func:`onnxgrad.train.add_loss` (its options in ``loss_options``), or
    ``None`` when the model already computes ``loss_name``. ``optimizer``: ``"sgd"``, ``"adam"``
    or ``"adamw"`` (the default, :data:`~onnxgrad.train.optimizers.DEFAULT_OPTIMIZER`), its
    hyperparameters in ``optimizer_options`` (``momentum``, ``nesterov``, ``betas``, ``eps``,
    ``weight_decay``...: the registry's, with its defaults; given as keywords they still work, with
    a :class:`DeprecationWarning`). ``lr`` is only the default the runners use; the step graph
    takes it as an input.
    ``targets``: the runtimes the folder must run on (``"onnxruntime"``, ``"onnxruntime-web"``,
    ``"onnxruntime-web-webgpu"``); an op one of them has no kernel for
    (:mod:`onnxgrad.artifacts.targets`) raises :class:`InputError` naming the op and the runtime,
    before anything is written. With ``"onnxruntime-web-webgpu"`` the graphs are written the way
    WebGPU runs them (:mod:`onnxgrad.artifacts.webgpu`; the other runtimes run those too).
    """
    targets = list(targets)
    webgpu = WEBGPU in targets
    prepared = prepare(model)  # the one validation: what follows rewrites the checked model
    proto = prepared.checked.proto
    opt = optimizer.lower()
    hyper = hyperparameters(opt, optimizer_options_of(optimizer_options, legacy_options, "generate"))
    train_model, eval_model = prepared.training.proto, prepared.given_inference.proto
    stats = prepared.running_stats
    loss_options = dict(loss_options or {})
    if loss is not None:
        opts = dict(loss_name=loss_name, target_name=target_name, **loss_options)
        train_lossy = add_loss(CheckedModel(train_model), loss, **opts)
        eval_lossy = add_loss(CheckedModel(eval_model), loss, **opts)
    else:
        train_lossy, eval_lossy = train_model, eval_model
        if loss_name not in [o.name for o in proto.graph.output]:
            raise InputError(f"the model has no output {loss_name!r}; pass loss= to append one")
    model_outputs = [o.name for o in eval_model.graph.output if o.name != loss_name]
    trainable = _trainable(train_lossy, requires_grad, frozen, stats)
    inits = {i.name: i for i in train_lossy.graph.initializer}

    graphs = build_gradient(CheckedModel(train_lossy), trainable=trainable, outputs=[loss_name])
    train_step, names = _train_step(graphs, inits, stats, opt, hyper, loss_name, webgpu)
    eval_step = _with_fed_initializers(eval_lossy, [*trainable, *stats], remove=True)
    eval_step = keep_outputs(CheckedModel(eval_step), [loss_name, *model_outputs])
    _reorder_outputs(eval_step, [loss_name, *model_outputs])
    inference = _with_fed_initializers(eval_model, [*trainable, *stats], remove=True)
    for m in (eval_step, inference):
        if webgpu:
            lower_for_webgpu(m)
        m.ir_version = _ir_version(m)
        check_model(m)
    check_targets(
        {FILES["train_step"]: train_step, FILES["eval_step"]: eval_step, FILES["inference"]: inference},
        targets,
    )

    state: dict[str, np.ndarray] = {}
    for name in trainable:
        state[name] = np.array(to_array(inits[name]), copy=True)
    for (param, _key), name in names["state"].items():
        state[name] = np.zeros_like(state[param])
    for name in stats:
        state[name] = np.array(to_array(inits[name]), copy=True)

    manifest = _manifest(
        train_step, eval_step, inference, names, trainable, stats, state, loss, loss_options,
        loss_name, opt, hyper, lr, model_outputs,
    )  # fmt: skip
    result = Artifacts(train_step, eval_step, inference, state, manifest)
    if out_dir is not None:
        result.save(out_dir)
    return result


def _trainable(
    model: onnx.ModelProto, requires_grad: Iterable[str] | None, frozen: Iterable[str], stats: Mapping
) -> list[str]:
    floats = [i.name for i in model.graph.initializer if i.data_type in FLOAT_TYPES and i.name not in stats]
    frozen = set(frozen)
    unknown = frozen - set(floats)
    if unknown:
        raise InputError(f"frozen names {sorted(unknown)} are not floating-point initializers of the model")
    declared = declared_trainable(model)  # a model naming its parameters (LoRA: the adapters)
    if requires_grad is None and declared is not None:
        chosen = [n for n in declared if n in floats]
    elif requires_grad is None:
        chosen = floats
    else:
        chosen = list(dict.fromkeys(requires_grad))
        bad = [n for n in chosen if n not in floats]
        if bad:
            raise InputError(f"{bad} are not trainable initializers (floating-point ones: {floats})")
    chosen = [n for n in chosen if n not in frozen]
    if not chosen:
        raise InputError("nothing to train: every initializer is frozen")
    return chosen


def _train_step(
    graphs: Any,
    inits: Mapping[str, onnx.TensorProto],
    stats: Mapping[str, str],
    optimizer: str,
    hyper: dict,
    loss_name: str,
    webgpu: bool = False,
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """compose(graphs) turned into a step: parameters as inputs, a seed of 1, updates appended
    (``webgpu``: in the forms WebGPU runs, float32 optimizer scalars)."""
    model = compose(graphs, name="train_step")
    g = model.graph
    fed = {*graphs.trainable, *stats}
    kept = [i for i in g.initializer if i.name not in fed]
    del g.initializer[:]
    g.initializer.extend(kept)
    seed = graphs.grad_inputs[loss_name]
    loss_info = next(o for o in g.output if o.name == loss_name)
    loss_type = loss_info.type.tensor_type.elem_type
    batch = [i for i in g.input if i.name != seed and i.name not in fed]
    declared = {i.name: i for i in g.input}
    taken = {v.name for v in (*g.input, *g.output, *g.initializer, *g.value_info)}
    taken |= {o for n in g.node for o in n.output} | {n.name for n in g.node}
    for reserved in (LR, STEP):
        if reserved in taken:
            raise InputError(f"the model already has a value named {reserved!r}, which the step graph needs")
    taken |= {LR, STEP}
    e = _Emitter(g, opset_of(model), loss_type, "optimizer")
    e.taken = taken
    g.node.insert(
        0,
        helper.make_node(
            "Constant", [], [seed], name=unique_name("seed", taken),
            value=onnx.numpy_helper.from_array(np.ones((), np_dtype(loss_type))),
        ),
    )  # fmt: skip

    def tensor_input(name: str, elem: int, dims: list) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, dims)

    params = [tensor_input(n, inits[n].data_type, list(inits[n].dims)) for n in graphs.trainable]
    state_names: dict[tuple[str, str], str] = {}
    state_inputs = []
    for p in params:
        for key in STATE_KEYS(optimizer, hyper):
            name = unique_name(f"{key}/{p.name}", taken)
            state_names[(p.name, key)] = name
            state_inputs.append(tensor_input(name, p.type.tensor_type.elem_type, list(inits[p.name].dims)))
    stat_inputs = [declared.get(n) or tensor_input(n, inits[n].data_type, list(inits[n].dims)) for n in stats]
    scalars = [tensor_input(LR, TensorProto.DOUBLE, []), tensor_input(STEP, TensorProto.INT64, [])]
    del g.input[:]
    g.input.extend([*batch, *scalars, *params, *state_inputs, *stat_inputs])

    updates = [Param(p.name, graphs.grad_outputs[p.name], p.type.tensor_type.elem_type) for p in params]
    scalar_dtype = TensorProto.FLOAT if webgpu else TensorProto.DOUBLE
    new_params, new_state = emit_updates(e, optimizer, hyper, updates, state_names, LR, STEP, scalar_dtype)
    feedback: dict[str, str] = {}  # output -> the input it feeds at the next step
    outputs = [loss_info]
    targets = [(new_params[p.name], p) for p in params]
    targets += [(new_state[k], vi) for k, vi in zip(state_names, state_inputs)]
    targets += [(stats[vi.name], vi) for vi in stat_inputs]
    for value, vi in targets:
        out = unique_name(f"next/{vi.name}", taken)
        g.node.append(helper.make_node("Identity", [value], [out], name=unique_name(f"{out}/id", taken)))
        new = onnx.ValueInfoProto()
        new.CopyFrom(vi)
        new.name = out
        outputs.append(new)
        feedback[out] = vi.name
    del g.output[:]
    g.output.extend(outputs)
    inputs = list(g.input)
    model = keep_outputs(CheckedModel(model), [o.name for o in outputs])  # built by onnxgrad
    del model.graph.input[:]
    model.graph.input.extend(inputs)  # every input stays, even one this optimizer does not read
    _forward_identities(model)
    _keep_transposes_apart(model)
    if webgpu:
        lower_for_webgpu(model)
    _check_standard(model)
    model.ir_version = _ir_version(model)
    check_model(model)
    names = {
        "batch": [i.name for i in model.graph.input if i.name in {b.name for b in batch}],
        "state": state_names,
        "feedback": feedback,
    }
    return model, names


def _forward_identities(model: onnx.ModelProto) -> None:
    """Name the step's outputs at their producers instead of through Identity nodes.

    The value an output-naming Identity reads is renamed to the output's name everywhere (a graph
    output may also feed other nodes), which saves onnxruntime one copy per tensor and step. Values
    that subgraphs read, graph inputs and initializers keep their Identity.
    """
    g = model.graph
    outputs = {o.name for o in g.output}
    fixed = {i.name for i in g.input} | {i.name for i in g.initializer} | outputs
    fixed |= {name for n in g.node for sub in subgraphs(n) for name in _reads(sub)}
    producers = {o for n in g.node for o in n.output}
    renames: dict[str, str] = {}
    drop = []
    for n in g.node:
        if n.op_type != "Identity" or n.output[0] not in outputs:
            continue
        src = n.input[0]
        if src in fixed or src not in producers or src in renames:
            continue
        renames[src] = n.output[0]
        drop.append(n)
    for n in drop:
        g.node.remove(n)
    for n in g.node:
        for k, name in enumerate(n.input):
            if name in renames:
                n.input[k] = renames[name]
        for k, name in enumerate(n.output):
            if name in renames:
                n.output[k] = renames[name]
    infos = [v for v in g.value_info if v.name not in renames]
    del g.value_info[:]
    g.value_info.extend(infos)


def _keep_transposes_apart(model: onnx.ModelProto) -> None:
    """A Transpose of a shared Transpose's output reads it through a no-op Reshape (shape zeros).

    The backward transposes values the forward transposed too (attention's heads: the forward's
    ``K^T`` feeds ``Q K^T``, the backward's ``(K^T)^T`` feeds ``dS K``). Two sessions see the
    forward's value as an input, and onnxruntime folds the second Transpose into the MatMul
    (``FusedMatMul`` with ``transB``). In one graph its MatMul-transpose fusion composes both
    permutations into a new Transpose of the forward's input instead: one more copy per use.
    Through a Reshape, which onnxruntime runs without a copy, the fusion happens as with two
    sessions (anchor transformer step: 11 Transposes -> 8, about 1.5 ms of 74 ms).
    """
    g = model.graph
    producers = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    taken = {v.name for v in (*g.input, *g.output, *g.initializer, *g.value_info)}
    taken |= {o for n in g.node for o in n.output} | {n.name for n in g.node}
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        inner = producers.get(n.input[0]) if n.op_type == "Transpose" and n.input else None
        if inner is not None and inner.op_type == "Transpose" and readers[n.input[0]] > 1:
            perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
            if perm is not None:
                zeros, alias = unique_name("same_shape", taken), unique_name(f"{n.input[0]}/alias", taken)
                value = onnx.numpy_helper.from_array(np.zeros(len(perm), np.int64))
                nodes.append(helper.make_node("Constant", [], [zeros], name=zeros, value=value))
                nodes.append(helper.make_node("Reshape", [n.input[0], zeros], [alias], name=alias))
                n.input[0] = alias
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)


def _reads(graph: onnx.GraphProto) -> set[str]:
    """Every name the nodes of ``graph`` and of its nested subgraphs read."""
    names = {i for n in graph.node for i in n.input}
    for n in graph.node:
        for sub in subgraphs(n):
            names |= _reads(sub)
    return names


def _ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version the model's opsets allow (opset 18: 8, 21: 10), so that the oldest
    runtimes that know the opset load it."""
    standard = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    try:
        return max(8, helper.find_min_ir_version_for(standard, ignore_unknown=True))
    except Exception:  # pragma: no cover - an onnx without the table
        return ir_version_for(model.opset_import)


def _check_standard(model: onnx.ModelProto) -> None:
    odd = sorted({f"{n.domain}.{n.op_type}" for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    if odd:
        raise InputError(
            f"the training step needs ops outside the standard ONNX domain ({odd}); stock onnxruntime "
            "and onnxruntime-web cannot run them"
        )


def _with_fed_initializers(model: onnx.ModelProto, names: Iterable[str], *, remove: bool) -> onnx.ModelProto:
    """A copy of ``model`` with the initializers ``names`` declared as inputs; ``remove`` drops
    their values (then they must be fed), otherwise they stay as defaults."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    g = result.graph
    names = [n for n in names]
    inits = {i.name: i for i in g.initializer}
    declared = {i.name for i in g.input}
    g.input.extend(
        helper.make_tensor_value_info(n, inits[n].data_type, list(inits[n].dims))
        for n in names
        if n in inits and n not in declared
    )
    if remove:
        kept = [i for i in g.initializer if i.name not in set(names)]
        del g.initializer[:]
        g.initializer.extend(kept)
    return result


def _reorder_outputs(model: onnx.ModelProto, order: list[str]) -> None:
    by_name = {o.name: o for o in model.graph.output}
    outs = [by_name[n] for n in order if n in by_name]
    del model.graph.output[:]
    model.graph.output.extend(outs)


def _io(model: onnx.ModelProto) -> dict[str, list[dict[str, Any]]]:
    def spec(vi: onnx.ValueInfoProto) -> dict[str, Any]:
        tt = vi.type.tensor_type
        shape = None
        if tt.HasField("shape"):
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        return {"name": vi.name, "dtype": np_dtype(tt.elem_type).name, "shape": shape}

    inits = {i.name for i in model.graph.initializer}
    return {
        "inputs": [spec(i) for i in model.graph.input if i.name not in inits],
        "outputs": [spec(o) for o in model.graph.output],
    }


def _manifest(
    train_step, eval_step, inference, names, trainable, stats, state, loss, loss_options,
    loss_name, optimizer, hyper, lr, model_outputs,
) -> dict[str, Any]:  # fmt: skip
    def tensor(name: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "dtype": state[name].dtype.name, "shape": list(state[name].shape), **extra}

    train_io = _io(train_step)
    batch = [s for s in train_io["inputs"] if s["name"] in names["batch"]]
    opset = next(o.version for o in train_step.opset_import if o.domain in ("", "ai.onnx"))
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "files": dict(FILES),
        "opset": opset,
        "ir_version": train_step.ir_version,
        "batch": batch,
        "lr": {"name": LR, "dtype": "float64", "default": float(lr)},
        "step": {"name": STEP, "dtype": "int64", "meaning": "updates already made (0 at the first step)"},
        "loss": {"name": loss_name, "kind": loss, "options": loss_options},
        "optimizer": {"name": optimizer, **hyper},
        "parameters": [tensor(n) for n in trainable],
        "optimizer_state": [tensor(v, parameter=p, key=k) for (p, k), v in names["state"].items()],
        "buffers": [tensor(n) for n in stats],
        "model_outputs": list(model_outputs),
        "train_step": {**train_io, "feedback": names["feedback"]},
        "eval_step": _io(eval_step),
        "inference": {**_io(inference), "parameters": [*trainable, *stats]},
    }
