"""The scikit-learn parameters of OnnxRegressor and OnnxClassifier: the shared ones are written once
(in the base estimator) and each estimator still shows scikit-learn its full explicit signature."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("sklearn")

from sklearn.base import clone
from sklearn.utils import estimator_checks

from onnxgrad.sklearn import OnnxClassifier, OnnxRegressor, _OnnxEstimator

# parameters both estimators take, each with a value other than its default
SHARED = {
    "output": "y",
    "optimizer": "sgd",
    "lr": 0.5,
    "max_iter": 7,
    "tol": 1e-3,
    "n_iter_no_change": 3,
    "early_stopping": True,
    "validation_fraction": 0.25,
    "epochs": 4,
    "batch_size": 16,
    "l1": 1e-4,
    "l2": 1e-3,
    "trainable": ("W",),
    "shuffle": False,
    "random_state": 3,
    "warm_start": True,
    "verbose": True,
}
OWN = {OnnxRegressor: {"loss": "huber"}, OnnxClassifier: {"scores": "logits"}}
DEFAULTS = {OnnxRegressor: {"loss": "mse"}, OnnxClassifier: {"scores": "auto"}}


def _shared_names() -> set[str]:
    """The keyword-only parameters of the base estimator: those both estimators take."""
    params = inspect.signature(_OnnxEstimator.__init__).parameters.values()
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize("cls", [OnnxRegressor, OnnxClassifier])
def test_signature_lists_every_parameter(cls):
    sig = inspect.signature(cls)
    assert set(SHARED) <= _shared_names()
    assert set(sig.parameters) == {"model", *_shared_names(), *OWN[cls]}
    assert [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD] == ["model"]
    assert all(p.kind is p.KEYWORD_ONLY for n, p in sig.parameters.items() if n != "model")
    assert sorted(cls().get_params()) == sorted(sig.parameters)
    defaults = {n: p.default for n, p in sig.parameters.items()}
    assert cls().get_params() == defaults
    assert {n: defaults[n] for n in OWN[cls]} == DEFAULTS[cls]
    assert defaults["lr"] == 1e-3 and defaults["optimizer"] == "adam" and defaults["batch_size"] == "auto"


@pytest.mark.parametrize("cls", [OnnxRegressor, OnnxClassifier])
def test_params_round_trip(cls):
    values = {**SHARED, **OWN[cls]}
    est = cls(None, **values)
    assert est.get_params() == {**cls().get_params(), **values}
    twin = clone(est)
    assert twin is not est and twin.get_params() == est.get_params()
    fresh = cls()
    assert fresh.set_params(**values) is fresh and fresh.get_params() == est.get_params()
    assert repr(cls(lr=0.5)) == f"{cls.__name__}(lr=0.5)"  # repr compares with the signature's defaults
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_rate'"):
        cls(learning_rate=0.1)
    with pytest.raises(TypeError, match="positional"):
        cls(None, "mse")


@pytest.mark.parametrize("cls", [OnnxRegressor, OnnxClassifier])
@pytest.mark.parametrize(
    "check",
    [
        "check_parameters_default_constructible",
        "check_no_attributes_set_in_init",
        "check_get_params_invariance",
        "check_set_params",
    ],
)
def test_scikit_learn_parameter_checks(cls, check):
    getattr(estimator_checks, check)(cls.__name__, cls())
