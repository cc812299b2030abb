"""scikit-learn estimators that train ONNX models with onnxruntime.

:class:`OnnxRegressor` and :class:`OnnxClassifier` wrap an ONNX model — or a fitted scikit-learn
model, converted with skl2onnx on the first ``fit`` — and fit it further with
:class:`onnxgrad.train.Trainer`. They follow scikit-learn's conventions (``get_params`` /
``set_params``, ``clone``, ``score``, ``partial_fit``, ``warm_start``), so they work inside
``Pipeline``, ``GridSearchCV`` and ``cross_val_score``. The trained model is available as ONNX
(:meth:`to_onnx`, the converted model's outputs and the trained weights).

Training stops as scikit-learn's ``MLPRegressor`` / ``MLPClassifier`` stop: after ``max_iter``
epochs (with a :class:`~sklearn.exceptions.ConvergenceWarning`), or earlier when the training loss
(or, with ``early_stopping``, the score on ``validation_fraction`` of the data) has not improved by
``tol`` for more than ``n_iter_no_change`` epochs in a row.

Needs scikit-learn, and skl2onnx to convert scikit-learn models.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, clone, is_classifier
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import accuracy_score, r2_score
from sklearn.model_selection import train_test_split
from sklearn.utils.validation import check_array, check_is_fitted

from .errors import InputError
from .model.graph import np_dtype, unique_name
from .model.infer import infer_value_infos
from .model.load import CheckedModel, load_checked
from .runtime.providers import resolve_providers
from .runtime.runner import make_session, session_options_for
from .train.callbacks import Callback
from .train.history import History
from .train.losses import add_loss, keep_outputs, with_parameters
from .train.optim import Optimizer
from .train.optimizers import DEFAULT_LR
from .train.trainer import Trainer

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
    from sklearn.exceptions import NotFittedError

    final = model.steps[-1][1] if hasattr(model, "steps") else model
    try:
        check_is_fitted(model)
    except NotFittedError:
        raise InputError(
            f"{type(model).__name__} is not fitted: fit it first (a few iterations are enough to fix "
            f"its shapes), or pass an ONNX model"
        ) from None
    options = {id(final): {"zipmap": False}} if classifier or hasattr(final, "predict_proba") else None
    sample = np.asarray(X[:1], dtype=np.float32)
    try:
        try:
            converted = to_onnx(
                model, sample, options=options, black_op={"LinearRegressor", "LinearClassifier"}
            )
        except RuntimeError:  # a converter without an alternative to the blocked ops
            converted = to_onnx(model, sample, options=options)
    except Exception as exc:  # any failure of the converter is the converter's
        raise InputError(
            f"skl2onnx cannot convert {type(final).__name__}: {type(exc).__name__}: {exc}. Pass an ONNX "
            f"model instead"
        ) from exc
    checked = load_checked(converted)
    _check_conversion(model, checked.proto, np.asarray(X[:_CHECKED_ROWS], dtype=np.float32))
    return checked


# the rows of X on which a converted estimator is run against its own predict
_CHECKED_ROWS = 8


def _check_conversion(estimator: Any, converted: onnx.ModelProto, rows: np.ndarray) -> None:
    """:class:`InputError` naming skl2onnx's converter when the converted model does not compute
    what the estimator predicts on ``rows`` (a converter that writes one column for a multi-output
    regressor, say): training it would fit something else than the estimator."""
    name = type(estimator).__name__
    outputs = [o.name for o in converted.graph.output]
    session = make_session(converted, resolve_providers())
    got = session.run(None, {converted.graph.input[0].name: rows})
    method = "predict_proba" if hasattr(estimator, "predict_proba") else "predict"
    want = np.asarray(getattr(estimator, method)(rows))
    if method == "predict_proba":
        out = "probabilities" if "probabilities" in outputs else outputs[-1]
    else:  # a classifier without probabilities: its label output; a regressor: its first output
        out = "label" if "label" in outputs and is_classifier(estimator) else outputs[0]
    value = np.asarray(got[outputs.index(out)])
    want = want.reshape(len(rows), -1)
    if value.ndim == 1:
        value = value.reshape(-1, 1)
    # float32 arithmetic against the estimator's float64: far below the disagreement of a wrong graph
    scale = max(1.0, float(np.abs(want).max(initial=0.0))) if want.dtype.kind in "fc" else 1.0
    agree = value.shape == want.shape and (
        np.array_equal(value, want)
        if want.dtype.kind not in "fc"
        else np.allclose(value, want, rtol=1e-3, atol=1e-3 * scale)
    )
    if not agree:
        raise InputError(
            f"skl2onnx's converter for {name} gives output {out!r} of shape {value.shape} on {len(rows)} "
            f"rows, where {name}.{method} "
            f"gives shape {want.shape}{'' if value.shape != want.shape else ' and other values'}: the "
            f"converted model does not compute the estimator, so it cannot be trained in its place. "
            f"Pass an ONNX model that does (e.g. a torch model exported to ONNX)"
        )


def _no_missing_labels(y: np.ndarray) -> None:
    """:class:`InputError` naming the first row whose class label is NaN (a missing value)."""
    y = np.asarray(y)
    if y.dtype.kind == "f" and np.isnan(y).any():
        raise InputError(
            f"y holds NaN at row {int(np.flatnonzero(np.isnan(y.ravel()))[0])}: a class label is missing"
        )


def _per_factor(penalty: Any, factor: float) -> Any:
    """A penalty coefficient (a number or name -> number) divided by ``factor``: its term, then
    scaled with the loss by ``factor``, is as given."""
    if isinstance(penalty, Mapping):
        return {k: v / factor for k, v in penalty.items()}
    return penalty / factor


def _scaled_loss(model: onnx.ModelProto, loss: str, factor: float) -> onnx.ModelProto:
    """``model`` whose output ``loss`` is ``factor`` times what it was."""
    g = model.graph
    (out,) = [o for o in g.output if o.name == loss]
    unscaled, scale = _fresh(model, f"{loss}_unscaled"), _fresh(model, f"{loss}_factor")
    for node in g.node:
        node.output[:] = [unscaled if o == loss else o for o in node.output]
    dtype = np_dtype(out.type.tensor_type.elem_type)
    g.initializer.append(onnx.numpy_helper.from_array(np.array(factor, dtype), scale))
    g.node.append(onnx.helper.make_node("Mul", [unscaled, scale], [loss]))
    return model


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
        optimizer: str | Callable[[dict[str, np.ndarray]], Optimizer] = "adam",
        lr: float = DEFAULT_LR,
        max_iter: int = 200,
        tol: float = 1e-4,
        n_iter_no_change: int = 10,
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        epochs: int | None = None,
        batch_size: int | str = "auto",
        l1: float = 0.0,
        l2: float = 0.0,
        trainable: Iterable[str] | None = None,
        frozen: Iterable[str] = (),
        shuffle: bool = True,
        random_state: int | None = 0,
        warm_start: bool = False,
        verbose: bool = False,
    ) -> None:
        self.model = model
        self.output = output
        self.optimizer = optimizer
        self.lr = lr
        self.max_iter = max_iter
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.epochs = epochs
        self.batch_size = batch_size
        self.l1 = l1
        self.l2 = l2
        self.trainable = trainable
        self.frozen = frozen
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
        """Train from the wrapped model, or, with ``warm_start`` and after a previous fit, from the
        weights that fit reached: until convergence or ``max_iter`` epochs (exactly ``epochs``
        epochs when that is set)."""
        self._check_stopping_params()
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
        self.trainer_ = self._make_trainer(start, resume=warm, n_samples=len(X))
        if self.epochs is not None:  # a fixed number of epochs: no convergence test
            self._train(X, y, sample_weight, epochs=self.epochs)
            self._without_validation()
        else:
            self._fit_until_converged(X, y, sample_weight)
        return self

    def _check_stopping_params(self) -> None:
        """:class:`InputError` for stopping parameters scikit-learn would refuse."""
        checks = [
            (
                "max_iter",
                self.max_iter,
                _integer(self.max_iter) and self.max_iter >= 1,
                ">= 1",
            ),
            ("tol", self.tol, isinstance(self.tol, numbers.Real) and self.tol >= 0, ">= 0"),
            (
                "n_iter_no_change",
                self.n_iter_no_change,
                _integer(self.n_iter_no_change) and self.n_iter_no_change >= 1,
                ">= 1",
            ),
            (
                "validation_fraction",
                self.validation_fraction,
                isinstance(self.validation_fraction, numbers.Real) and 0 < self.validation_fraction < 1,
                "in (0, 1)",
            ),
            (
                "epochs",
                self.epochs,
                self.epochs is None or (_integer(self.epochs) and self.epochs >= 1),
                "None or >= 1",
            ),
            (
                "batch_size",
                self.batch_size,
                self.batch_size == "auto" or (_integer(self.batch_size) and self.batch_size >= 1),
                "'auto' or >= 1",
            ),
        ]
        for name, value, ok, expected in checks:
            if not ok:
                raise InputError(f"{name} must be {expected}, got {value!r}")

    def _fit_until_converged(self, X: np.ndarray, y: np.ndarray, sample_weight: Any) -> None:
        """MLPRegressor's loop: epochs until the loss (or the validation score) stops improving by
        ``tol`` for more than ``n_iter_no_change`` epochs, or ``max_iter`` epochs."""
        val = None
        # with warm_start, the records go on from the previous fit, as scikit-learn's do
        warm = self.warm_start and hasattr(self, "onnx_model_")
        scores = getattr(self, "validation_scores_", None) if warm else None
        best_score = getattr(self, "best_validation_score_", None) if warm else None
        best_loss = getattr(self, "best_loss_", None) if warm else None
        if self.early_stopping:
            X, y, sample_weight, val = self._split_validation(X, y, sample_weight)
            self.validation_scores_ = list(scores or [])
            self.best_validation_score_ = -math.inf if best_score is None else best_score
            self.best_loss_ = None
        else:
            self.best_loss_ = math.inf if best_loss is None else best_loss
            self.validation_scores_ = self.best_validation_score_ = None
        monitor = _Convergence(self, val)
        self.trainer_.callbacks.append(monitor)
        try:
            self._train(X, y, sample_weight, epochs=self.max_iter)
        finally:
            self.trainer_.callbacks.remove(monitor)
        if val is not None and monitor.best_params is not None:  # as scikit-learn: the best epoch's
            self.trainer_.set_parameters(monitor.best_params)
            self._publish(self.trainer_)
        if not monitor.converged:
            warnings.warn(
                f"Stochastic Optimizer: Maximum iterations ({self.max_iter}) reached and the "
                "optimization hasn't converged yet.",
                ConvergenceWarning,
                stacklevel=3,
            )

    def _split_validation(
        self, X: np.ndarray, y: np.ndarray, sample_weight: Any
    ) -> tuple[np.ndarray, np.ndarray, Any, tuple[np.ndarray, np.ndarray, Any]]:
        """``validation_fraction`` of the samples set aside (stratified for a classifier), as
        scikit-learn's early stopping does."""
        stratify = y if isinstance(self, ClassifierMixin) else None
        parts = [X, y] if sample_weight is None else [X, y, np.asarray(sample_weight)]
        split = train_test_split(
            *parts, test_size=self.validation_fraction, random_state=self.random_state, stratify=stratify
        )
        X_tr, X_val, y_tr, y_val = split[:4]
        w_tr, w_val = (split[4], split[5]) if sample_weight is not None else (None, None)
        return X_tr, y_tr, w_tr, (X_val, y_val, w_val)

    def partial_fit(self, X: Any, y: Any, sample_weight: Any = None, **kwargs: Any) -> _OnnxEstimator:
        """One epoch over ``X``, continuing the optimizer's state from the previous call."""
        first = not hasattr(self, "onnx_model_")
        X, y = self._check_X(X, reset=first), np.asarray(y)
        if first:
            base = _checked_model(self.model, X, classifier=isinstance(self, ClassifierMixin))
            self._base_ = base.proto
            self._prepare(base, y, **kwargs)
            self.trainer_ = self._make_trainer(self._base_, n_samples=len(X))
        else:
            self._check_targets(y)
            if getattr(self, "trainer_", None) is None:  # unpickled: rebuild from the trained model
                self.trainer_ = self._make_trainer(self.onnx_model_, resume=True)
        self._train(X, y, sample_weight, epochs=1)
        self._without_validation()
        return self

    def _without_validation(self) -> None:
        """The stopping attributes of a run that watched nothing: the best loss of the curve."""
        self.best_loss_ = min(self.loss_curve_)
        self.validation_scores_ = self.best_validation_score_ = None

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
        shape = infos[self.input_name_].shape
        if (
            shape is not None
            and len(shape) == 2
            and isinstance(shape[1], int)
            and shape[1] != self.n_features_in_
        ):
            raise InputError(
                f"X has {self.n_features_in_} features, the model's input {self.input_name_!r} "
                f"takes {shape[1]}"
            )
        kind, value, options = self._loss_for(base, infos, y, **kwargs)
        target, weight, loss = _fresh(base, _TARGET), _fresh(base, _WEIGHT), _fresh(base, "loss")
        model = add_loss(
            checked,
            kind,
            output=value,
            target_name=target,
            weight_name=weight,
            loss_name=loss,
            # the penalties as given, whatever factor the data loss is trained at
            l1=_per_factor(self.l1, self._loss_factor()),
            l2=_per_factor(self.l2, self._loss_factor()),
            **options,
        )
        if self._loss_factor() != 1.0:
            model = _scaled_loss(model, loss, self._loss_factor())
        self._train_model_ = keep_outputs(CheckedModel(model), [loss])
        self._names_ = (self.input_name_, target, weight)

    def _loss_factor(self) -> float:
        """The factor of the loss trained and recorded (``loss_curve_``) over :func:`add_loss`'s."""
        return 1.0

    def _make_trainer(
        self, start: onnx.ModelProto, resume: bool = False, n_samples: int | None = None
    ) -> Trainer:
        """A trainer on the training model, its weights taken from ``start``; with ``resume``, its
        history (``loss_curve_``, ``n_iter_``) continues the previous fit's, as scikit-learn's
        warm starts do."""
        # the weights reached so far (only the trained ones differ from the model's)
        names = {i.name for i in self._train_model_.graph.initializer}
        weights = {i.name: onnx.numpy_helper.to_array(i) for i in start.graph.initializer if i.name in names}
        trainer = Trainer(
            CheckedModel(with_parameters(CheckedModel(self._train_model_), weights)),
            optimizer=self.optimizer,
            lr=None if _is_factory(self.optimizer) else self.lr,  # a factory sets its own
            batch_size=self._batch_size(n_samples),
            shuffle=self.shuffle,
            seed=self.random_state,
            progress=bool(self.verbose),
            trainable=self.trainable,
            frozen=self.frozen,
            loss_name=self._train_model_.graph.output[0].name,
        )
        if resume:
            trainer.history, trainer.epoch = History(self.history_.records), self.n_iter_
        return trainer

    def _batch_size(self, n_samples: int | None) -> int:
        """``batch_size``; ``"auto"`` is ``min(200, n_samples)`` as in scikit-learn's MLPs."""
        if self.batch_size == "auto":
            return 200 if n_samples is None else max(1, min(200, n_samples))
        return int(self.batch_size)

    def _train(self, X: np.ndarray, y: np.ndarray, sample_weight: Any, epochs: int) -> None:
        x_name, t_name, w_name = self._names_
        w = np.ones(len(X)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if w.shape != (len(X),):
            raise InputError(f"sample_weight must have shape ({len(X)},), got {w.shape}")
        if w.size and not w.any():
            raise InputError("sample_weight sums to zero: no sample would count")
        bad = np.flatnonzero(~(np.isfinite(w) & (w >= 0)))
        if bad.size:
            raise InputError(f"sample_weight must be finite and >= 0; row {bad[0]} holds {w[bad[0]]:g}")
        data = {x_name: X, t_name: self._encode_targets(y), w_name: w}
        trainer = self.trainer_
        trainer.fit(data, epochs=trainer.epoch + epochs)
        self._publish(trainer)

    def _publish(self, trainer: Trainer) -> None:
        """The fitted attributes from the trainer's history and weights."""
        self.history_ = trainer.history
        self.loss_curve_ = list(trainer.history["loss"])
        self.n_iter_ = len(self.loss_curve_)
        self.onnx_model_ = with_parameters(CheckedModel(self._base_), _weights(trainer))
        self._session_ = None

    def _validation_score(self, trainer: Trainer, X: np.ndarray, y: np.ndarray, w: Any) -> float:
        """:meth:`score` of the trainer's current weights on ``(X, y)``, without rebuilding a
        session each epoch: one session whose trained initializers are also inputs."""
        session = getattr(self, "_val_session_", None)
        if session is None or self._val_session_key_ is not trainer:
            model = keep_outputs(CheckedModel(self._base_), [self._output_])
            inits = {i.name: i for i in model.graph.initializer}
            overridden = [name for name in _weights(trainer) if name in inits]
            for name in overridden:  # an input of the same name overrides the initializer
                init = inits[name]
                info = onnx.helper.make_tensor_value_info(name, init.data_type, list(init.dims))
                model.graph.input.append(info)
            options = session_options_for(model)  # the policy's options for this model, quiet:
            options.log_severity_level = 3  # not the warning that these initializers are inputs
            self._val_session_ = session = make_session(model, trainer.fb.providers, options)
            self._val_session_key_ = trainer
            self._val_inputs_ = set(overridden)
        feeds = {k: v for k, v in _weights(trainer).items() if k in self._val_inputs_}
        feeds[self.input_name_] = X.astype(np_dtype(self._input_dtype_), copy=False)
        scores = session.run(None, feeds)[0]
        return float(self._score_predictions(y, self._predict_scores(scores), w))

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
            self._session_ = make_session(model, resolve_providers())
        dtype = np_dtype(self._input_dtype_)
        return self._session_.run(None, {self.input_name_: X.astype(dtype, copy=False)})[0]

    def __getstate__(self) -> dict[str, Any]:
        # onnxruntime sessions do not pickle: the trained ONNX model is enough to predict, and to
        # rebuild the trainer for partial_fit.
        state = super().__getstate__()
        state.pop("trainer_", None)
        state["_session_"] = None
        state.pop("_val_session_", None)
        state.pop("_val_session_key_", None)
        return state


def _shares_params(init: Callable[..., None]) -> Callable[..., None]:
    """Give an estimator's ``__init__(self, model=None, *, <own>=..., **params)`` the explicit
    signature scikit-learn reads (``get_params``, ``set_params``, ``clone``, ``repr``): its own
    parameters, then the keyword-only ones of ``_OnnxEstimator.__init__``, which ``**params`` passes
    on. The parameters both estimators share are so written once, with their defaults and types."""
    signature = inspect.signature(init)
    own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    shared = inspect.signature(_OnnxEstimator.__init__).parameters.values()
    init.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*own, *(p for p in shared if p.kind is p.KEYWORD_ONLY)]
    )
    return init


