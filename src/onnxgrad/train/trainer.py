"""A training loop for ONNX models: mini-batches, epochs, validation, callbacks, checkpoints.

:class:`Trainer` appends a loss to the model (or uses the one it computes), runs forward and
backward on onnxruntime through :class:`onnxgrad.ForwardBackward` and updates the live parameter
buffers in place with one of the optimizers of :mod:`onnxgrad.train`. Each epoch appends a record
to a :class:`History` (``loss``, ``val_loss``, ``lr``, metrics, seconds). A checkpoint holds the
parameters, the optimizer state, the shuffling generator, the history and the callbacks' state, so
a run resumed from it continues exactly as if it had never stopped.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..autodiff.prepare import prepare
from ..errors import InputError, OnnxGradRuntimeError
from ..model.graph import ValueInfo, value_info_from_proto
from ..model.load import CheckedModel
from ..runtime import ForwardBackward
from .data import BatchLoader, Data, as_feeds
from .losses import add_loss, remove_loss
from .onegraph import one_graph_step
from .optim import SGD, Adam, AdamW, Optimizer
from .plot import plot_curves
from .schedules import LearningRate

__all__ = ["OPTIMIZERS", "Callback", "EarlyStopping", "History", "Trainer", "input_infos", "make_optimizer"]

OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
Metric = Callable[[Mapping[str, np.ndarray], Mapping[str, np.ndarray]], float]
CHECKPOINT_FORMAT = 1


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
        return optimizer(params, lr=1e-3 if lr is None else lr, **options)
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


# ---- history -----------------------------------------------------------------------------------
class History:
    """One record (a dict) per epoch; ``history["loss"]`` is the list of one key across epochs."""

    def __init__(self, records: Iterable[Mapping[str, Any]] = ()) -> None:
        self.records: list[dict[str, Any]] = [dict(r) for r in records]

    def append(self, record: Mapping[str, Any]) -> None:
        self.records.append(dict(record))

    def __getitem__(self, key: str) -> list[Any]:
        if not any(key in r for r in self.records):
            raise KeyError(f"no {key!r} in the history (keys: {self.keys()})")
        return [r.get(key, math.nan) for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def keys(self) -> list[str]:
        return list(dict.fromkeys(k for r in self.records for k in r))

    def to_dict(self) -> dict[str, list[Any]]:
        return {k: self[k] for k in self.keys()}

    def plot(
        self, path: str | os.PathLike, keys: Sequence[str] | None = None, title: str | None = None
    ) -> str:
        """A PNG of the loss curves (default: ``loss`` and ``val_loss``) against the epoch."""
        keys = list(keys) if keys is not None else [k for k in ("loss", "val_loss") if k in self.keys()]
        epochs = self["epoch"] if self.records else []
        return plot_curves({k: self[k] for k in keys}, path, x=epochs, title=title)

    def __repr__(self) -> str:
        last = self.records[-1] if self.records else {}
        return f"History({len(self)} epochs, last={last})"


# ---- callbacks ---------------------------------------------------------------------------------
class Callback:
    """Hooks called by :meth:`Trainer.fit`; override the ones needed.

    ``logs`` of ``on_batch_end`` has ``loss`` and ``batch_size``; ``logs`` of ``on_epoch_end`` is the
    epoch's history record. Setting ``trainer.stop_training = True`` ends the run after the epoch.
    A callback with state (counters, best values) returns it from :meth:`state_dict` (numbers,
    strings, lists, dicts and numpy arrays) so that checkpoints carry it.
    """

    def on_train_begin(self, trainer: Trainer) -> None: ...

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None: ...

    def on_batch_end(self, trainer: Trainer, step: int, logs: Mapping[str, Any]) -> None: ...

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: Mapping[str, Any]) -> None: ...

    def on_train_end(self, trainer: Trainer) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class _EpochEndFunction(Callback):
    """A plain function ``fn(trainer, epoch, logs)`` called at the end of each epoch."""

    def __init__(self, fn: Callable[[Trainer, int, Mapping[str, Any]], Any]) -> None:
        self.fn = fn

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: Mapping[str, Any]) -> None:
        self.fn(trainer, epoch, logs)


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` epochs.

    With ``restore_best``, the parameters of the best epoch are put back when it stops.
    """

    def __init__(
        self, monitor: str = "val_loss", patience: int = 5, min_delta: float = 0.0, restore_best: bool = True
    ) -> None:
        if patience < 1:
            raise InputError(f"patience must be >= 1, got {patience}")
        self.monitor, self.patience, self.min_delta = monitor, int(patience), float(min_delta)
        self.restore_best = restore_best
        self.best, self.best_epoch, self.wait, self.stopped_epoch = math.inf, 0, 0, 0
        self.best_params: dict[str, np.ndarray] | None = None

    def on_train_begin(self, trainer: Trainer) -> None:
        if self.monitor.startswith("val_") and not trainer.has_validation:
            raise InputError(f"EarlyStopping monitors {self.monitor!r} but fit() got no validation data")

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: Mapping[str, Any]) -> None:
        if self.monitor not in logs:
            raise InputError(f"EarlyStopping monitors {self.monitor!r}, not in the epoch's logs {list(logs)}")
        value = float(logs[self.monitor])
        if value < self.best - self.min_delta:
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best:
                params = trainer.fb.parameters
                if self.best_params is None:
                    self.best_params = {k: v.copy() for k, v in params.items()}
                else:  # reuse the buffers: no allocation per improvement
                    for k, v in params.items():
                        np.copyto(self.best_params[k], v)
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.stop_training = True
            self.stopped_epoch = epoch
            if self.restore_best and self.best_params is not None:
                trainer.set_parameters(self.best_params)

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "wait": self.wait,
            "stopped_epoch": self.stopped_epoch,
            "best_params": self.best_params,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.best_epoch = float(state["best"]), int(state["best_epoch"])
        self.wait, self.stopped_epoch = int(state["wait"]), int(state["stopped_epoch"])
        bp = state["best_params"]
        self.best_params = None if bp is None else {k: np.array(v) for k, v in bp.items()}


