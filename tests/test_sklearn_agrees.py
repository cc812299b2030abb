"""The estimators agree with scikit-learn where they promise to, and refuse what would make them
disagree: a converted model that does not compute the estimator, negative or NaN sample weights,
NaN targets."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("skl2onnx")

from sklearn.datasets import load_diabetes
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPRegressor
from sklearn.preprocessing import StandardScaler

from onnxgrad.errors import InputError
from onnxgrad.sklearn import OnnxRegressor


@pytest.fixture(scope="module")
def diabetes():
    X, y = load_diabetes(return_X_y=True)
    return StandardScaler().fit_transform(X)[:120], (y[:120] - y.mean()) / y.std()


def _initialised(X, y, **kwargs) -> MLPRegressor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return MLPRegressor(
            hidden_layer_sizes=(8,), max_iter=1, learning_rate_init=1e-300, random_state=0, **kwargs
        ).fit(X, y)


def test_a_converter_that_does_not_compute_the_estimator_is_named(diabetes):
    X, y = diabetes
    two = np.stack([y, y / 2], axis=1)  # skl2onnx writes an (2n, 1) output for a 2-target MLP
    with pytest.raises(
        InputError,
        match=r"skl2onnx's converter for MLPRegressor gives output 'variable' of shape \(16, 1\) on 8 rows, "
        r"where MLPRegressor.predict gives shape \(8, 2\)",
    ):
        OnnxRegressor(_initialised(X, two), epochs=1).fit(X, two)


def test_loss_curve_is_mlpregressors(diabetes):
    """Half the mean squared error, as MLPRegressor minimises and records it: the same run of
    full-batch SGD gives the same curve (float32 against float64)."""
    X, y = diabetes
    start = _initialised(X, y)
    settings = {
        "solver": "sgd",
        "momentum": 0.0,
        "nesterovs_momentum": False,
        "batch_size": len(X),
        "shuffle": False,
        "alpha": 0.0,
        "learning_rate_init": 0.05,
        "max_iter": 6,
        "tol": 0.0,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        ref = MLPRegressor(hidden_layer_sizes=(8,), random_state=0, **settings)
        ref._random_state = np.random.RandomState(0)
        ref.fit(X, y)  # from its own initialisation, which `start` holds too
    ours = OnnxRegressor(start, optimizer="sgd", lr=0.05, batch_size=len(X), shuffle=False, epochs=6).fit(
        X, y
    )
    np.testing.assert_allclose(ours.loss_curve_, ref.loss_curve_, rtol=1e-4)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("negative", r"sample_weight must be finite and >= 0; row 3 holds -1"),
        ("nan", r"sample_weight must be finite and >= 0; row 3 holds nan"),
    ],
)
def test_sample_weights_must_be_finite_and_not_negative(diabetes, weights, message):
    X, y = diabetes
    w = np.ones(len(X))
    w[3] = -1.0 if weights == "negative" else np.nan
    with pytest.raises(InputError, match=message):
        OnnxRegressor(_initialised(X, y), epochs=1).fit(X, y, sample_weight=w)


def test_nan_targets_are_named(diabetes):
    X, y = diabetes
    y = y.copy()
    y[5] = np.nan
    with pytest.raises(InputError, match=r"y must be finite; row 5 holds nan"):
        OnnxRegressor(_initialised(X, np.nan_to_num(y)), epochs=1).fit(X, y)


def test_a_classifier_without_probabilities_is_checked_on_its_labels():
    from sklearn.linear_model import SGDClassifier

    from onnxgrad.sklearn import OnnxClassifier

    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 4))
    y = (X[:, 0] + X[:, 1] > 0).astype(int)
    sgd = SGDClassifier(random_state=0).fit(X, y)  # no predict_proba: its labels are compared
    clf = OnnxClassifier(sgd, epochs=2).fit(X, y)
    assert clf.score(X, y) > 0.8


def test_the_converter_failing_is_named():
    from sklearn.svm import LinearSVC

    from onnxgrad.sklearn import OnnxClassifier

    rng = np.random.default_rng(0)
    X = rng.standard_normal((30, 3))
    y = (X[:, 0] > 0).astype(int)
    with pytest.raises(InputError, match=r"skl2onnx cannot convert LinearSVC: .*Pass an ONNX model instead"):
        OnnxClassifier(LinearSVC().fit(X, y), epochs=1).fit(X, y)


def test_an_unfitted_estimator_is_named(diabetes):
    X, y = diabetes
    with pytest.raises(InputError, match=r"MLPRegressor is not fitted: fit it first"):
        OnnxRegressor(MLPRegressor(), epochs=1).fit(X, y)


def test_a_feature_count_the_model_does_not_take_is_named(diabetes):
    X, y = diabetes
    start = _initialised(X, y)
    with pytest.raises(InputError, match=r"X has 9 features, the model's input 'X' takes 10"):
        OnnxRegressor(_onnx_of(start, X), epochs=1).fit(X[:, :9], y)


def _onnx_of(estimator, X):
    from onnxgrad.sklearn import to_onnx_model

    return to_onnx_model(estimator, X)


def test_weights_summing_to_zero_and_missing_class_labels_are_named(diabetes):
    from onnxgrad.sklearn import OnnxClassifier

    X, y = diabetes
    with pytest.raises(InputError, match=r"sample_weight sums to zero: no sample would count"):
        OnnxRegressor(_initialised(X, y), epochs=1).fit(X, y, sample_weight=np.zeros(len(X)))
    labels = (y > 0).astype(float)
    labels[7] = np.nan
    with pytest.raises(InputError, match=r"y holds NaN at row 7: a class label is missing"):
        OnnxClassifier(_onnx_of(_initialised_classifier(X), X), epochs=1).fit(X, labels)


def _initialised_classifier(X):
    from sklearn.neural_network import MLPClassifier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return MLPClassifier(hidden_layer_sizes=(4,), max_iter=1, random_state=0).fit(
            X, np.arange(len(X)) % 2
        )


def test_the_l2_penalty_is_as_given_whatever_the_loss_factor(diabetes):
    """OnnxRegressor trains half the squared error; its l2 term is l2 * ΣW² all the same."""
    X, y = diabetes
    start = _initialised(X, y)
    plain = OnnxRegressor(start, optimizer="sgd", lr=0.0, batch_size=len(X), shuffle=False, epochs=1).fit(
        X, y
    )
    l2 = OnnxRegressor(start, l2=1.0, optimizer="sgd", lr=0.0, batch_size=len(X), shuffle=False, epochs=1)
    l2.fit(X, y)
    # rank >= 2 initializers: skl2onnx's coefficients and its (1, k) intercepts
    from onnx import numpy_helper

    squares = sum(
        float((numpy_helper.to_array(t).astype(np.float64) ** 2).sum())
        for t in _onnx_of(start, X).graph.initializer
        if len(t.dims) >= 2
    )
    np.testing.assert_allclose(l2.loss_curve_[0] - plain.loss_curve_[0], squares, rtol=1e-5)