class OnnxRegressor(RegressorMixin, _OnnxEstimator):
    """Fits an ONNX regression model further (``loss``: ``"mse"``, ``"l1"`` or ``"huber"``).

    ``model``: ONNX model (proto, path, bytes) or fitted scikit-learn regressor. ``output``: the
    model output to train (default: the first floating-point one). ``l1`` / ``l2``: penalties on
    the initializers of rank >= 2 (skl2onnx stores MLP intercepts as ``(1, n)`` matrices: they are
    penalized too). ``trainable``: initializer names (default: the model's parameters,
    see :mod:`onnxgrad.autodiff.params`); ``frozen``: names left out of those (the choice of every
    front end, :func:`onnxgrad.autodiff.params.select_parameters`).

    Stopping, with the meaning of ``MLPRegressor``'s parameters of the same names: at most
    ``max_iter`` epochs (a :class:`~sklearn.exceptions.ConvergenceWarning` when reached), fewer
    when the training loss has not improved by ``tol`` for more than ``n_iter_no_change``
    consecutive epochs; with ``early_stopping``, ``validation_fraction`` of the samples are set
    aside and their R² is watched instead, and the weights of the best epoch are kept. ``epochs``:
    exactly that many epochs per ``fit``, no convergence test (what earlier versions did).
    ``batch_size="auto"`` is ``min(200, n_samples)``. ``optimizer``: ``"adam"``, ``"sgd"``,
    ``"adamw"``, or a factory ``params -> Optimizer`` that sets its own learning rate (``lr`` is then
    unused), such as ``functools.partial(onnxgrad.train.ElasticPenalty, lr=0.01, l1=1e-4, l2=1e-4)``.

    Fitted attributes: ``onnx_model_``, ``loss_curve_`` (the training loss of each epoch: for
    ``"mse"`` half the mean squared error, the loss ``MLPRegressor`` minimises and records, so that
    ``tol`` means the same), ``best_loss_`` (``None``
    with early stopping), ``validation_scores_`` and ``best_validation_score_`` (early stopping
    only, else ``None``), ``history_``, ``n_iter_`` (epochs), ``n_features_in_``.
    """

    @_shares_params
    def __init__(self, model: Any = None, *, loss: str = "mse", **params: Any) -> None:
        super().__init__(model, **params)
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

    def _loss_factor(self) -> float:
        # scikit-learn's MLPRegressor minimises, and records in loss_curve_, half the squared error
        return 0.5 if self.loss == "mse" else 1.0

    def _check_targets(self, y: np.ndarray) -> None:
        bad = ~np.isfinite(np.asarray(y, dtype=np.float64))
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            raise InputError(f"y must be finite; row {row} holds {np.asarray(y, dtype=np.float64)[bad][0]}")

    def _encode_targets(self, y: np.ndarray) -> np.ndarray:
        self._check_targets(y)
        return np.asarray(y, dtype=np.float64)

    def predict(self, X: Any) -> np.ndarray:
        """Predictions, shape ``(n,)`` for a single-target model, else ``(n, targets)``."""
        return self._predict_scores(self._run(X))

    def _predict_scores(self, pred: np.ndarray) -> np.ndarray:
        return pred.reshape(len(pred)) if pred.ndim == 2 and pred.shape[1] == 1 else pred

    def _score_predictions(self, y: np.ndarray, pred: np.ndarray, w: Any) -> float:
        return float(r2_score(y, pred, sample_weight=w))