# ---- the trainer -------------------------------------------------------------------------------
class Trainer:
    """Fits an ONNX model on numpy data with onnxruntime.

    ``model``: an ONNX model (proto, path or bytes), or a :class:`ForwardBackward` whose model
    computes ``loss_name``. ``loss``: a kind of :func:`onnxgrad.train.add_loss` to append (its
    keyword arguments in ``loss_options``: ``output``, ``weight_name``, ``delta``, ``l1``, ``l2``...),
    or ``None`` when the model already has the ``loss_name`` output.
    ``optimizer``: ``"sgd"``, ``"adam"``, ``"adamw"``, an Optimizer class (with ``lr`` — a number or
    a schedule — and ``optimizer_options``) or a factory ``params -> Optimizer``.
    ``seed`` seeds the shuffling; ``metrics``: name -> ``fn(outputs, batch) -> float`` computed on
    the validation data (outputs by name; averaged over batches weighted by their size).
    ``one_graph``: run each step as one onnxruntime run (forward, loss, backward and the update of
    SGD, Adam or AdamW in one graph, :mod:`onnxgrad.train.onegraph`) where the model allows; the
    numpy optimizer keeps the state, so the numbers, checkpoints and callbacks are the same. Models
    with PythonOp, Dropout, BatchNormalization or tied weights, and other optimizers, run forward,
    backward and the numpy update (a debug log of ``onnxgrad.train.onegraph`` says why);
    :attr:`step_path` tells which runs.
    ``recompute``: activations rebuilt in the backward instead of kept (see ``build_gradient``).
    ``quantized``: the gradient through quantization ops, ``"ste"``, ``"zero"`` or ``"refuse"`` (see
    ``build_gradient``).
    """

    def __init__(
        self,
        model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes | ForwardBackward,
        *,
        loss: str | None = None,
        loss_options: Mapping[str, Any] | None = None,
        optimizer: str | type[Optimizer] | Callable[[dict[str, np.ndarray]], Optimizer] = "adam",
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
        loss_name: str = "loss",
        eval_batch_size: int | None = None,
        one_graph: bool = True,
        recompute: Any = None,
        quantized: str = "ste",
    ) -> None:
        if isinstance(model, ForwardBackward):
            if loss is not None:
                raise InputError("loss= needs an ONNX model; a ForwardBackward already has its outputs")
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
                outputs=[loss_name],
                providers=providers,
                recompute=recompute,
                quantized=quantized,
            )
        if loss_name not in fb.output_names or loss_name not in fb.graphs.grad_inputs:
            raise InputError(
                f"the model has no output {loss_name!r} taking a gradient (outputs: {fb.output_names}); "
                f"pass loss= to append one"
            )
        self.fb, self.loss_name, self.added_loss = fb, loss_name, loss is not None
        self.loss_index = fb.output_names.index(loss_name)
        self.optimizer = make_optimizer(optimizer, fb.parameters, lr, optimizer_options)
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.eval_batch_size = eval_batch_size or max(batch_size, 256)
        self.callbacks = [c if isinstance(c, Callback) else _EpochEndFunction(c) for c in callbacks]
        self.metrics = dict(metrics or {})
        self.progress = progress
        self.rng = np.random.default_rng(seed)
        self.history = History()
        self.epoch = 0  # epochs completed
        self.stop_training = False
        self.has_validation = False
        self.inputs = input_infos(fb)
        # recomputation saves memory between the forward and the backward session: two sessions then
        self._one_graph = (
            one_graph_step(fb, self.optimizer, loss_name) if one_graph and recompute is None else None
        )

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
        val = as_feeds(val_data, self.inputs) if val_data is not None else None
        if resume is not None:
            self.load_checkpoint(resume)
        self.has_validation = val is not None
        self.stop_training = False
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
            bar.set_description(_epoch_label(epoch, epochs), refresh=False)
        total, seen = 0.0, 0
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
            if self._one_graph is None:
                # the loss alone takes a gradient, even when the model's other outputs could take one
                seed = {self.loss_name: np.ones_like(result.outputs[self.loss_index])}
                self.optimizer.step(result.backward(seed))
            n = len(next(iter(batch.values())))
            total, seen = total + loss * n, seen + n
            if bar is not None:
                bar.set_postfix(loss=f"{total / seen:.4g}", refresh=False)  # the epoch's running mean
                bar.update()
            for cb in self.callbacks:
                cb.on_batch_end(self, step, {"loss": loss, "batch_size": n})
        logs: dict[str, Any] = {"epoch": epoch, "loss": total / seen if seen else math.nan}
        logs["lr"] = self.optimizer.lr
        if val is not None:
            logs.update({f"val_{k}": v for k, v in self._evaluate(val).items()})
        logs["seconds"] = time.perf_counter() - start
        self.epoch = epoch
        self.history.append(logs)
        if bar is not None:
            bar.set_postfix({k: f"{logs[k]:.4g}" for k in ("loss", "val_loss") if k in logs})
        for cb in self.callbacks:
            cb.on_epoch_end(self, epoch, logs)

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
        """The mean loss (and metrics) on ``data``, without training."""
        return self._evaluate(as_feeds(data, self.inputs))

    def _evaluate(self, data: dict[str, np.ndarray]) -> dict[str, float]:
        sums = dict.fromkeys(["loss", *self.metrics], 0.0)
        seen = 0
        names = self.fb.output_names
        for batch in BatchLoader(data, self.eval_batch_size, shuffle=False):
            outputs = self.fb.forward(batch, training=False).outputs
            n = len(next(iter(batch.values())))
            sums["loss"] += float(outputs[self.loss_index]) * n
            by_name = dict(zip(names, outputs))
            for key, fn in self.metrics.items():
                sums[key] += float(fn(by_name, batch)) * n
            seen += n
        return {k: v / seen for k, v in sums.items()}

    def plot(self, path: str | os.PathLike, title: str | None = None) -> str:
        """A PNG of the training and validation loss curves."""
        return self.history.plot(path, title=title)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Write parameters, optimizer state, shuffling state, history and callbacks to ``path``
        (an ``.npz`` file, no pickled objects); written to a temporary file first, then moved."""
        state = {
            "format": CHECKPOINT_FORMAT,
            "epoch": self.epoch,
            "rng": self.rng.bit_generator.state,
            "history": self.history.records,
            "params": self.fb.parameters,
            "optimizer_type": type(self.optimizer).__name__,
            "optimizer": self.optimizer.state_dict(),
            "callbacks": [cb.state_dict() for cb in self.callbacks],
        }
        arrays: dict[str, np.ndarray] = {}
        meta = json.dumps(_pack(state, arrays))
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            np.savez(f, __meta__=np.array(meta), **arrays)
        os.replace(tmp, path)
        return path

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` for the same model and setup."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise InputError(f"checkpoint {path!r} does not exist")
        try:
            with np.load(path, allow_pickle=False) as npz:
                meta = json.loads(npz["__meta__"].item())
                arrays = {k: npz[k] for k in npz.files if k != "__meta__"}
        except (OSError, ValueError, KeyError) as exc:
            raise InputError(f"{path!r} is not an onnxgrad checkpoint: {exc}") from exc
        state = _unpack(meta, arrays)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise InputError(f"{path!r}: unsupported checkpoint format {state.get('format')!r}")
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
        for cb, cb_state in zip(self.callbacks, state["callbacks"]):
            cb.load_state_dict(cb_state)
        self.rng.bit_generator.state = state["rng"]
        self.history = History(state["history"])
        self.epoch = int(state["epoch"])


def _pack(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    """``obj`` as JSON data, numpy arrays moved to ``arrays`` and replaced by references."""
    if isinstance(obj, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = obj
        return {"__array__": key}
    if isinstance(obj, Mapping):
        return {"__dict__": [[str(k), _pack(v, arrays)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return [_pack(v, arrays) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _unpack(obj: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """The inverse of :func:`_pack`."""
    if isinstance(obj, dict):
        if "__array__" in obj:
            return arrays[obj["__array__"]]
        return {k: _unpack(v, arrays) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_unpack(v, arrays) for v in obj]
    return obj


def _epoch_label(epoch: int, epochs: int) -> str:
    """The progress bar's description: ``'epoch  3/15'`` (aligned, so the bar does not jump)."""
    return f"epoch {epoch:>{len(str(epochs))}}/{epochs}"
