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
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..autodiff.params import require_trainable
from ..autodiff.prepare import prepare
from ..errors import InputError, InputTypeError
from ..model.graph import check_model, np_dtype, to_array
from ..model.load import CheckedModel
from ..train.losses import add_loss, check_loss_options, keep_outputs
from ..train.optimizers import DEFAULT_LR, DEFAULT_OPTIMIZER, check_lr
from ..train.optimizers import optimizer_options as optimizer_options_of
from . import tensors
from .folder import FORMAT, FORMAT_VERSION, MANIFEST
from .optim import hyperparameters
from .step import LR, STEP, build_train_step, lowest_ir_version
from .targets import DEFAULT_TARGETS, check_targets
from .webgpu import WEBGPU, lower_for_webgpu

__all__ = ["FORMAT", "Artifacts", "generate"]

FILES = {
    "train_step": "train_step.onnx",
    "eval_step": "eval_step.onnx",
    "inference": "inference.onnx",
    "state": "state.safetensors",
    "manifest": MANIFEST,
}
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
    *deprecated: Iterable[str] | None,
    trainable: Iterable[str] | None = None,
    frozen: Iterable[str] = (),
    loss: str | None,
    optimizer: str = DEFAULT_OPTIMIZER,
    out_dir: str | os.PathLike | None = None,
    lr: float | None = DEFAULT_LR,
    loss_options: Mapping[str, Any] | None = None,
    loss_name: str = "loss",
    target_name: str = "target",
    targets: Iterable[str] = DEFAULT_TARGETS,
    requires_grad: Iterable[str] | None = None,
    optimizer_options: Mapping[str, Any] | None = None,
    **legacy_options: Any,
) -> Artifacts:
    """Build (and with ``out_dir``, write) the training artifacts of ``model``.

    ``trainable``: the initializers to train (default ``None``: the parameters every front end
    trains, ``build_gradient(model).trainable``: values that the exporter stored once for several
    parameters are trained apart, tied copies of one parameter as one, running statistics and
    constants left out; see :mod:`onnxgrad.autodiff.params`). ``frozen``: names left out of those
    (freezing one copy of a tied parameter freezes the parameter).
    ``loss``: a kind of :func:`onnxgrad.train.add_loss` (its options in ``loss_options``), or
    ``None`` when the model already computes ``loss_name``. ``optimizer``: ``"sgd"``, ``"adam"``
    or ``"adamw"`` (the default, :data:`~onnxgrad.train.optimizers.DEFAULT_OPTIMIZER`), its
    hyperparameters in ``optimizer_options`` (``momentum``, ``nesterov``, ``betas``, ``eps``,
    ``weight_decay``...: the registry's, with its defaults; given as keywords they still work, with
    a :class:`DeprecationWarning`). ``lr`` is only the default the runners use (``None``:
    :data:`~onnxgrad.train.optimizers.DEFAULT_LR`, as everywhere); the step graph takes it as an
    input.
    ``targets``: the runtimes the folder must run on (``"onnxruntime"``, ``"onnxruntime-web"``,
    ``"onnxruntime-web-webgpu"``); an op one of them has no kernel for
    (:mod:`onnxgrad.artifacts.targets`) raises :class:`InputError` naming the op and the runtime,
    before anything is written. With ``"onnxruntime-web-webgpu"`` the graphs are written the way
    WebGPU runs them (:mod:`onnxgrad.artifacts.webgpu`; the other runtimes run those too).

    Deprecated: ``requires_grad`` (by keyword, or positionally after ``model``, then ``frozen``)
    is the old name of ``trainable``.
    """
    trainable, frozen = _deprecated_names(deprecated, requires_grad, trainable, frozen)
    targets = list(targets)
    webgpu = WEBGPU in targets
    lr = check_lr(DEFAULT_LR if lr is None else lr)  # the runners' default: the one check of every door
    opt = optimizer.lower()
    hyper = hyperparameters(opt, optimizer_options_of(optimizer_options, legacy_options, "generate"))
    prepared = prepare(model)  # the one validation: what follows rewrites the checked model
    given = [i.name for i in prepared.checked.proto.graph.input]
    loss_options = check_loss_options(loss_options or {}, given=("loss_name", "target_name"))
    if loss is not None:
        opts = dict(loss_name=loss_name, target_name=target_name, **loss_options)
        prepared = prepare(CheckedModel(add_loss(prepared.checked, loss, **opts)))  # onnxgrad's rewrite
    elif loss_name not in prepared.output_names:
        raise InputError(f"the model has no output {loss_name!r}; pass loss= to append one")
    # the parameters every front end trains, chosen and tied once (as OnnxModule chooses them)
    selected = prepared.select(trainable, frozen=frozen, outputs=[loss_name])
    params = require_trainable(selected.selection.trainable)  # type: ignore[union-attr]
    stats = selected.running_stats
    graphs = selected.gradient_graphs(trainable=params, outputs=[loss_name], tie_weights=False)
    inits = {i.name: i for i in selected.training.proto.graph.initializer}
    step = build_train_step(graphs, inits, stats, opt, hyper, loss_name, webgpu=webgpu)
    train_step = step.model
    eval_model = selected.given_inference.proto
    model_outputs = [o for o in prepared.output_names if o != loss_name]
    eval_step = _with_fed_initializers(eval_model, [*params, *stats], remove=True)
    eval_step = keep_outputs(CheckedModel(eval_step), [loss_name, *model_outputs])
    _reorder_outputs(eval_step, [loss_name, *model_outputs])
    inference = eval_model
    if loss is not None:  # the model as given: the loss, its target and weights gone
        inference = keep_outputs(CheckedModel(eval_model), model_outputs)
        _restore_inputs(inference, eval_model, given)
    inference = _with_fed_initializers(inference, [*params, *stats], remove=True)
    for m in (eval_step, inference):
        if webgpu:
            lower_for_webgpu(m)
        m.ir_version = lowest_ir_version(m)
        check_model(m)
    check_targets(
        {FILES["train_step"]: train_step, FILES["eval_step"]: eval_step, FILES["inference"]: inference},
        targets,
    )

    state: dict[str, np.ndarray] = {}
    for name in params:
        state[name] = np.array(to_array(inits[name]), copy=True)
    for (param, _key), name in step.state.items():
        state[name] = np.zeros_like(state[param])
    for name in stats:
        state[name] = np.array(to_array(inits[name]), copy=True)

    manifest = _manifest(
        step, eval_step, inference, params, stats, state, loss, loss_options,
        loss_name, opt, hyper, lr, model_outputs,
    )  # fmt: skip
    result = Artifacts(train_step, eval_step, inference, state, manifest)
    if out_dir is not None:
        result.save(out_dir)
    return result