class OnnxClassifier(ClassifierMixin, _OnnxEstimator):
    """Fits an ONNX classification model further.

    ``model``: ONNX model (proto, path, bytes) or fitted scikit-learn classifier (converted with
    ``zipmap=False``). ``output``: the float output of shape ``(N, classes)`` to train (default:
    ``probabilities`` when present, else the first floating-point output). ``scores``: what that
    output holds, ``"logits"``, ``"probabilities"`` or ``"auto"`` (probabilities when a Softmax
    makes it or when the model also outputs integer labels, as skl2onnx's converters do).
    The loss is the cross-entropy: on the logits before the Softmax when there is one (the stable
    form), else the negative log-likelihood of the probabilities. Stopping as
    :class:`OnnxRegressor` (early stopping watches the accuracy, on a stratified split, as
    ``MLPClassifier``). Fitted attributes: ``classes_`` and those of :class:`OnnxRegressor`
    (``loss_curve_``: the mean cross-entropy of each epoch).
    """

    @_shares_params
    def __init__(self, model: Any = None, *, scores: str = "auto", **params: Any) -> None:
        super().__init__(model, **params)
        self.scores = scores

    def _loss_for(
        self, base: onnx.ModelProto, infos: dict, y: np.ndarray, classes: Any = None
    ) -> tuple[str, str, dict[str, Any]]:
        if self.scores not in ("auto", "logits", "probabilities"):
            raise InputError(f"scores must be 'auto', 'logits' or 'probabilities', got {self.scores!r}")
        _no_missing_labels(y)
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
        _no_missing_labels(y)
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
        return self._predict_scores(self._run(X))

    def to_onnx(self) -> onnx.ModelProto:
        """The wrapped model (all its outputs) with the trained weights, its label output giving
        the classes ``fit`` saw (``classes_``, what :meth:`predict` gives): a table of classes the
        label output reads (skl2onnx's ``ArrayFeatureExtractor(classes, ArgMax(...))``) is rewritten
        with them. :class:`InputError` (naming both sets) where the model's labels cannot hold
        them: string labels of the conversion and integer classes fit on, or the other way, or a
        label output that is the ``ArgMax`` index itself and classes that are not ``0 .. C-1``."""
        return _with_classes(super().to_onnx(), self.classes_)

    def _predict_scores(self, scores: np.ndarray) -> np.ndarray:
        return self.classes_[np.argmax(scores, axis=1)]

    def _score_predictions(self, y: np.ndarray, pred: np.ndarray, w: Any) -> float:
        return float(accuracy_score(y, pred, sample_weight=w))


