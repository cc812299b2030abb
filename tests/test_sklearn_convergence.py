"""onnxgrad.sklearn stops as scikit-learn's MLPs stop (issue 25): ``max_iter``, ``tol``,
``n_iter_no_change``, ``early_stopping`` / ``validation_fraction``, the fitted attributes that go
with them and the ConvergenceWarning. Every expected figure comes from running scikit-learn here,
on the model scikit-learn starts from (an initialised, untrained MLP converted with skl2onnx)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("skl2onnx")

from sklearn.datasets import load_diabetes, load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.preprocessing import StandardScaler

from onnxgrad.errors import InputError
from onnxgrad.sklearn import OnnxClassifier, OnnxRegressor


def initialised(cls: type, X: np.ndarray, y: np.ndarray, **kwargs):
    """The MLP scikit-learn's ``fit`` starts from, fitted structure included: one epoch at a
    learning rate of 1e-300 leaves the Glorot initial weights exactly as drawn."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return cls(max_iter=1, learning_rate_init=1e-300, **kwargs).fit(X, y)


def sklearn_fit(cls: type, X: np.ndarray, y: np.ndarray, **kwargs):
    """scikit-learn's own run and whether it warned that it did not converge."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        model = cls(**kwargs).fit(X, y)
    return model, any(issubclass(w.category, ConvergenceWarning) for w in caught)


@pytest.fixture(scope="module")
def diabetes():
    """The diabetes split a user makes: ``train_test_split(random_state=0)``, standardised X."""
    X, y = load_diabetes(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, random_state=0)
    scaler = StandardScaler().fit(X_tr)
    return scaler.transform(X_tr), scaler.transform(X_te), y_tr, y_te


MLP = {"hidden_layer_sizes": (32,), "random_state": 0}


@pytest.mark.parametrize("max_iter", [200, 1000])
def test_default_regressor_reaches_sklearns_r2(diabetes, max_iter):
    """OnnxRegressor's defaults are MLPRegressor's (Adam at 1e-3, batches of min(200, n),
    max_iter=200, tol=1e-4): from the same start it reaches the held-out R² scikit-learn reaches,
    and warns as scikit-learn warns when it stops at max_iter."""
    X_tr, X_te, y_tr, y_te = diabetes
    start = initialised(MLPRegressor, X_tr, y_tr, **MLP)
    ref, ref_warned = sklearn_fit(MLPRegressor, X_tr, y_tr, max_iter=max_iter, **MLP)
    reference = ref.score(X_te, y_te)
    kwargs = {} if max_iter == 200 else {"max_iter": max_iter}  # the defaults themselves
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        reg = OnnxRegressor(start, **kwargs).fit(X_tr, y_tr)
    warned = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert bool(warned) == ref_warned
    if warned:
        assert str(warned[0].message) == (
            f"Stochastic Optimizer: Maximum iterations ({max_iter}) reached and the optimization "
            "hasn't converged yet."
        )
        assert reg.n_iter_ == ref.n_iter_ == max_iter
    got = reg.score(X_te, y_te)
    assert got >= reference - 0.05 * max(1.0, abs(reference)), (got, reference)
    assert len(reg.loss_curve_) == reg.n_iter_ and reg.best_loss_ == min(reg.loss_curve_)
    assert reg.loss_curve_[-1] < reg.loss_curve_[0]
    assert reg.validation_scores_ is None and reg.best_validation_score_ is None
    # what the earlier defaults (10 epochs) reached from the same start: far from it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        before = OnnxRegressor(start, epochs=10, batch_size=32).fit(X_tr, y_tr).score(X_te, y_te)
    assert before < got - 0.5


def test_early_stopping_regressor(diabetes):
    """early_stopping: the R² of validation_fraction of the training set is watched, training
    stops when it no longer improves by tol, and the best epoch's weights are kept."""
    X_tr, X_te, y_tr, y_te = diabetes
    start = initialised(MLPRegressor, X_tr, y_tr, **MLP)
    params = {"early_stopping": True, "max_iter": 1000}
    ref, ref_warned = sklearn_fit(MLPRegressor, X_tr, y_tr, learning_rate_init=0.01, **params, **MLP)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)  # it converges: no warning
        reg = OnnxRegressor(start, lr=0.01, **params).fit(X_tr, y_tr)
    assert not ref_warned and reg.n_iter_ < 1000
    assert len(reg.validation_scores_) == reg.n_iter_ == len(reg.loss_curve_)
    assert reg.best_loss_ is None
    scores = reg.validation_scores_
    best = int(np.argmax(scores))
    assert reg.best_validation_score_ == scores[best]
    # it stopped because none of the last n_iter_no_change + 1 epochs beat the best by tol
    for k in range(reg.n_iter_ - reg.n_iter_no_change - 1, reg.n_iter_):
        assert scores[k] < max(scores[:k]) + reg.tol
    last = reg.n_iter_ - reg.n_iter_no_change - 1
    assert any(scores[k] >= max(scores[:k]) + reg.tol for k in range(1, last))  # it learnt before
    # the weights kept are the best epoch's: the held-out part scores best_validation_score_
    _, X_val, _, y_val = train_test_split(X_tr, y_tr, test_size=0.1, random_state=0)
    np.testing.assert_allclose(reg.score(X_val, y_val), reg.best_validation_score_, rtol=1e-6)
    reference = ref.score(X_te, y_te)
    assert reg.score(X_te, y_te) >= reference - 0.1, (reg.score(X_te, y_te), reference)


