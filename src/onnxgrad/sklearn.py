"""scikit-learn estimators that train ONNX models with onnxruntime.

:class:`OnnxRegressor` and :class:`OnnxClassifier` wrap an ONNX model — or a fitted scikit-learn
model, converted with skl2onnx on the first ``fit`` — and fit it further with
:class:`onnxgrad.train.Trainer`. They follow scikit-learn's conventions (``get_params`` /
``set_params``, ``clone``, ``score``, ``partial_fit``, ``warm_start``), so they work inside
``Pipeline``, ``GridSearchCV`` and ``cross_val_score``. The trained model is available as ONNX
(:meth:`to_onnx`, the converted model's outputs and the trained weights).

Needs scikit-learn, and skl2onnx to convert scikit-learn models.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, clone
from sklearn.utils.validation import check_array, check_is_fitted

from .autodiff.params import select_parameters
from .errors import InputError
from .model.graph import np_dtype, unique_name
from .model.infer import infer_value_infos
from .model.load import CheckedModel, load_checked
from .runtime.runner import make_session
from .train.losses import add_loss, keep_outputs, with_parameters
from .train.trainer import History, Trainer

__all__ = ["OnnxClassifier", "OnnxRegressor", "to_onnx_model"]

_TARGET, _WEIGHT = "target", "sample_weight"


def to_onnx_model(model: Any, X: np.ndarray, *, classifier: bool = False) -> onnx.ModelProto:
    """``model`` as an ONNX ``ModelProto``: loaded if it is ONNX (proto, path, bytes), converted with
    skl2onnx if it is a fitted scikit-learn estimator (``X[:1]`` gives the input type).

    Linear models are converted with ``black_op={'LinearRegressor', 'LinearClassifier'}`` so that
    their coefficients become initializers (trainable) rather than node attributes, and classifiers
    with ``zipmap=False`` so that probabilities are a tensor.
    """
    return _checked_model(model, X, classifier=classifier).proto


def _checked_model(model: Any, X: np.ndarray, *, classifier: bool) -> CheckedModel:
    """:func:`to_onnx_model`, checked once: what ``fit`` rewrites and trains."""
    if model is None:
        raise InputError("no model: pass an ONNX model or a fitted scikit-learn estimator as model=")
    if isinstance(model, onnx.ModelProto | bytes | bytearray | str | os.PathLike):
        return load_checked(model)
    if not hasattr(model, "get_params"):
        raise InputError(
            f"model must be an ONNX model or a scikit-learn estimator, got {type(model).__name__}"
        )
    from skl2onnx import to_onnx

    final = model.steps[-1][1] if hasattr(model, "steps") else model
    options = {id(final): {"zipmap": False}} if classifier or hasattr(final, "predict_proba") else None
    sample = np.asarray(X[:1], dtype=np.float32)
    try:
        converted = to_onnx(model, sample, options=options, black_op={"LinearRegressor", "LinearClassifier"})
    except RuntimeError:  # a converter without an alternative to the blocked ops
        converted = to_onnx(model, sample, options=options)
    return load_checked(converted)


def _fresh(model: onnx.ModelProto, base: str) -> str:
    g = model.graph
    taken = {v.name for v in (*g.input, *g.output, *g.initializer)} | {o for n in g.node for o in n.output}
    return unique_name(base, taken)


class _OnnxEstimator(BaseEstimator):
    """What both estimators share: conversion, the trainer, warm starts, prediction sessions."""

    _default_loss = "mse"

    def _float_outputs(self, base: onnx.ModelProto, infos: dict, what: str) -> list[str]:
        """The model's floating-point outputs; :class:`InputError` when there is none, or when
        ``output=`` names another value. ``what`` completes the message (``"to train"``)."""
        outputs = [o.name for o in base.graph.output if infos.get(o.name) and infos[o.name].is_float]
        if self.output is not None and self.output not in outputs:
            raise InputError(f"{self.output!r} is not a floating-point output of the model ({outputs})")
        if not outputs:
            raise InputError(f"the model has no floating-point output {what}")
        return outputs

    def __init__(
        self,
        model: Any = None,
        *,
        output: str | None = None,
        optimizer: str = "adam",
        lr: float = 1e-3,
        epochs: int = 10,
        batch_size: int = 32,
        l1: float = 0.0,
        l2: float = 0.0,
        trainable: Iterable[str] | None = None,
        shuffle: bool = True,
        random_state: int | None = 0,
        warm_start: bool = False,
        verbose: bool = False,
    ) -> None:
        self.model = model
        self.output = output
        self.optimizer = optimizer
        self.lr = lr
        self.epochs = epochs
        self.batch_size = batch_size
        self.l1 = l1
        self.l2 = l2
        self.trainable = trainable
        self.shuffle = shuffle
        self.random_state = random_state
        self.warm_start = warm_start
        self.verbose = verbose

    # A fitted scikit-learn model given as `model` must stay fitted in clones (scikit-learn's
    # clone would return an unfitted copy of it); it is only read, never changed, so it is shared.
    def __sklearn_clone__(self) -> _OnnxEstimator:
        params = self.get_params(deep=False)
        model = params.pop("model")
        return type(self)(model=model, **{k: clone(v, safe=False) for k, v in params.items()})

    # ---- fitting -------------------------------------------------------------------------------
    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> _OnnxEstimator:
        """Train for ``epochs`` epochs: from the wrapped model, or, with ``warm_start`` and after a
        previous fit, from the weights that fit reached."""
        warm = self.warm_start and hasattr(self, "onnx_model_")  # the attribute fit sets, not another
        X, y = self._check_X(X, reset=not warm), np.asarray(y)
        if not warm:
            base = _checked_model(self.model, X, classifier=isinstance(self, ClassifierMixin))
            self._base_ = base.proto
            self._prepare(base, y)
            start = self._base_
        else:
            start = self.onnx_model_  # the previous fit's weights
            self._check_targets(y)
        self.trainer_ = self._make_trainer(start, resume=warm)
        self._train(X, y, sample_weight, epochs=self.epochs)
        return self

    def partial_fit(self, X: Any, y: Any, sample_weight: Any = None, **kwargs: Any) -> _OnnxEstimator:
        """One epoch over ``X``, continuing the optimizer's state from the previous call."""
        first = not hasattr(self, "onnx_model_")
        X, y = self._check_X(X, reset=first), np.asarray(y)
        if first:
            base = _checked_model(self.model, X, classifier=isinstance(self, ClassifierMixin))
            self._base_ = base.proto
            self._prepare(base, y, **kwargs)
            self.trainer_ = self._make_trainer(self._base_)
        else:
            self._check_targets(y)
            if getattr(self, "trainer_", None) is None:  # unpickled: rebuild from the trained model
                self.trainer_ = self._make_trainer(self.onnx_model_, resume=True)
        self._train(X, y, sample_weight, epochs=1)
        return self

    def _check_X(self, X: Any, reset: bool) -> np.ndarray:
        X = check_array(X, dtype=None, ensure_2d=True)
        if reset:
            self.n_features_in_ = X.shape[1]
        elif X.shape[1] != self.n_features_in_:
            raise InputError(
                f"X has {X.shape[1]} features, the estimator was fitted with {self.n_features_in_}"
            )
        return X

    def _prepare(self, checked: CheckedModel, y: np.ndarray, **kwargs: Any) -> None:
        """Choose the input, the output and the loss; build the training model (the fit's
        rewrites of the checked model, not checked again)."""
        base = checked.proto
        inits = {i.name for i in base.graph.initializer}
        inputs = [i.name for i in base.graph.input if i.name not in inits]
        if len(inputs) != 1:
            raise InputError(f"the model must have one input (the features X), it has {inputs}")
        self.input_name_ = inputs[0]
        infos = infer_value_infos(base)
        kind, value, options = self._loss_for(base, infos, y, **kwargs)
        target, weight, loss = _fresh(base, _TARGET), _fresh(base, _WEIGHT), _fresh(base, "loss")
        model = add_loss(
            checked,
            kind,
            output=value,
            target_name=target,
            weight_name=weight,
            loss_name=loss,
            l1=self.l1,
            l2=self.l2,
            **options,
        )
        self._train_model_ = keep_outputs(CheckedModel(model), [loss])
        self._names_ = (self.input_name_, target, weight)

    def _make_trainer(self, start: onnx.ModelProto, resume: bool = False) -> Trainer:
        """A trainer on the training model, its weights taken from ``start``; with ``resume``, its
        history (``loss_curve_``, ``n_iter_``) continues the previous fit's, as scikit-learn's
        warm starts do."""
        if self.trainable is None:  # the parameters: not skl2onnx's `unity` and other constants
            trainable = select_parameters(self._train_model_).trainable
        else:
            trainable = list(self.trainable)
        if not trainable:
            raise InputError("the model has no floating-point initializer to train")
        weights = {
            i.name: onnx.numpy_helper.to_array(i) for i in start.graph.initializer if i.name in trainable
        }
        trainer = Trainer(
            CheckedModel(with_parameters(CheckedModel(self._train_model_), weights)),
            optimizer=self.optimizer,
            lr=self.lr,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.random_state,
            progress=bool(self.verbose),
            trainable=trainable,
            loss_name=self._train_model_.graph.output[0].name,
        )
        if resume:
            trainer.history, trainer.epoch = History(self.history_.records), self.n_iter_
        return trainer

    def _train(self, X: np.ndarray, y: np.ndarray, sample_weight: Any, epochs: int) -> None:
        x_name, t_name, w_name = self._names_
        w = np.ones(len(X)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if w.shape != (len(X),):
            raise InputError(f"sample_weight must have shape ({len(X)},), got {w.shape}")
        data = {x_name: X, t_name: self._encode_targets(y), w_name: w}
        trainer = self.trainer_
        trainer.fit(data, epochs=trainer.epoch + epochs)
        self.history_ = trainer.history
        self.loss_curve_ = list(trainer.history["loss"])
        self.n_iter_ = len(self.loss_curve_)
        params = dict(trainer.parameters)
        for tie in trainer.fb.graphs.ties:  # tied copies, computed from their parameter
            params[tie.name] = tie.compute(params[tie.source])
        self.onnx_model_ = with_parameters(CheckedModel(self._base_), params)
        self._session_ = None

    # ---- prediction ----------------------------------------------------------------------------
    def to_onnx(self) -> onnx.ModelProto:
        """The wrapped model (all its outputs) with the trained weights."""
        check_is_fitted(self, "onnx_model_")
        return self.onnx_model_

    def _run(self, X: Any) -> np.ndarray:
        """The training output (scores or predictions) of the trained model on ``X``."""
        check_is_fitted(self, "onnx_model_")
        X = self._check_X(X, reset=False)
        if getattr(self, "_session_", None) is None:
            model = keep_outputs(CheckedModel(self.onnx_model_), [self._output_])  # fit's own model
            self._session_ = make_session(model, ["CPUExecutionProvider"])
        dtype = np_dtype(self._input_dtype_)
        return self._session_.run(None, {self.input_name_: X.astype(dtype, copy=False)})[0]

    def __getstate__(self) -> dict[str, Any]:
        # onnxruntime sessions do not pickle: the trained ONNX model is enough to predict, and to
        # rebuild the trainer for partial_fit.
        state = super().__getstate__()
        state.pop("trainer_", None)
        state["_session_"] = None
        return state


class OnnxRegressor(RegressorMixin, _OnnxEstimator):
    """Fits an ONNX regression model further (``loss``: ``"mse"``, ``"l1"`` or ``"huber"``).

    ``model``: ONNX model (proto, path, bytes) or fitted scikit-learn regressor. ``output``: the
    model output to train (default: the first floating-point one). ``l1`` / ``l2``: penalties on
    the initializers of rank >= 2 (skl2onnx stores MLP intercepts as ``(1, n)`` matrices: they are
    penalized too). ``trainable``: initializer names (default: the model's parameters,
    see :mod:`onnxgrad.autodiff.params`). Fitted attributes: ``onnx_model_``, ``loss_curve_``, ``history_``,
    ``n_iter_`` (epochs), ``n_features_in_``.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        loss: str = "mse",
        output: str | None = None,
        optimizer: str = "adam",
        lr: float = 1e-3,
        epochs: int = 10,
        batch_size: int = 32,
        l1: float = 0.0,
        l2: float = 0.0,
        trainable: Iterable[str] | None = None,
        shuffle: bool = True,
        random_state: int | None = 0,
        warm_start: bool = False,
        verbose: bool = False,
    ) -> None:
        super().__init__(
            model,
            output=output,
            optimizer=optimizer,
            lr=lr,
            epochs=epochs,
            batch_size=batch_size,
            l1=l1,
            l2=l2,
            trainable=trainable,
            shuffle=shuffle,
            random_state=random_state,
            warm_start=warm_start,
            verbose=verbose,
        )
        self.loss = loss

    def _loss_for(self, base: onnx.ModelProto, infos: dict, y: np.ndarray) -> tuple[str, str, dict[str, Any]]:
        if self.loss not in ("mse", "l1", "huber"):
            raise InputError(f"OnnxRegressor's loss must be 'mse', 'l1' or 'huber', got {self.loss!r}")
        outputs = self._float_outputs(base, infos, "to train")
        self._output_ = self.output or outputs[0]
        info = infos[self._output_]
        self._out_shape_ = info.shape
        self._input_dtype_ = infos[self.input_name_].dtype
        return self.loss, self._output_, {}

    def _check_targets(self, y: np.ndarray) -> None:
        pass

    def _encode_targets(self, y: np.ndarray) -> np.ndarray:
        return np.asarray(y, dtype=np.float64)

    def predict(self, X: Any) -> np.ndarray:
        """Predictions, shape ``(n,)`` for a single-target model, else ``(n, targets)``."""
        pred = self._run(X)
        return pred.reshape(len(pred)) if pred.ndim == 2 and pred.shape[1] == 1 else pred


class OnnxClassifier(ClassifierMixin, _OnnxEstimator):
    """Fits an ONNX classification model further.

    ``model``: ONNX model (proto, path, bytes) or fitted scikit-learn classifier (converted with
    ``zipmap=False``). ``output``: the float output of shape ``(N, classes)`` to train (default:
    ``probabilities`` when present, else the first floating-point output). ``scores``: what that
    output holds, ``"logits"``, ``"probabilities"`` or ``"auto"`` (probabilities when a Softmax
    makes it or when the model also outputs integer labels, as skl2onnx's converters do).
    The loss is the cross-entropy: on the logits before the Softmax when there is one (the stable
    form), else the negative log-likelihood of the probabilities. Fitted attributes: ``classes_``
    and those of :class:`OnnxRegressor`.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        output: str | None = None,
        scores: str = "auto",
        optimizer: str = "adam",
        lr: float = 1e-3,
        epochs: int = 10,
        batch_size: int = 32,
        l1: float = 0.0,
        l2: float = 0.0,
        trainable: Iterable[str] | None = None,
        shuffle: bool = True,
        random_state: int | None = 0,
        warm_start: bool = False,
        verbose: bool = False,
    ) -> None:
        super().__init__(
            model,
            output=output,
            optimizer=optimizer,
            lr=lr,
            epochs=epochs,
            batch_size=batch_size,
            l1=l1,
            l2=l2,
            trainable=trainable,
            shuffle=shuffle,
            random_state=random_state,
            warm_start=warm_start,
            verbose=verbose,
        )
        self.scores = scores

    def _loss_for(
        self, base: onnx.ModelProto, infos: dict, y: np.ndarray, classes: Any = None
    ) -> tuple[str, str, dict[str, Any]]:
        if self.scores not in ("auto", "logits", "probabilities"):
            raise InputError(f"scores must be 'auto', 'logits' or 'probabilities', got {self.scores!r}")
        self.classes_ = np.unique(y) if classes is None else np.unique(np.asarray(classes))
        self._check_targets(y)
        outputs = self._float_outputs(base, infos, "of class scores")
        out = self.output or ("probabilities" if "probabilities" in outputs else outputs[0])
        info = infos[out]
        if info.rank != 2:
            raise InputError(f"output {out!r} must have shape (N, classes), it has {info.shape}")
        n_out = info.shape[1]
        if isinstance(n_out, int) and n_out != len(self.classes_):
            raise InputError(
                f"output {out!r} scores {n_out} classes, y has {len(self.classes_)}: {self.classes_.tolist()}"
            )
        self._output_, self._input_dtype_ = out, infos[self.input_name_].dtype
        softmax = _softmax_input(base, out)
        kind = self.scores
        if kind == "auto":
            has_labels = any(
                infos.get(o.name) is not None and not infos[o.name].is_float for o in base.graph.output
            )
            kind = "probabilities" if softmax is not None or has_labels else "logits"
        self._output_kind_ = kind
        if kind == "logits":
            return "cross_entropy", out, {}
        if softmax is not None:  # cross-entropy on the logits: exact where log(softmax) underflows
            return "cross_entropy", softmax, {}
        return "nll", out, {"probabilities": True}

    def _check_targets(self, y: np.ndarray) -> None:
        unseen = np.setdiff1d(np.unique(y), self.classes_)
        if unseen.size:
            raise InputError(f"y has labels {unseen.tolist()} not among the classes {self.classes_.tolist()}")

    def _encode_targets(self, y: np.ndarray) -> np.ndarray:
        self._check_targets(y)
        return np.searchsorted(self.classes_, y).astype(np.int64)

    def partial_fit(self, X: Any, y: Any, classes: Any = None, sample_weight: Any = None) -> OnnxClassifier:
        """One epoch; ``classes`` (every label) is required on the first call, as in scikit-learn."""
        if not hasattr(self, "onnx_model_") and classes is None:
            raise InputError("classes must be passed on the first call to partial_fit")
        kwargs = {"classes": classes} if not hasattr(self, "onnx_model_") else {}
        return super().partial_fit(X, y, sample_weight, **kwargs)  # type: ignore[return-value]

    def predict_proba(self, X: Any) -> np.ndarray:
        """Class probabilities, columns in the order of ``classes_``."""
        scores = self._run(X).astype(np.float64)
        if self._output_kind_ == "probabilities":
            return scores
        scores -= scores.max(axis=1, keepdims=True)
        np.exp(scores, out=scores)
        return scores / scores.sum(axis=1, keepdims=True)

    def predict(self, X: Any) -> np.ndarray:
        """The most probable class of each sample."""
        return self.classes_[np.argmax(self._run(X), axis=1)]


def _softmax_input(model: onnx.ModelProto, value: str) -> str | None:
    """The input of the Softmax over the class axis that makes ``value`` (through Identity nodes)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    node = producers.get(value)
    while node is not None and node.op_type == "Identity":
        node = producers.get(node.input[0])
    if node is None or node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    return node.input[0] if axis in (None, 1, -1) else None