_PASS_THROUGH = ("Identity", "Reshape", "Cast", "Squeeze", "Unsqueeze", "Flatten")


def _with_classes(model: onnx.ModelProto, classes: np.ndarray) -> onnx.ModelProto:
    """``model`` whose label outputs give ``classes`` (see :meth:`OnnxClassifier.to_onnx`)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    tables: dict[str, str] = {}  # initializer -> the label output reading it
    for out in model.graph.output:
        node = producers.get(out.name)
        while node is not None and node.op_type in _PASS_THROUGH and node.input:
            node = producers.get(node.input[0])
        if node is None:
            continue
        if node.op_type in ("ArrayFeatureExtractor", "Gather") and node.input[0] in inits:
            tables[node.input[0]] = out.name
        elif node.op_type == "ArgMax" and not np.array_equal(classes, np.arange(len(classes))):
            raise InputError(
                f"the model's label output {out.name!r} is the index of the best class (0 .. "
                f"{len(classes) - 1}), fit saw the classes {classes.tolist()}: map the index through "
                "classes_, or read the scores output"
            )
    if not tables:
        return model
    out_model = onnx.ModelProto()
    out_model.CopyFrom(model)
    for t in out_model.graph.initializer:
        if t.name not in tables:
            continue
        old = numpy_helper.to_array(t)
        old_list = [v.decode() if isinstance(v, bytes) else v for v in old.reshape(-1).tolist()]
        if old_list == classes.tolist():
            continue
        strings = t.data_type == onnx.TensorProto.STRING
        fits = old.size == len(classes) and (
            all(isinstance(c, str) for c in classes.tolist())
            if strings
            else classes.dtype.kind in "iub" and old.dtype.kind in "iu"
        )
        if not fits:
            raise InputError(
                f"the model's label output {tables[t.name]!r} gives the classes {old_list} it was "
                f"converted with, fit saw {classes.tolist()}, which its table ({t.name!r}, "
                f"{onnx.TensorProto.DataType.Name(t.data_type)}) cannot hold: predict() gives "
                "classes_; read the scores output with classes_"
            )
        value = np.array(classes.tolist(), dtype=object if strings else old.dtype).reshape(old.shape)
        t.CopyFrom(numpy_helper.from_array(value, t.name))
    return out_model


def _is_factory(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a factory ``params -> Optimizer`` (not a name, not a class)."""
    return callable(optimizer) and not isinstance(optimizer, str | type)