@pytest.mark.parametrize("n_iter_no_change", [1, 3])
def test_tol_and_n_iter_no_change_count_as_sklearn_does(diabetes, n_iter_no_change):
    """With a tol larger than any improvement, every epoch after the first counts as one without
    improvement: both stop after the same number of epochs, n_iter_no_change + 2."""
    X_tr, _, y_tr, _ = diabetes
    start = initialised(MLPRegressor, X_tr, y_tr, **MLP)
    kwargs = {"tol": 1e9, "n_iter_no_change": n_iter_no_change}
    ref, _ = sklearn_fit(MLPRegressor, X_tr, y_tr, **kwargs, **MLP)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        reg = OnnxRegressor(start, **kwargs).fit(X_tr, y_tr)
    assert reg.n_iter_ == ref.n_iter_ == n_iter_no_change + 2


def test_default_classifier_reaches_sklearns_accuracy():
    """The same conventions for OnnxClassifier: MLPClassifier's defaults, its accuracy, its
    warning; early stopping watches the accuracy on a stratified split."""
    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X / 16, y, random_state=0)
    start = initialised(MLPClassifier, X_tr, y_tr, **MLP)
    assert start.score(X_te, y_te) < 0.5  # nothing learnt yet
    ref, ref_warned = sklearn_fit(MLPClassifier, X_tr, y_tr, **MLP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        clf = OnnxClassifier(start).fit(X_tr, y_tr)
    assert any(issubclass(w.category, ConvergenceWarning) for w in caught) == ref_warned
    assert clf.score(X_te, y_te) >= ref.score(X_te, y_te) - 0.02
    assert clf.best_loss_ == min(clf.loss_curve_)
    ref_es, _ = sklearn_fit(MLPClassifier, X_tr, y_tr, early_stopping=True, **MLP)
    early = OnnxClassifier(start, early_stopping=True).fit(X_tr, y_tr)
    assert early.n_iter_ < 200 and len(early.validation_scores_) == early.n_iter_
    scores = np.array(early.validation_scores_)
    n_val = int(np.ceil(0.1 * len(X_tr)))
    assert np.allclose(scores * n_val, np.round(scores * n_val))  # accuracies on the held-out part
    assert early.best_validation_score_ == scores.max()
    assert early.score(X_te, y_te) >= ref_es.score(X_te, y_te) - 0.05


def test_epochs_runs_exactly_that_many(diabetes):
    """epochs= keeps the earlier behaviour: that many epochs, no convergence test, no warning."""
    X_tr, _, y_tr, _ = diabetes
    start = initialised(MLPRegressor, X_tr, y_tr, **MLP)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        reg = OnnxRegressor(start, epochs=3, tol=1e9, n_iter_no_change=1).fit(X_tr, y_tr)
    assert reg.n_iter_ == 3 and reg.best_loss_ == min(reg.loss_curve_)
    assert reg.validation_scores_ is None and reg.best_validation_score_ is None
    assert reg.partial_fit(X_tr, y_tr).n_iter_ == 4 and reg.best_loss_ == min(reg.loss_curve_)
    warm = OnnxRegressor(start, max_iter=5, warm_start=True)
    with pytest.warns(ConvergenceWarning, match=r"Maximum iterations \(5\)"):
        warm.fit(X_tr, y_tr)
    with pytest.warns(ConvergenceWarning, match=r"Maximum iterations \(5\)"):
        warm.fit(X_tr, y_tr)
    assert warm.n_iter_ == 10 and len(warm.loss_curve_) == 10  # the curve goes on, as sklearn's


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_iter": 0}, "max_iter must be >= 1, got 0"),
        ({"max_iter": 2.5}, "max_iter must be >= 1, got 2.5"),
        ({"tol": -1.0}, "tol must be >= 0, got -1.0"),
        ({"n_iter_no_change": 0}, "n_iter_no_change must be >= 1, got 0"),
        ({"validation_fraction": 1.0}, r"validation_fraction must be in \(0, 1\), got 1.0"),
        ({"epochs": 0}, "epochs must be None or >= 1, got 0"),
        ({"batch_size": "big"}, "batch_size must be 'auto' or >= 1, got 'big'"),
        ({"batch_size": True}, "batch_size must be 'auto' or >= 1, got True"),
    ],
)
def test_bad_stopping_parameters(diabetes, params, message):
    X_tr, _, y_tr, _ = diabetes
    start = initialised(MLPRegressor, X_tr, y_tr, **MLP)
    with pytest.raises(InputError, match=f"^{message}$"):
        OnnxRegressor(start, **params).fit(X_tr, y_tr)
