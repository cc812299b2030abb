"""A training loop for ONNX models: mini-batches, epochs, validation, callbacks, checkpoints.

:class:`Trainer` appends a loss to the model (or uses the one it computes), runs forward and
backward on onnxruntime through :class:`onnxgrad.ForwardBackward` and updates the live parameter
buffers in place with one of the optimizers of :mod:`onnxgrad.train`. Each epoch appends a record
to a :class:`History` (``loss``, ``val_loss``, ``lr``, metrics, seconds). A checkpoint holds the
parameters, the optimizer state, the shuffling generator, the history and the callbacks' state, so
a run resumed from it continues exactly as if it had never stopped.

The parts live beside it: :mod:`.callbacks` (hooks, early stopping, the accuracy metric),
:mod:`.history` (the per-epoch records), :mod:`.checkpoint` (the file format) and
:mod:`.accumulate` (gradient accumulation); their public names stay importable from here.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..autodiff.params import require_trainable
from ..autodiff.prepare import prepare
from ..errors import InputError, OnnxGradRuntimeError
from ..model.graph import ValueInfo, value_info_from_proto
from ..model.load import CheckedModel
from ..runtime import ForwardBackward
from .accumulate import Accumulated
from .amp import LossScaler, MasterWeightsChoice, mixed_precision
from .callbacks import Callback, EarlyStopping, HistoryFile, Metric, accuracy, accuracy_metric, as_callback
from .checkpoint import CHECKPOINT_FORMAT, read_checkpoint, write_checkpoint  # noqa: F401 (re-exported)
from .data import BatchLoader, Data, as_feeds, check_indices, index_bounds, n_samples
from .history import History, plain
from .losses import LossSpec, add_loss, loss_spec, remove_loss
from .onegraph import one_graph_step
from .optim import OPTIMIZERS, Optimizer, clip_grad_norm, clip_grad_value
from .optimizers import DEFAULT_LR, DEFAULT_OPTIMIZER
from .schedules import LearningRate, LinearWarmup, ReduceLROnPlateau

__all__ = [
    "OPTIMIZERS",
    "Callback",
    "EarlyStopping",
    "History",
    "HistoryFile",
    "Trainer",
    "accuracy",
    "accuracy_metric",
    "input_infos",
    "make_optimizer",
]


def make_optimizer(
    optimizer: str | type[Optimizer] | Callable[[dict[str, np.ndarray]], Optimizer],
    params: dict[str, np.ndarray],
    lr: LearningRate | None = None,
    options: Mapping[str, Any] | None = None,
) -> Optimizer:
    """An optimizer over ``params``: by name (``"sgd"``, ``"adam"``, ``"adamw"``), by class, or from a
    factory ``params -> Optimizer`` (which then sets its own learning rate and options)."""
    options = dict(options or {})
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise InputError(f"unknown optimizer {optimizer!r}; expected one of {list(OPTIMIZERS)}")
        optimizer = OPTIMIZERS[optimizer.lower()]
    if isinstance(optimizer, type) and issubclass(optimizer, Optimizer):
        return optimizer(params, lr=DEFAULT_LR if lr is None else lr, **options)
    if not callable(optimizer):
        raise InputError(f"optimizer must be a name, an Optimizer class or a factory, got {optimizer!r}")
    if lr is not None or options:
        raise InputError(
            "an optimizer factory sets its own lr and options: do not pass lr= or optimizer_options="
        )
    opt = optimizer(params)
    if not isinstance(opt, Optimizer):
        raise InputError(f"the optimizer factory returned {type(opt).__name__}, not an onnxgrad Optimizer")
    return opt


def input_infos(fb: ForwardBackward) -> dict[str, ValueInfo]:
    """Type and shape of each input ``fb.forward`` takes (parameters excluded), by name."""
    infos = {vi.name: value_info_from_proto(vi) for vi in fb.graphs.forward.graph.input}
    return {name: info for name in fb.input_names if (info := infos.get(name)) is not None}


# ---- the trainer -------------------------------------------------------------------------------
class Trainer:
    """Fits an ONNX model on numpy data with onnxruntime.

    ``model``: an ONNX model (proto, path or bytes), or a :class:`ForwardBackward` whose model
    computes ``loss_name``. ``loss``: a kind of :func:`onnxgrad.train.add_loss` to append (its
    keyword arguments in ``loss_options``: ``output``, ``weight_name``, ``delta``, ``l1``, ``l2``...),
    or ``None`` when the model already has the ``loss_name`` output.
    ``optimizer``: ``"adamw"`` (the default, :data:`~onnxgrad.train.optimizers.DEFAULT_OPTIMIZER`),
    ``"adam"``, ``"sgd"``, an Optimizer class (with ``lr`` — a number or
    a schedule — and ``optimizer_options``) or a factory ``params -> Optimizer``.
    ``seed`` seeds the shuffling; ``metrics``: name -> ``fn(outputs, batch) -> float`` computed on
    the validation data (outputs by name; averaged over batches weighted by their size).
    ``one_graph``: run each step as one onnxruntime run (forward, loss, backward and the update of
    SGD, Adam or AdamW in one graph, :mod:`onnxgrad.train.onegraph`) where the model allows; the
    numpy optimizer keeps the state, so the numbers, checkpoints and callbacks are the same. Models
    with PythonOp, Dropout or BatchNormalization, and other optimizers, run forward,
    backward and the numpy update (a debug log of ``onnxgrad.train.onegraph`` says why);
    :attr:`step_path` tells which runs.
    ``trainable`` / ``frozen``: the parameters, chosen as every front end chooses them
    (:func:`onnxgrad.autodiff.params.select_parameters`): ``None`` the model's parameters, less
    the ``frozen`` names (any copy of a tied parameter freezes it).
    ``recompute``: activations rebuilt in the backward instead of kept (see ``build_gradient``).
    ``accumulate``: optimizer updates every ``accumulate`` mini-batches, with the gradient of the
    mean loss over those samples (the same update as one batch of their concatenation). The last
    update of an epoch takes the batches left (5 batches, ``accumulate=2``: 3 updates), with the
    mean over the samples it accumulated, not torch loops' ``loss / accumulate``, which would shrink
    it (:mod:`onnxgrad.train.accumulate`). ``clip_norm``: the gradients are scaled to this
    global L2 norm at most (``torch.nn.utils.clip_grad_norm_``); ``clip_value``: each element is
    clipped to ``[-clip_value, clip_value]``. The three run forward, backward and the numpy update
    (the two-session path). A :class:`ReduceLROnPlateau` given as ``lr`` is stepped at the end of
    every epoch with its ``monitor`` value.
    ``providers`` / ``session_options``: the onnxruntime providers and ``SessionOptions`` of every
    session the trainer makes (forward, backward, the one-graph step, evaluation). A model whose
    blocked (4-bit) DequantizeLinear feeds a MatMul, which onnxruntime fuses into a MatMulNBits
    that quantizes the activations, gets by default options under which the fused kernel computes
    in float, as the graph differentiated; options given without that setting are used as they
    are, with a warning (the policy of every session, :mod:`onnxgrad.runtime.options`).
    ``quantized``: the gradient through quantization ops, ``"ste"``, ``"zero"`` or ``"refuse"`` (see
    ``build_gradient``).
    ``master_weights`` / ``loss_scale``: mixed precision for float16 and bfloat16 models
    (:mod:`onnxgrad.train.amp`): the optimizer updates float32 copies of the half-precision
    parameters, rounded into the model after each step; the backward is seeded with a dynamic loss
    scale (``torch.amp.GradScaler``: a step with inf / NaN gradients, in any of the micro-batches
    it accumulates, is skipped and the scale halved once; it doubles after 2000 good steps).
    ``"auto"`` (the defaults): master weights when a parameter is float16 or bfloat16
    (:func:`~onnxgrad.train.amp.use_master_weights`, the rule ``OnnxModule`` follows too), dynamic
    scaling when one is float16; ``loss_scale`` also takes a number (a static scale), a
    :class:`~onnxgrad.train.amp.LossScaler` or ``None``. Either runs the two-session path.
    """

    def __init__(
        self,
        model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes | ForwardBackward,
        *,
        loss: str | None = None,
        loss_options: Mapping[str, Any] | None = None,
        optimizer: str | type[Optimizer] | Callable[[dict[str, np.ndarray]], Optimizer] = DEFAULT_OPTIMIZER,
        lr: LearningRate | None = None,
        optimizer_options: Mapping[str, Any] | None = None,
        batch_size: int = 32,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int | None = 0,
        callbacks: Sequence[Callback | Callable[..., Any]] = (),
        metrics: Mapping[str, Metric] | None = None,
        progress: bool = True,
        trainable: Iterable[str] | None = None,
        providers: str | Sequence[Any] | None = None,
        session_options: Any = None,
        loss_name: str = "loss",
        eval_batch_size: int | None = None,
        one_graph: bool = True,
        recompute: Any = None,
        accumulate: int = 1,
        clip_norm: float | None = None,
        clip_value: float | None = None,
        quantized: str = "ste",
        master_weights: MasterWeightsChoice = "auto",
        loss_scale: str | float | LossScaler | None = "auto",
        frozen: Iterable[str] = (),
    ) -> None:
        if not (isinstance(accumulate, int) and accumulate >= 1):
            raise InputError(f"accumulate must be an integer >= 1, got {accumulate!r}")
        for key, value in (("clip_norm", clip_norm), ("clip_value", clip_value)):
            if value is not None and not value > 0:
                raise InputError(f"{key} must be > 0, got {value}")
        if isinstance(model, ForwardBackward):
            if loss is not None:
                raise InputError("loss= needs an ONNX model; a ForwardBackward already has its outputs")
            if session_options is not None or providers is not None:
                raise InputError(
                    "session_options= and providers= go to the ForwardBackward given as the model "
                    "(its sessions are made)"
                )
            if trainable is not None or frozen:
                raise InputError(
                    "trainable= and frozen= go to the ForwardBackward given as the model (its "
                    "parameters are chosen)"
                )
            fb = model
        else:
            prepared = prepare(model)  # the one validation: add_loss rewrites the checked model
            proto = prepared.checked.proto
            if loss is not None:
                proto = add_loss(prepared.checked, loss, loss_name=loss_name, **dict(loss_options or {}))
                prepared = prepare(CheckedModel(proto))
            elif loss_name not in (outputs := [o.name for o in proto.graph.output]):
                raise InputError(
                    f"the model has no output {loss_name!r} (outputs: {outputs}); pass loss= to append one"
                )
            fb = ForwardBackward(
                prepared,
                trainable=trainable,
                frozen=frozen,
                outputs=[loss_name],
                providers=providers,
                session_options=session_options,
                recompute=recompute,
                quantized=quantized,
            )
        if loss_name not in fb.output_names or loss_name not in fb.graphs.grad_inputs:
            raise InputError(
                f"the model has no output {loss_name!r} taking a gradient (outputs: {fb.output_names}); "
                f"pass loss= to append one"
            )
        require_trainable(fb.graphs.trainable)  # inputs alone give an optimizer nothing to update
        self.fb, self.loss_name, self.added_loss = fb, loss_name, loss is not None
        self.loss_index = fb.output_names.index(loss_name)
        self.amp = mixed_precision(fb.parameters, master_weights, loss_scale)
        params = self.amp.params if self.amp is not None else fb.parameters  # float32 masters
        self.optimizer = make_optimizer(optimizer, params, lr, optimizer_options)
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.eval_batch_size = eval_batch_size or max(batch_size, 256)
        self.callbacks = [as_callback(c) for c in callbacks]
        self.metrics = dict(metrics or {})
        self.progress = progress
        self.rng = np.random.default_rng(seed)
        self.history = History()
        self.epoch = 0  # epochs completed
        self.stop_training = False
        self.has_validation = False
        self.inputs = input_infos(fb)
        # how add_loss made the loss (None for a model's own): labels to check, batch normalizers
        self.loss_spec: LossSpec | None = loss_spec(fb.graphs.forward)
        self._index_bounds = index_bounds(fb.graphs.forward)  # token ids within their tables
        self.accumulate, self.clip_norm, self.clip_value = accumulate, clip_norm, clip_value
        self.plateau = _plateau(self.optimizer.schedule)
        if self.plateau is not None:  # its state is this trainer's run's, not an earlier trainer's
            self.plateau.reset()
        # recomputation saves memory between the forward and the backward session, accumulation and
        # clipping work on the gradients between backward and update: two sessions then
        two_sessions = recompute is not None or accumulate > 1 or clip_norm or clip_value
        two_sessions = two_sessions or self.amp is not None
        self._one_graph = (
            one_graph_step(fb, self.optimizer, loss_name) if one_graph and not two_sessions else None
        )
        self.updates = 0  # optimizer updates made by this trainer's fit runs
        # what the caller wants a checkpoint to record about the run (data file, split...): compared
        # on resume with the rest of setup()
        self.run_info: dict[str, Any] = {}
        self.changed_since_checkpoint: dict[str, tuple[Any, Any]] = {}

    @property
    def step_path(self) -> str:
        """``"one graph"`` when each step is one onnxruntime run, ``"two sessions"`` otherwise."""
        return "one graph" if self._one_graph is not None else "two sessions"

    # ---- parameters ----------------------------------------------------------------------------
    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """The live parameter buffers (the optimizer updates them in place)."""
        return self.fb.parameters

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Copy ``values`` into the live buffers, keeping the optimizer attached to them."""
        params = self.fb.parameters
        for name, value in values.items():
            if name not in params:
                raise InputError(f"{name!r} is not a trainable parameter (have {list(params)})")
            value = np.asarray(value)
            if value.shape != params[name].shape:
                raise InputError(f"parameter {name!r} has shape {params[name].shape}, got {value.shape}")
            np.copyto(params[name], value)
        if self.amp is not None and self.amp.weights is not None:  # the float32 masters follow
            self.amp.weights.load({k: v for k, v in values.items() if k in params})

    def to_onnx(self) -> onnx.ModelProto:
        """The model with the trained parameters, without the loss when the trainer appended it."""
        model = self.fb.to_onnx()
        return remove_loss(model, self.loss_name) if self.added_loss else model

    # ---- training ------------------------------------------------------------------------------
    def fit(
        self,
        data: Data,
        val_data: Data | None = None,
        *,
        epochs: int = 1,
        checkpoint: str | os.PathLike | None = None,
        resume: str | os.PathLike | None = None,
    ) -> History:
        """Train until ``epochs`` epochs are done in total (a resumed run counts those already done).

        ``data`` / ``val_data``: input name -> array, the target and weights included.
        ``checkpoint``: written at the end of every epoch; ``resume``: a checkpoint to start from.
        """
        train = as_feeds(data, self.inputs)
        if not n_samples(train):
            raise InputError("the training data has 0 samples: there is nothing to train on")
        val = self._eval_data(val_data, "the validation data") if val_data is not None else None
        self._check_values(train, "the training data")  # before anything runs
        if resume is not None:
            self.load_checkpoint(resume)
            if self.changed_since_checkpoint:
                changes = "; ".join(
                    f"{k} {a!r} -> {b!r}" for k, (a, b) in self.changed_since_checkpoint.items()
                )
                warnings.warn(
                    f"resuming {os.fspath(resume)!r} with settings changed since the checkpoint: {changes}",
                    stacklevel=2,
                )
        self.has_validation = val is not None
        self.stop_training = False
        if self.plateau is not None and self.plateau.monitor.startswith("val_") and val is None:
            raise InputError(
                f"ReduceLROnPlateau monitors {self.plateau.monitor!r} but fit() got no validation data"
            )
        loader = BatchLoader(
            train, self.batch_size, shuffle=self.shuffle, drop_last=self.drop_last, rng=self.rng
        )
        for cb in self.callbacks:
            cb.on_train_begin(self)
        bar = self._bar(max(epochs - self.epoch, 0) * len(loader), _epoch_label(self.epoch + 1, epochs))
        try:
            while self.epoch < epochs and not self.stop_training:
                self._run_epoch(loader, val, epochs, bar)
                if checkpoint is not None:
                    self.save_checkpoint(checkpoint)
        finally:
            if bar is not None:
                bar.close()
        for cb in self.callbacks:
            cb.on_train_end(self)
        return self.history

    def _run_epoch(
        self, loader: BatchLoader, val: dict[str, np.ndarray] | None, epochs: int, bar: Any
    ) -> None:
        epoch = self.epoch + 1
        start = time.perf_counter()
        for cb in self.callbacks:
            cb.on_epoch_begin(self, epoch)
        if bar is not None:
            # shown now: a bar refreshes every `miniters` updates, which fast first batches make
            # large, so a description left to the next refresh could show epoch 1 all run long
            bar.set_description(_epoch_label(epoch, epochs), refresh=True)
        total, seen = 0.0, 0.0  # Σ D_b L_b and Σ D_b (the batches' normalizers)
        summed = self._summed
        pending: Accumulated | None = None  # gradients of the batches of the next update
        last = len(loader) - 1
        for step, batch in enumerate(loader):
            if self._one_graph is not None:
                loss, _applied = self._one_graph.run(batch)  # not applied when the loss is not finite
            else:
                result = self.fb.forward(batch)
                loss = float(result.outputs[self.loss_index])
            if not math.isfinite(loss):
                raise OnnxGradRuntimeError(
                    f"the loss is {loss} at epoch {epoch}, batch {step + 1}: "
                    "lower the learning rate, or check the data for NaN and infinite values"
                )
            n = len(next(iter(batch.values())))
            weight = self._normalizer(batch)
            if self._one_graph is not None:
                self._updated({"loss": loss, "lr": self.optimizer.lr})
            else:
                # the loss alone takes a gradient, even when the model's other outputs could take one
                seed = {self.loss_name: np.ones_like(result.outputs[self.loss_index])}
                if self.amp is not None:  # the scaled loss's gradient, then float32 and unscaled
                    seed = {k: self.amp.seed(v) for k, v in seed.items()}
                    grads = self.amp.unscale(result.backward(seed))
                else:
                    grads = result.backward(seed)
                pending = Accumulated.add(pending, grads, loss, n, weight)
                if pending.batches == self.accumulate or step == last:
                    self._apply(pending)
                    pending = None
            total, seen = total + loss * weight, seen + weight
            if bar is not None:  # the epoch's running loss
                bar.set_postfix(loss=f"{_combined(total, seen, summed):.4g}", refresh=False)
                bar.update()
            for cb in self.callbacks:
                cb.on_batch_end(self, step, {"loss": loss, "batch_size": n})
        logs: dict[str, Any] = {"epoch": epoch, "loss": _combined(total, seen, summed)}
        logs["lr"] = self.optimizer.lr
        if val is not None:
            logs.update({f"val_{k}": v for k, v in self._evaluate(val).items()})
        logs["seconds"] = time.perf_counter() - start
        self.epoch = epoch
        self.history.append(logs)
        if bar is not None:  # the epoch's figures: losses and metrics (val_acc...)
            bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items() if k not in ("epoch", "lr", "seconds")})
        if self.plateau is not None:
            if self.plateau.monitor not in logs:
                raise InputError(
                    f"ReduceLROnPlateau monitors {self.plateau.monitor!r}, "
                    f"not in the epoch's logs {list(logs)}"
                )
            self.plateau.step(logs[self.plateau.monitor])
        for cb in self.callbacks:
            cb.on_epoch_end(self, epoch, logs)

    def _apply(self, pending: Accumulated) -> None:
        """Clip the accumulated gradients as asked, update the parameters, tell the callbacks."""
        grads = pending.total() if self._summed else pending.mean()
        logs: dict[str, Any] = {"loss": pending.concatenated_loss(self._summed)}
        if self.clip_value is not None:
            clip_grad_value(grads, self.clip_value)
        if self.clip_norm is not None:
            logs["grad_norm"] = clip_grad_norm(grads, self.clip_norm)
        if self.amp is not None:  # skipped when a gradient holds inf / NaN
            self.amp.step(self.optimizer, grads)
            if self.amp.scaler is not None:
                logs["loss_scale"] = self.amp.scaler.scale
        else:
            self.optimizer.step(grads)
        logs["lr"] = self.optimizer.lr
        self._updated(logs)

    def _updated(self, logs: Mapping[str, Any]) -> None:
        self.updates += 1
        for cb in self.callbacks:
            cb.on_step_end(self, self.updates, logs)

    def _bar(self, total: int, desc: str) -> Any:
        """One tqdm bar over every batch of a ``fit`` run (its description names the epoch), or
        ``None`` (no progress wanted, or no tqdm)."""
        if not self.progress:
            return None
        try:
            from tqdm.auto import tqdm
        except ModuleNotFoundError:  # an optional dependency: train without a bar
            return None
        return tqdm(
            total=total,
            desc=desc,
            unit="batch",
            leave=True,
            file=sys.stderr,
        )

    def evaluate(self, data: Data) -> dict[str, float]:
        """The loss (and metrics) on ``data``, without training: the loss of the whole set, as one
        batch of it would give (batches combined by the loss's normalizer), the metrics averaged
        over batches weighted by their size."""
        return self._evaluate(self._eval_data(data, "the data"))

    def _eval_data(self, data: Data, what: str) -> dict[str, np.ndarray]:
        """``data`` checked for evaluation: the model's inputs as :func:`as_feeds` makes them, plus,
        when the trainer has metrics, the arrays that are not model inputs (extra targets a metric
        reads), as given; every array with the same number of samples, at least one."""
        extra = {k: np.asarray(v) for k, v in data.items() if k not in self.inputs} if self.metrics else {}
        feeds = as_feeds(data, self.inputs, allow_extra=bool(extra))
        n = n_samples(feeds)
        if not n:
            raise InputError(f"{what} has 0 samples: there is nothing to evaluate")
        for name, arr in extra.items():
            if arr.ndim == 0 or len(arr) != n:
                raise InputError(
                    f"{what}: the array {name!r} (for the metrics) has shape {arr.shape}, "
                    f"the model inputs have {n} samples"
                )
        self._check_values(feeds, what)
        return {**feeds, **extra}

    def _check_values(self, feeds: Mapping[str, np.ndarray], what: str) -> None:
        """Refuse values the graph cannot take: class labels outside ``[0, C)`` (other than
        ``ignore_index``), token ids beyond their embedding table."""
        if self.loss_spec is not None:
            self.loss_spec.check(feeds, what)
        check_indices(feeds, self._index_bounds, what)

    def _normalizer(self, batch: Mapping[str, np.ndarray]) -> float:
        """What the loss of ``batch`` was divided by (its sample count for a model's own loss)."""
        if self.loss_spec is None:
            return float(len(next(iter(batch.values()))))
        return self.loss_spec.normalizer(batch)

    @property
    def _summed(self) -> bool:
        """Whether the loss adds the samples' losses up (``reduction="sum"``) rather than averaging."""
        return self.loss_spec is not None and self.loss_spec.reduction == "sum"

    def _evaluate(self, data: dict[str, np.ndarray]) -> dict[str, float]:
        sums = dict.fromkeys(self.metrics, 0.0)
        loss, weights, seen = 0.0, 0.0, 0
        names = self.fb.output_names
        for batch in BatchLoader(data, self.eval_batch_size, shuffle=False):
            feeds = {k: v for k, v in batch.items() if k in self.inputs}
            outputs = self.fb.forward(feeds, training=False).outputs
            n = len(next(iter(feeds.values())))
            weight = self._normalizer(feeds)
            loss, weights = loss + float(outputs[self.loss_index]) * weight, weights + weight
            by_name = dict(zip(names, outputs))
            for key, fn in self.metrics.items():
                sums[key] += float(fn(by_name, batch)) * n
            seen += n
        return {"loss": _combined(loss, weights, self._summed), **{k: v / seen for k, v in sums.items()}}

    def plot(self, path: str | os.PathLike, title: str | None = None) -> str:
        """A PNG of the training and validation loss curves."""
        return self.history.plot(path, title=title)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Write parameters, optimizer state, shuffling state, history and callbacks to ``path``
        (an ``.npz`` file, no pickled objects); written to a temporary file first, then moved."""
        state = {
            "epoch": self.epoch,
            "rng": self.rng.bit_generator.state,
            "history": self.history.records,
            "params": self.fb.parameters,
            "optimizer_type": type(self.optimizer).__name__,
            "optimizer": self.optimizer.state_dict(),
            "callbacks": [cb.state_dict() for cb in self.callbacks],
            "schedule": self.plateau.state_dict() if self.plateau is not None else None,
            "setup": self.setup(),
            "amp": self.amp.state_dict() if self.amp is not None else None,
        }
        return write_checkpoint(path, state)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` for the same model and setup."""
        path = os.fspath(path)
        state = read_checkpoint(path)
        params = self.fb.parameters
        if sorted(state["params"]) != sorted(params):
            raise InputError(
                f"checkpoint {path!r} holds parameters {sorted(state['params'])}, "
                f"the model has {sorted(params)}"
            )
        if state["optimizer_type"] != type(self.optimizer).__name__:
            raise InputError(
                f"checkpoint {path!r} was written with {state['optimizer_type']}, this trainer uses "
                f"{type(self.optimizer).__name__}"
            )
        if len(state["callbacks"]) != len(self.callbacks):
            raise InputError(
                f"checkpoint {path!r} has the state of {len(state['callbacks'])} callbacks, "
                f"this trainer has {len(self.callbacks)}"
            )
        self.set_parameters(state["params"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.amp is not None and state.get("amp"):
            self.amp.load_state_dict(state["amp"])
        for cb, cb_state in zip(self.callbacks, state["callbacks"]):
            cb.load_state_dict(cb_state)
        if self.plateau is not None and state.get("schedule"):
            self.plateau.load_state_dict(state["schedule"])
        self.rng.bit_generator.state = state["rng"]
        self.history = History(state["history"])
        self.epoch = int(state["epoch"])
        before, now = state.get("setup") or {}, self.setup()
        self.changed_since_checkpoint = {
            k: (before[k], now.get(k)) for k in before if plain(before[k]) != plain(now.get(k))
        }

    def setup(self) -> dict[str, Any]:
        """The settings a checkpoint records so that a resumed run can say what changed: batch size,
        accumulation, clipping, the optimizer and its learning rate (the schedule's first value)."""
        opt = self.optimizer
        options = {
            k: v
            for k, v in vars(opt).items()
            if isinstance(v, int | float | bool | tuple) and k not in ("iterations", "lr")
        }
        return {
            **self.run_info,
            "batch_size": self.batch_size,
            "accumulate": self.accumulate,
            "clip_norm": self.clip_norm,
            "clip_value": self.clip_value,
            "optimizer": type(opt).__name__,
            "lr": _base_lr(opt.schedule),
            "schedule": type(opt.schedule).__name__,
            **{f"optimizer.{k}": list(v) if isinstance(v, tuple) else v for k, v in sorted(options.items())},
        }


def _plateau(schedule: Any) -> ReduceLROnPlateau | None:
    """The :class:`ReduceLROnPlateau` of a schedule, given as is or after a warm-up."""
    if isinstance(schedule, LinearWarmup):
        schedule = schedule.after
    return schedule if isinstance(schedule, ReduceLROnPlateau) else None


def _base_lr(schedule: Any) -> float:
    """The learning rate a schedule starts from (after its warm-up), for comparing two setups."""
    if isinstance(schedule, LinearWarmup):
        schedule = schedule.after
    return float(schedule.lr) if isinstance(getattr(schedule, "lr", None), float) else float(schedule(0))


def _combined(total: float, weights: float, summed: bool) -> float:
    """The loss of batches put together from ``Σ D_b L_b`` and ``Σ D_b``: their quotient, or the
    sum itself for ``reduction="sum"`` (every ``D_b`` 1)."""
    if summed:
        return total
    return total / weights if weights else math.nan


def _epoch_label(epoch: int, epochs: int) -> str:
    """The progress bar's description: ``'epoch  3/15'`` (aligned, so the bar does not jump)."""
    return f"epoch {epoch:>{len(str(epochs))}}/{epochs}"