def _deprecated_names(
    positional: tuple[Any, ...],
    requires_grad: Iterable[str] | None,
    trainable: Iterable[str] | None,
    frozen: Iterable[str],
) -> tuple[Iterable[str] | None, Iterable[str]]:
    """``(trainable, frozen)`` from the old spellings, ``generate(model, requires_grad, frozen)``
    positionally or ``requires_grad=``, each with a :class:`DeprecationWarning`."""
    if len(positional) > 2:
        raise InputTypeError(f"generate() takes 1 positional argument but {len(positional) + 1} were given")
    if positional:
        old = "generate(model, requires_grad, frozen)"
        if requires_grad is not None or (len(positional) == 2 and frozen != ()):
            raise InputTypeError(f"{old}: an argument given both positionally and by keyword")
        requires_grad = positional[0]
        frozen = positional[1] if len(positional) == 2 else frozen
        message = f"{old} positionally is deprecated: pass trainable= and frozen= by keyword"
    else:
        message = "generate(requires_grad=) is deprecated: pass trainable="
    if requires_grad is None:
        return trainable, frozen
    if trainable is not None:
        raise InputTypeError("generate() got trainable= and its deprecated name requires_grad both")
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return requires_grad, frozen


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


def _restore_inputs(model: onnx.ModelProto, source: onnx.ModelProto, names: list[str]) -> None:
    """Give ``model`` back the inputs ``names`` of ``source`` (in their order), even those that
    nothing reads."""
    inputs = [i for i in source.graph.input if i.name in set(names)]
    del model.graph.input[:]
    model.graph.input.extend(inputs)


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
    step, eval_step, inference, trainable, stats, state, loss, loss_options, loss_name, optimizer,
    hyper, lr, model_outputs,
) -> dict[str, Any]:  # fmt: skip
    def tensor(name: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "dtype": state[name].dtype.name, "shape": list(state[name].shape), **extra}

    train_step = step.model
    train_io = _io(train_step)
    batch = [s for s in train_io["inputs"] if s["name"] in step.batch]
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
        "optimizer_state": [tensor(v, parameter=p, key=k) for (p, k), v in step.state.items()],
        "buffers": [tensor(n) for n in stats],
        "model_outputs": list(model_outputs),
        "train_step": {**train_io, "feedback": step.feedback},
        "eval_step": _io(eval_step),
        "inference": {**_io(inference), "parameters": [*trainable, *stats]},
    }