def _integer(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _weights(trainer: Trainer) -> dict[str, np.ndarray]:
    """The trainer's parameters, and the tied copies computed from them."""
    params = dict(trainer.parameters)
    for tie in trainer.fb.graphs.ties:
        params[tie.name] = tie.compute(params[tie.source])
    return params


class _Convergence(Callback):
    """scikit-learn's ``_update_no_improvement_count`` at the end of each epoch: counts the epochs
    whose training loss is not below ``best_loss_ - tol`` (or, with validation data, whose score
    is not above ``best_validation_score_ + tol``) and stops the trainer when the count exceeds
    ``n_iter_no_change``. With validation data, keeps a copy of the best epoch's weights."""

    def __init__(self, estimator: _OnnxEstimator, val: tuple[np.ndarray, np.ndarray, Any] | None) -> None:
        self.estimator, self.val = estimator, val
        self.count, self.converged = 0, False
        self.best_params: dict[str, np.ndarray] | None = None

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: Mapping[str, Any]) -> None:
        est = self.estimator
        if self.val is not None:
            score = est._validation_score(trainer, *self.val)
            est.validation_scores_.append(score)
            self.count = self.count + 1 if score < est.best_validation_score_ + est.tol else 0
            if score > est.best_validation_score_:
                est.best_validation_score_ = score
                self.best_params = {k: v.copy() for k, v in trainer.parameters.items()}
        else:
            loss = float(logs["loss"])
            self.count = self.count + 1 if loss > est.best_loss_ - est.tol else 0
            est.best_loss_ = min(est.best_loss_, loss)
        if self.count > est.n_iter_no_change:
            self.converged = trainer.stop_training = True


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
